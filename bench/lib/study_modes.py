"""How the batching study serves a trace in each mode: our server with the
right flags, Hugging Face `generate` in process, or `transformers serve`; and
where each mode's batch utilisation comes from."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from bench.lib.backends import RequestConfig
from bench.serving.bench_serving import default_model_name, run_benchmark, warm_up
from bench.lib.datasets import DatasetRow
from bench.lib.server_launcher import LaunchedServer, free_port
from bench.plots.timeline_plot import fetch_timeline
from bench.lib.utilisation import batch_utilisation, groups_by_first_token

MODES = ("serial", "static", "dynamic", "continuous", "hf-static", "hf-serve")
OUR_MODES = ("serial", "static", "dynamic", "continuous")  # our server, which records a /timeline
TIMELINE_TRACE = "chapter"  # the trace whose timelines are saved, one PNG per mode


@dataclass
class Trace:
    name: str
    rows: list[DatasetRow]
    offsets: list[float]  # send time of each request, seconds from the start
    description: str


def our_server_flags(mode: str, args: argparse.Namespace, model_dir: str) -> list[str]:
    flags = ["--model-path", model_dir, "--max-total-tokens", str(args.max_total_tokens), "--dtype", args.dtype]
    if mode == "serial":
        return flags + ["--max-running-requests", "1"]
    flags += ["--max-running-requests", str(args.batch_size)]
    if mode == "static":
        return flags + ["--batching", "static"]
    if mode == "dynamic":
        return flags + ["--batching", "dynamic", "--batch-timeout-ms", str(args.batch_timeout_ms)]
    return flags + ["--batching", "continuous"]


def with_utilisation(mode: str, raw: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Where the utilisation comes from: the scheduler's counters when the
    server exposes them; else, for the padded modes, batches guessed from the
    first-token times (rows of one static batch share a prefill); else 1.0,
    since continuous and serial batching compute no finished rows."""
    if raw.get("batch_utilisation") is not None:
        raw["utilisation_source"] = "server counters (/get_server_info)"
    elif mode in ("static", "dynamic"):
        first = [s + t for s, t in zip(raw["send_times"], raw["ttfts"])]
        groups = groups_by_first_token(first, batch_size)
        raw["batch_utilisation"] = batch_utilisation([[raw["output_lens"][i] for i in g] for g in groups])
        raw["utilisation_source"] = "estimated from first-token groups"
    else:
        raw["batch_utilisation"] = 1.0
        raw["utilisation_source"] = "1.0 by construction (no padded rows)"
    return raw


def run_ours(mode: str, trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any,
             log_dir: str, timeline: bool = False) -> dict[str, Any]:
    """With `timeline`, raw["timeline"] holds the server's /timeline events of
    the trace (the warm-up request left out), read before the server stops."""
    log = os.path.join(log_dir, f"{trace.name}-{mode}.log")
    with LaunchedServer.ours(our_server_flags(mode, args, model_dir), log) as srv:
        cfg = RequestConfig(backend="sglang", base_url=srv.url)
        w = asyncio.run(warm_up(cfg, trace.rows[0], tokenizer.decode))
        if not w.success:
            raise RuntimeError(f"warm-up request failed: {w.error}")
        since = time.time()
        raw = run_benchmark(cfg, trace.rows, trace.offsets, tokenizer, warmup_requests=0, disable_tqdm=True)
        if timeline:
            raw["timeline"] = fetch_timeline(srv.url, since)["events"]
    return with_utilisation(mode, raw, 1 if mode == "serial" else args.batch_size)


def run_hf_static(trace: Trace, args: argparse.Namespace, batcher: Any) -> dict[str, Any]:
    raw = batcher.run_trace(trace.rows, trace.offsets, args.batch_size)
    raw["utilisation_source"] = "batch composition (exact)"
    return raw


def hf_serve_missing() -> str | None:
    """Why `transformers serve` cannot run here, or None."""
    if shutil.which("transformers") is None:
        return "the `transformers` command is not installed"
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        return f"transformers serve needs {', '.join(missing)} (pip install 'transformers[serving]')"
    return None


def run_hf_serve(trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any,
                 log_dir: str) -> dict[str, Any]:
    port = free_port()
    cmd = [shutil.which("transformers") or "transformers", "serve", model_dir, "--continuous-batching",
           "--device", "cpu", "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing is downloaded
    log = os.path.join(log_dir, f"{trace.name}-hf-serve.log")
    with LaunchedServer(cmd, port, log, env=offline, ready_timeout=args.hf_serve_timeout) as srv:
        # No ignore_eos field there (an unknown field is a 422); its per-request
        # generation_config with eos_token_id -1 turns EOS off instead.
        cfg = RequestConfig(backend="openai", base_url=srv.url, model=default_model_name(srv.url),
                            ignore_eos=False,
                            extra_body={"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})})
        raw = run_benchmark(cfg, trace.rows, trace.offsets, tokenizer, disable_tqdm=True)
    raw["batch_utilisation"] = None
    raw["utilisation_source"] = "not measured (the server exposes no row-step counters)"
    return raw


class NotRun(Exception):
    """A mode that cannot run on this machine (the reason goes in the table)."""


def run_mode(mode: str, trace: Trace, args: argparse.Namespace, model_dir: str, tokenizer: Any,
             log_dir: str, serve_missing: str | None, batchers: dict[str, Any],
             timeline: bool = False) -> dict[str, Any]:
    """timeline: for our server's modes, also record its /timeline (see run_ours)."""
    if mode == "hf-serve":
        if serve_missing:
            raise NotRun(serve_missing)
        return run_hf_serve(trace, args, model_dir, tokenizer, log_dir)
    if mode == "hf-static":
        if "hf" not in batchers:  # loaded once, kept for the next trace
            from bench.lib.hf_static import HFStaticBatcher
            batchers["hf"] = HFStaticBatcher(model_dir, args.dtype)
        return run_hf_static(trace, args, batchers["hf"])
    return run_ours(mode, trace, args, model_dir, tokenizer, log_dir, timeline)
