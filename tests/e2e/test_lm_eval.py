"""lm-eval's `local-completions` model against the real server (float32, the
default model) on a tiny log-likelihood task kept in the repo
(tests/e2e/lm_eval_task: 6 items, 2-4 choices each, loaded from a local jsonl,
nothing downloaded, HF_*_OFFLINE set).

lm-eval runs as a user runs it, by its CLI with its defaults:

    lm_eval --model local-completions \
        --model_args model=<model folder>,base_url=http://HOST:PORT/v1/completions \
        --include_path tests/e2e/lm_eval_task --tasks batchserve_tiny_ll \
        --output_path OUT --log_samples

With those defaults it probes /tokenizer_info (absent here: it falls back to
the Hugging Face tokenizer of `model`), tokenizes each context and
continuation itself, and posts one request per (context, choice):
`{"prompt": [[token ids]], "echo": true, "logprobs": 1, "max_tokens": 1,
"temperature": 0, "seed": 1234, "model": ...}`; it sums the echoed
`token_logprobs[ctxlen:-1]` (the last entry is the generated token) and calls
the choice greedy when each of those equals its position's top-1 logprob.

A recording proxy between lm-eval and the server keeps what lm-eval sent.
Each logged per-item score (log-likelihood, is_greedy) is compared with a
direct computation: one teacher-forced float32 forward of context +
continuation with transformers on the same model folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from glob import glob
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
import torch

from tests.e2e.server_process import ROOT, ServerProcess
from tests.helpers import load_hf

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")
pytest.importorskip("tenacity", reason="lm-eval's API models need its [api] extra (pip install 'lm-eval[api]')")

TASK_DIR = os.path.join(ROOT, "tests", "e2e", "lm_eval_task")
TASK = "batchserve_tiny_ll"
ITEMS = os.path.join(TASK_DIR, "items.jsonl")

# Both sides run float32 with different kernels (the server's paged attention
# and its own Llama forward, transformers' eager model): per token their
# logprobs differ by ~1e-5 (logits of magnitude ~10-30 at float32's ~1e-7
# relative precision, accumulated over 30 layers), and an item sums at most a
# handful of tokens. 1e-3 per item is well above that noise and well below
# what any real fault moves a score by (a shifted position, a missing or extra
# token, a bfloat16 forward: 1e-2 to whole nats).
ABS_TOL = 1e-3
# is_greedy is compared only where no continuation token is within this of a
# tie with the best other token (either side could then break the tie apart).
NEAR_TIE = 1e-3


class RecordingProxy:
    """Forwards every request to `target` and records (method, path, json body,
    status, json response)."""

    def __init__(self, target: str) -> None:
        self.calls: list[dict[str, Any]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                r = requests.request(method, target + self.path, data=body or None, timeout=300,
                                     headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                try:
                    sent = json.loads(body) if body else None
                except ValueError:
                    sent = body.decode(errors="replace")
                try:
                    got = r.json()
                except ValueError:
                    got = r.text
                proxy.calls.append({"method": method, "path": self.path, "json": sent,
                                    "status": r.status_code, "response": got})
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(shared_float32_server: ServerProcess) -> ServerProcess:
    # the session's shared float32 server (tests/conftest.py), the default model; its reasoning
    # parser acts on chat only, and lm-eval posts to /v1/completions
    return shared_float32_server


def run_lm_eval(base_url: str, model_dir: str, out_dir: str, home: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_EVALUATE_OFFLINE="1", HF_HOME=home, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model={model_dir},base_url={base_url}/v1/completions",
           "--include_path", TASK_DIR, "--tasks", TASK,
           "--output_path", out_dir, "--log_samples"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) request into tokens: the
    context's trailing spaces go to the continuation, the pair is encoded
    whole (no special tokens), and the continuation is what follows the
    context's own tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


@torch.inference_mode()
def direct_score(model: Any, ctx: list[int], cont: list[int]) -> tuple[float, bool, float]:
    """(sum of the continuation's logprobs, greedy, smallest margin to a tie)
    from one teacher-forced float32 forward of context + continuation."""
    ids = ctx + cont
    lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    total, greedy, margin = 0.0, True, float("inf")
    for i, t in enumerate(cont):
        row = lps[len(ctx) + i - 1]
        target = row[t].item()
        others = row.clone()
        others[t] = -float("inf")
        best_other = others.max().item()
        total += target
        greedy &= target > best_other
        margin = min(margin, abs(target - best_other))
    return total, greedy, margin


def test_lm_eval_local_completions_scores_equal_a_direct_computation(server, default_model_dir, tmp_path):
    from transformers import AutoTokenizer

    proxy = RecordingProxy(server.url)
    try:
        t0 = time.monotonic()
        proc = run_lm_eval(proxy.url, default_model_dir, str(tmp_path / "out"), str(tmp_path / "hf_home"))
        lm_eval_s = time.monotonic() - t0
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    # what lm-eval sent: one echo request per (item, choice), the prompt as token ids
    docs = [json.loads(line) for line in open(ITEMS) if line.strip()]
    n_requests = sum(len(d["choices"]) for d in docs)
    completions = [c for c in proxy.calls if c["path"] == "/v1/completions"]
    assert len(completions) == n_requests, [(c["method"], c["path"], c["status"]) for c in proxy.calls]
    for c in completions:
        assert c["status"] == 200, c
        body = c["json"]
        assert body["echo"] is True and body["logprobs"] == 1 and body["max_tokens"] == 1, body
        assert body["temperature"] == 0
        prompt = body["prompt"]
        assert isinstance(prompt, list) and len(prompt) == 1 and all(isinstance(t, int) for t in prompt[0]), body
        lp = c["response"]["choices"][0]["logprobs"]
        # the prompt's tokens echoed (the first without a logprob), then the one generated token
        assert len(lp["token_logprobs"]) == len(prompt[0]) + 1 and lp["token_logprobs"][0] is None
    sent_prompts = sorted(c["json"]["prompt"][0] for c in completions)

    # lm-eval's per-item scores against the direct computation
    [samples_file] = glob(str(tmp_path / "out" / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    samples = sorted((json.loads(line) for line in open(samples_file)), key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == docs
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = load_hf(default_model_dir)
    rows, expected_prompts, expected_acc = [], [], []
    for s in samples:
        doc = s["doc"]
        args = [s["arguments"][f"gen_args_{k}"] for k in range(len(doc["choices"]))]
        # the task's requests: the question, then " " + each choice
        assert [(a["arg_0"], a["arg_1"]) for a in args] == [(doc["question"], " " + ch) for ch in doc["choices"]]
        scores = []
        for choice, a, (ll, greedy) in zip(doc["choices"], args, s["filtered_resps"]):
            ctx, cont = encode_pair(tok, a["arg_0"], a["arg_1"])
            expected_prompts.append(ctx + cont)
            ref_ll, ref_greedy, margin = direct_score(model, ctx, cont)
            rows.append((doc["question"], choice, len(cont), float(ll), ref_ll, str(greedy) == "True",
                         ref_greedy, margin))
            scores.append(ref_ll)
        expected_acc.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["label"]))
    report = "\n".join(f"{q!r} + {c!r} ({n} tok): lm-eval {ll:.6f} direct {ref:.6f} diff {ll - ref:+.2e} "
                       f"greedy {g}/{rg} margin {m:.3g}" for q, c, n, ll, ref, g, rg, m in rows)
    print(f"lm-eval CLI took {lm_eval_s:.1f} s\n{report}")

    # lm-eval sent exactly the token ids the direct computation scores
    assert sent_prompts == sorted(expected_prompts)
    assert max(abs(r[3] - r[4]) for r in rows) <= ABS_TOL, report
    compared = [r for r in rows if r[7] > NEAR_TIE]
    assert len(compared) >= len(rows) - 1, report  # the items are chosen far from ties
    assert all(r[5] == r[6] for r in compared), report
    assert any(r[6] for r in compared) and not all(r[6] for r in compared), report  # both cases covered
    assert [s["acc"] for s in samples] == expected_acc
