"""bench/serving/prefix_cache.py and the prefix-cache side of bench_serving: the
multi-turn driver and cached-token accounting against a fake server whose
"cache" is known, the report on made-up rows, and one tiny end-to-end run
against our real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from aiohttp import web

from bench.serving import bench_serving, prefix_cache
from bench.lib.datasets import DatasetRow
from bench.lib.metrics import RequestResult, summarize


class FakeServer:
    """SGLang's /generate (streamed or not) and /v1/chat/completions on a
    background loop. Every answer is max_new_tokens words of the tiny model's
    vocabulary ("w3 w10 ..."), unique per request; a token is a whitespace-
    separated word; cached_tokens is the longest word prefix the prompt shares
    with an earlier prompt (a cache of prompts alone, emptied by /flush_cache)."""

    def __init__(self, delay: float = 0.005) -> None:
        self.delay = delay
        self.log: list[dict[str, Any]] = []  # per request: prompt, messages, answer, arrived, answered
        self.seen: list[list[str]] = []
        self.flushes = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_route("*", "/flush_cache", self.flush)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    def _admit(self, prompt: str, n: int, messages: Any = None) -> tuple[dict[str, Any], int, int]:
        words = prompt.split()
        cached = max((next((i for i, (a, b) in enumerate(zip(words, s)) if a != b), min(len(words), len(s)))
                      for s in self.seen), default=0)
        self.seen.append(words)
        k = len(self.log)
        entry = {"prompt": prompt, "messages": messages, "arrived": time.perf_counter(),
                 "answer": " ".join(f"w{3 + (k * 37 + j * 11) % 500}" for j in range(n))}
        self.log.append(entry)
        return entry, len(words), cached

    async def flush(self, request: web.Request) -> web.Response:
        self.seen.clear()
        self.flushes += 1
        return web.json_response({"message": "Cache flushed."})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        entry, prompt_tokens, cached = self._admit(body["text"], n)
        words = entry["answer"].split()

        def event(i: int) -> dict[str, Any]:
            return {"text": " ".join(words[:i]), "meta_info": {
                "prompt_tokens": prompt_tokens, "completion_tokens": i, "cached_tokens": cached,
                "finish_reason": {"type": "length", "length": n} if i == n else None}}

        if not body.get("stream"):
            await asyncio.sleep(self.delay * n)
            entry["answered"] = time.perf_counter()
            return web.json_response(event(n))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, n + 1):
            await asyncio.sleep(self.delay)
            await resp.write(f"data: {json.dumps(event(i))}\n\n".encode())
        entry["answered"] = time.perf_counter()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert not body["stream"]
        rendered = "\n".join(f"<{m['role']}> {m['content']}" for m in body["messages"])
        entry, prompt_tokens, cached = self._admit(rendered, body["max_tokens"], body["messages"])
        await asyncio.sleep(self.delay)
        entry["answered"] = time.perf_counter()
        return web.json_response({
            "choices": [{"index": 0, "message": {"role": "assistant", "content": entry["answer"]}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                      "prompt_tokens_details": {"cached_tokens": cached}}})


@pytest.fixture
def fake():
    srv = FakeServer()
    yield srv
    srv.stop()


def turns_of(prompt: str) -> int:
    return prompt.count("<|im_start|>user")


@pytest.mark.parametrize("stream", [True, False])
def test_multi_turn_sends_each_turn_after_the_previous_answer_with_that_answer_in_it(
        fake, tiny_served_model, tmp_path, capsys, stream):
    out = tmp_path / "mt.jsonl"
    r = bench_serving.main(["--base-url", fake.url, "--tokenizer", tiny_served_model, "--dataset-name", "multi-turn",
                            "--multi-turn-conversations", "3", "--multi-turn-turns", "4",
                            "--multi-turn-question-len", "5", "--multi-turn-output-len", "6",
                            "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(out)]
                           + ([] if stream else ["--disable-stream"]))
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["conversation_ids"] == [0] * 4 + [1] * 4 + [2] * 4 and r["turn_ids"] == [0, 1, 2, 3] * 3
    log = fake.log
    assert len(log) == 12 and sum(turns_of(e["prompt"]) == 1 for e in log) == 3
    for e in log:
        if turns_of(e["prompt"]) == 1:
            continue
        # the previous turn of this conversation: its prompt and the server's answer start this one
        prev = [p for p in log if turns_of(p["prompt"]) == turns_of(e["prompt"]) - 1
                and e["prompt"].startswith(p["prompt"] + p["answer"])]
        assert len(prev) == 1
        assert e["arrived"] >= prev[0]["answered"]  # sent only once that answer had arrived
        assert e["prompt"].endswith("<|im_start|>assistant\n")

    # each turn after the first hits the fake's cache with the whole previous prompt (and a first
    # turn at most with the "<|im_start|>user" word another conversation's prompt began with)
    for i, (k, cached) in enumerate(zip(r["turn_ids"], r["cached_tokens"])):
        assert cached == r["input_lens"][i - 1] if k else cached <= 1
    assert r["total_cached_tokens"] == sum(r["cached_tokens"]) > 0
    assert r["cache_hit_rate"] == pytest.approx(r["total_cached_tokens"] / r["total_input_tokens"])
    share = prefix_cache.multi_turn_share(r)
    assert 0 <= r["cache_hit_rate"] - share <= 3 / r["total_input_tokens"]
    assert sorted(r["input_lens"]) == sorted(len(e["prompt"].split()) for e in log)
    line = json.loads(out.read_text())
    assert line["dataset_name"] == "multi-turn" and line["cache_hit_rate"] == pytest.approx(r["cache_hit_rate"])
    assert line["cached_tokens"] == r["cached_tokens"]
    assert "Cache hit rate (cached / input tokens):" in capsys.readouterr().out


def test_multi_turn_on_the_chat_route_sends_the_conversation_as_messages(fake, tiny_served_model):
    r = bench_serving.main(["--base-url", fake.url, "--tokenizer", tiny_served_model, "--dataset-name", "multi-turn",
                            "--backend", "openai-chat", "--model", "m", "--disable-stream",
                            "--multi-turn-conversations", "2", "--multi-turn-turns", "3",
                            "--multi-turn-question-len", "4", "--multi-turn-output-len", "3",
                            "--warmup-requests", "0", "--disable-tqdm"])
    assert r["completed"] == 6
    by_len = {}
    for e in fake.log:
        by_len.setdefault(len(e["messages"]), []).append(e)
    assert sorted(by_len) == [1, 3, 5] and all(len(v) == 2 for v in by_len.values())
    for n in (3, 5):
        for e in by_len[n]:
            assert [m["role"] for m in e["messages"]] == ["user", "assistant"] * (n // 2) + ["user"]
            prev = [p for p in by_len[n - 2] if e["messages"][:n - 2] == p["messages"]]
            assert len(prev) == 1 and e["messages"][n - 2]["content"] == prev[0]["answer"]
    assert r["total_cached_tokens"] > 0  # read from usage.prompt_tokens_details


def test_shared_prefix_through_bench_serving_records_the_servers_cached_tokens(fake, tiny_served_model):
    r = bench_serving.main(["--base-url", fake.url, "--tokenizer", tiny_served_model,
                            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3",
                            "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "20",
                            "--gsp-question-len", "5", "--gsp-output-len", "3", "--max-concurrency", "1",
                            "--flush-cache", "--disable-tqdm"])
    assert r["completed"] == 12 and r["total_output_tokens"] == 36
    assert fake.flushes == 1 and len(fake.log) == 13  # the warm-up, then the cache emptied
    # one at a time: every prompt but each group's first finds its system prompt (and nothing more)
    assert sorted(r["cached_tokens"]) == [0] * 3 + [20] * 9
    assert r["cache_hit_rate"] == pytest.approx(9 * 20 / (12 * 25))


def test_hit_rate_is_cached_over_prompt_tokens_of_the_answered_requests():
    rs = [RequestResult(success=True, prompt_len=100, cached_tokens=80, output_len=2, latency=1.0),
          RequestResult(success=True, prompt_len=50, cached_tokens=0, output_len=2, latency=1.0),
          RequestResult(success=False, prompt_len=0, cached_tokens=0, error="boom")]
    s = summarize(rs, 1.0)
    assert s["total_cached_tokens"] == 80 and s["cache_hit_rate"] == pytest.approx(80 / 150)
    assert summarize([], 1.0)["cache_hit_rate"] == 0.0


# ---- report -------------------------------------------------------------------------------------------


def row(workload: str, cache: str, tps: float, ttft: float, hit: float) -> dict[str, Any]:
    return {"workload": workload, "cache": cache, "server_flags": "", "load_average": [1.5, 1.0, 0.5],
            "output_throughput": tps, "ttft_p50": ttft, "ttft_p99": 2 * ttft, "cache_hit_rate": hit,
            "prefix_share": 0.8, "total_input_tokens": 1000, "total_cached_tokens": int(1000 * hit),
            "cpu_wait": 0.1, "status": "ok"}


def test_ratios_are_cache_on_over_cache_off_per_workload():
    rows = [row("shared-prefix", "on", 300.0, 100.0, 0.75), row("shared-prefix", "off", 200.0, 400.0, 0.0),
            row("multi-turn", "on", 150.0, 50.0, 0.5),
            {"workload": "multi-turn", "cache": "off", "load_average": [2.0, 1, 1], "status": "failed: boom"}]
    rs = prefix_cache.ratios(rows)
    assert rs[0] == {"workload": "shared-prefix", "ttft_p50_ratio": 0.25, "ttft_p99_ratio": 0.25,
                     "throughput_ratio": 1.5}
    assert rs[1] == {"workload": "multi-turn", "ttft_p50_ratio": None, "ttft_p99_ratio": None,
                     "throughput_ratio": None}
    table = prefix_cache.markdown_tables(rows, rs)
    assert "| shared-prefix | on | 300.0 | 100 | 200 | 0.750 | 0.800 | 1000 | 750 | 1.50 | 10% | ok |" in table
    assert "| shared-prefix | 0.25 | 0.25 | 1.50 |" in table and "| multi-turn | — | — | — |" in table
    assert "failed: boom" in table
    assert prefix_cache.notes(rows) == []


def test_notes_say_when_the_hit_rates_show_no_cache_or_a_cache_that_was_not_off():
    none = [row("shared-prefix", "on", 1.0, 1.0, 0.0), row("shared-prefix", "off", 1.0, 1.0, 0.0)]
    assert "no prefix cache" in prefix_cache.notes(none)[0]
    leaky = [row("shared-prefix", "on", 1.0, 1.0, 0.7), row("shared-prefix", "off", 1.0, 1.0, 0.3)]
    assert len(prefix_cache.notes(leaky)) == 1 and "off flags" in prefix_cache.notes(leaky)[0]


def test_prefix_share_of_a_shared_prefix_trace_counts_each_groups_system_prompt_after_its_first():
    rows = [DatasetRow("x", 10, 1, group=0, prefix_len=8), DatasetRow("x", 12, 1, group=1, prefix_len=6),
            DatasetRow("x", 10, 1, group=0, prefix_len=8), DatasetRow("x", 10, 1, group=0, prefix_len=8)]
    assert prefix_cache.shared_prefix_share(rows) == pytest.approx(16 / 42)


def test_multi_turn_share_skips_failed_turns():
    raw = {"input_lens": [10, 30, 0, 20, 50], "conversation_ids": [0, 0, 0, 1, 1],
           "errors": ["", "", "not sent", "", ""]}
    assert prefix_cache.multi_turn_share(raw) == pytest.approx((10 + 20) / 110)


def test_the_off_mode_defaults_to_disable_radix_cache_and_a_run_that_fails_is_kept(monkeypatch):
    args = prefix_cache.parse_args(["--quiet-threshold", "1", "--server-args=--max-running-requests 4"])
    assert args.off_server_args == ["--disable-radix-cache"] and args.on_server_args == []
    assert prefix_cache.mode_flags(args, "off") == ["--max-running-requests", "4", "--disable-radix-cache"]

    def refuse(*_: Any) -> dict[str, Any]:
        raise RuntimeError("server did not start (python launch.py ...):\nunrecognized arguments")

    monkeypatch.setattr(prefix_cache, "measure", refuse)
    w = prefix_cache.Workload("shared-prefix", "d", [0.0], rows=[DatasetRow("x", 1, 1)])
    r = prefix_cache.run_one(w, "off", args, "m", None, DatasetRow("x", 1, 1), ".")
    assert r["status"] == "failed: RuntimeError: server did not start (python launch.py ...):"
    assert r["server_flags"] == "--max-running-requests 4 --disable-radix-cache" and r["attempts"] == 1


# ---- end to end ---------------------------------------------------------------------------------------


def test_prefix_cache_bench_serves_both_workloads_with_the_cache_on_and_off(tiny_served_model, tmp_path, recorded):
    argv = ["--model-path", tiny_served_model, "--num-groups", "2", "--prompts-per-group", "3",
            "--system-prompt-len", "48", "--question-len", "8", "--output-len", "4",
            "--num-conversations", "2", "--num-turns", "3", "--turn-question-len", "8", "--turn-output-len", "4",
            "--server-args=--max-running-requests 4 --max-total-tokens 1024",
            "--quiet-threshold", "1", "--out-dir", str(tmp_path), "--record"]
    result = prefix_cache.main(argv)

    saved = json.loads((tmp_path / "prefix_cache.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["command"].startswith("python -m bench.serving.prefix_cache --model-path")
    rows = saved["rows"]
    assert [(r["workload"], r["cache"]) for r in rows] == [
        ("shared-prefix", "on"), ("shared-prefix", "off"), ("multi-turn", "on"), ("multi-turn", "off")]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["completed"] == 6 and r["flushed"]
        assert r["output_throughput"] > 0 and 0 < r["ttft_p50"] <= r["ttft_p99"]
        assert 0 <= r["cache_hit_rate"] <= 1
        assert r["cache_hit_rate"] == pytest.approx(r["total_cached_tokens"] / r["total_input_tokens"])
        assert 0 < r["prefix_share"] < 1 and len(r["load_average"]) == 3
    assert rows[0]["server_flags"] == "--max-running-requests 4 --max-total-tokens 1024"
    assert rows[1]["server_flags"].endswith("--disable-radix-cache")
    # the cache hits where it is on, never where it is off
    assert rows[0]["cache_hit_rate"] > 0 and rows[2]["cache_hit_rate"] > 0
    assert rows[1]["cache_hit_rate"] == 0 and rows[3]["cache_hit_rate"] == 0
    # 4 of the 6 prompts repeat a 48-word system prompt of 48 + 8 words
    assert rows[0]["prefix_share"] == pytest.approx(4 * 48 / (6 * 56))
    assert [x["workload"] for x in saved["ratios"]] == ["shared-prefix", "multi-turn"]
    assert all(x["throughput_ratio"] > 0 and x["ttft_p50_ratio"] > 0 for x in saved["ratios"])
    record = recorded.check("bench.serving.prefix_cache")  # --record
    assert record.data == {"rows": saved["rows"], "ratios": saved["ratios"]}

    md = (tmp_path / "prefix_cache.md").read_text()
    assert "python -m bench.serving.prefix_cache --model-path" in md
    assert "| shared-prefix | on |" in md and "| multi-turn | off |" in md
    assert "TTFT p50, on / off" in md
