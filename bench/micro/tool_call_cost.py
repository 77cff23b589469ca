"""What constraining a tool call costs: a chat step with 8 tools, tool_choice "required" against the same prompt free.

    python -m bench.micro.tool_call_cost                 # batch 1 and 16, 3 rounds: ~2 min on 2 quiet cores
    python -m bench.micro.tool_call_cost --batches 1 16 --rounds 3 --no-write

One server of ours (launch.py, default flags plus --max-running-requests the
largest batch; the default model, SmolLM2-135M, whose tools are rendered by
the shipped chatml-tools template), one client. The prompt is a chat turn
with 8 tools (weather, time, search, ...) in the system prompt. For each
batch size B, B such requests are sent at once in two cases that take turns,
--rounds times, so a change in the machine's load hits both alike:
- `required`: tool_choice "required" (parallel_tool_calls false): every
  token is masked by the tools' structural tag (xgrammar), and the call ends
  the answer;
- `free`: the same prompt ids (SGLang's `input_ids` on the chat route), no
  tools and no grammar, --free-tokens tokens with ignore_eos.
Requests are streamed with logprobs (a chunk per token, even one the tool
parser holds back); a case's figure is its median inter-token latency (ITL)
over every token of every request of every round: the decode step as a
user sees it, whatever the answers' lengths; `ratio` is required's over
free's. Every `required` answer is checked: one call, its arguments valid
JSON. The first `required` request on the fresh server (xgrammar's
vocabulary loaded, the grammar compiled, the prompt prefilled) is timed
apart, beside the same request again, and the grammar's compile alone.

Output: its record bench/results/latest/tool_call_cost.json and bench/RESULTS.md (rendered again);
--no-write: stdout only
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import requests

from bench.lib.run_record import LoadAverage, record_run
from bench.lib.server_launcher import LaunchedServer


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", "Current weather in a city", {"city": {"type": "string", "maxLength": 24},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _tool("get_time", "Current time in a timezone", {"timezone": {"type": "string", "maxLength": 32}}, ["timezone"]),
    _tool("web_search", "Search the web", {"query": {"type": "string", "maxLength": 64},
                                           "results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    _tool("calculate", "Evaluate an arithmetic expression", {"expression": {"type": "string", "maxLength": 64}},
          ["expression"]),
    _tool("send_email", "Send an email", {"to": {"type": "string", "maxLength": 48},
                                          "subject": {"type": "string", "maxLength": 48},
                                          "body": {"type": "string", "maxLength": 40}}, ["to", "subject"]),
    _tool("create_event", "Add a calendar event", {"title": {"type": "string", "maxLength": 48},
                                                   "day": {"type": "string", "maxLength": 10},
                                                   "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
          ["title", "day"]),
    _tool("translate", "Translate a text", {"text": {"type": "string", "maxLength": 40},
                                            "target": {"enum": ["en", "fr", "de", "es", "it"]}}, ["text", "target"]),
    _tool("stock_price", "A stock's last price", {"symbol": {"type": "string", "maxLength": 8}}, ["symbol"]),
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


def prompt_ids() -> list[int]:
    """The chat prompt with the tools, as the server renders it."""
    from common.server_args import ServerArgs, default_model_path
    from model_proc.weights import resolve_model_path
    from tokenizer_proc.tokenizer import load_tokenizer

    gguf = default_model_path()
    tok = load_tokenizer(resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir))
    return tok.apply_chat_template(MESSAGES, tools=TOOLS)


def grammar_compile_ms() -> float:
    """The 8 tools' "required" grammar compiled against the default model's vocabulary, as the scheduler does."""
    import xgrammar as xgr

    from common.server_args import ServerArgs, default_model_path
    from common.tokenizer_files import load_hf_tokenizer
    from model_proc.weights import resolve_model_path
    from tokenizer_proc.tools import tool_request

    gguf = default_model_path()
    hf = load_hf_tokenizer(resolve_model_path(gguf, ServerArgs(model_path=gguf).cache_dir))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[hf.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar = tool_request({"tools": TOOLS, "tool_choice": "required"}, "hermes").grammar()
    start = time.perf_counter()
    compiler.compile_structural_tag(grammar.text)
    return 1e3 * (time.perf_counter() - start)


def body(case: str, ids: list[int], free_tokens: int, seed: int) -> dict[str, Any]:
    if case == "required":
        return {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0.7, "seed": seed}
    return {"model": "m", "messages": MESSAGES, "input_ids": ids, "max_tokens": free_tokens, "ignore_eos": True,
            "temperature": 0.7, "seed": seed}


def one(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(url + "/v1/chat/completions", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()


def check_call(answer: dict[str, Any]) -> None:
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
    json.loads(calls[0]["function"]["arguments"])


def streamed_gaps(url: str, payload: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
    """The gaps between a streamed answer's tokens (logprobs on: a chunk per
    token, even one the tool parser holds back), and its calls and finish."""
    payload = {**payload, "stream": True, "logprobs": True}
    times: list[float] = []
    args, finish = "", None
    with requests.post(url + "/v1/chat/completions", json=payload, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("logprobs"):
                    times.append(time.perf_counter())
                for call in choice["delta"].get("tool_calls") or []:
                    args += call["function"].get("arguments", "")
                finish = choice.get("finish_reason") or finish
    return [b - a for a, b in zip(times, times[1:])], {"arguments": args, "finish_reason": finish}


def run_batch(url: str, case: str, b: int, ids: list[int], free_tokens: int, seed: int) -> list[float]:
    """The inter-token gaps of B requests sent at once."""
    payloads = [body(case, ids, free_tokens, seed + k) for k in range(b)]
    with concurrent.futures.ThreadPoolExecutor(b) as pool:
        answers = list(pool.map(lambda p: streamed_gaps(url, p), payloads))
    if case == "required":
        for _, end in answers:
            assert end["finish_reason"] == "tool_calls", end
            json.loads(end["arguments"])
    return [gap for gaps, _ in answers for gap in gaps]


def report(command: str, rows: list[list[str]], cold: tuple[float, float], compile_ms: float, rounds: int,
           load: tuple[list[float], list[float]]) -> str:
    header = ["B", "required ITL ms", "free ITL ms", "ratio", "required tok/s", "free tok/s"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    start, end = (" / ".join(f"{x:.1f}" for x in la) for la in load)
    return (f"\n## Tool calls: what the constraint costs, {datetime.date.today().isoformat()}\n\n"
            f"`{command}`\n\n"
            f"Default model (SmolLM2-135M), server defaults plus --max-running-requests the largest B, "
            f"{platform.machine()}, {os.cpu_count()} cores; load average (1/5/15 min) {start} at the start, "
            f"{end} at the end. A chat turn with 8 tools in its prompt (shipped chatml-tools template), B requests "
            f"at once, streamed; `required`: tool_choice \"required\", one call, every token masked by the tools' "
            f"structural tag; `free`: the same prompt ids, no grammar, ignore_eos. ITL = the median gap between "
            f"a request's streamed tokens, over every token of every request of {rounds} rounds, the cases "
            f"taking turns; ratio = required ITL / free ITL; tok/s = B / ITL, the batch's decode rate. The first "
            f"required request on the fresh server (xgrammar's vocabulary loaded, the grammar compiled, the "
            f"prompt prefilled) took {cold[0]:.2f} s, the same request again (grammar and prompt cached) "
            f"{cold[1]:.2f} s; the 8 tools' grammar compiles in {compile_ms:.0f} ms (measured in this "
            f"process).\n\n{table}\n")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--free-tokens", type=int, default=48, help="the free case's answer length (about a call's)")
    p.add_argument("--url", default=None, help="a running server of ours instead of launching one")
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    load_start = list(os.getloadavg())
    ids = prompt_ids()
    server = None
    if args.url is None:
        log = os.path.join(tempfile.mkdtemp(prefix="tool_call_cost-"), "server.log")
        server = LaunchedServer.ours(["--max-running-requests", str(max(args.batches))], log).start()
    url = args.url or server.url
    try:
        start = time.perf_counter()
        check_call(one(url, body("required", ids, args.free_tokens, 0)))
        cold = time.perf_counter() - start
        start = time.perf_counter()
        check_call(one(url, body("required", ids, args.free_tokens, 0)))
        cold_pair = (cold, time.perf_counter() - start)
        rows, results = [], []
        for b in args.batches:
            gaps: dict[str, list[float]] = {"required": [], "free": []}
            for r in range(args.rounds):
                for case in ("required", "free"):
                    gaps[case] += run_batch(url, case, b, ids, args.free_tokens, 1000 * r)
            req, free = (statistics.median(gaps[c]) for c in ("required", "free"))
            rows.append([str(b), f"{1e3 * req:.1f}", f"{1e3 * free:.1f}", f"{req / free:.2f}x",
                         f"{b / req:.1f}", f"{b / free:.1f}"])
            results.append({"batch": b, "required_itl_ms": 1e3 * req, "free_itl_ms": 1e3 * free,
                            "ratio": req / free})
            print(" ".join(rows[-1]), flush=True)
    finally:
        if server is not None:
            server.stop()
    command = " ".join(["python -m bench.micro.tool_call_cost", *(sys.argv[1:] if argv is None else argv)])
    text = report(command, rows, cold_pair, grammar_compile_ms(), args.rounds, (load_start, list(os.getloadavg())))
    print(text)
    if not args.no_write:
        record_run(text, "bench.micro.tool_call_cost", data=results,
                   load_average=LoadAverage(load_start, list(os.getloadavg())))
    return results


if __name__ == "__main__":
    main()
