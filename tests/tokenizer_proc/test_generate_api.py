"""Native /generate: stop strings, n samples, lists of prompts, logprobs, and
aborting every request of a fanned-out one (fake scheduler behind the app)."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

from common.messages import StopMatchedReq
from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import Server, open_raw, post, read_until, sse_events, wait_until


def split_stop(server: Server) -> tuple[str, str, list[int]]:
    """A stop string that straddles two of the fake scheduler's 3-token chunks:
    (stop, the text expected before it, the output ids up to the token that completes it)."""
    tok, script = server.tokenizer, server.script
    for c in range(1, len(script) // 3):
        before, after = tok.decode(script[:3 * c]), tok.decode(script[:3 * c + 3])
        if (len(before) >= 6 and len(after) - len(before) >= 2 and TEXT.startswith(after)
                and "\ufffd" not in after):
            stop = TEXT[len(before) - 2:len(before) + 2]
            if TEXT.find(stop) == len(before) - 2:
                k = next(k for k in range(len(script) + 1) if stop in tok.decode(script[:k]))
                return stop, TEXT[:len(before) - 2], script[:k]
    raise AssertionError("no chunk boundary to split a stop string across")


def requests_for(server: Server, prefix: str) -> list[Any]:
    return [r for r in server.fake.requests() if r.rid.startswith(prefix)]


def test_stop_string_split_across_stream_chunks(server: Server) -> None:
    stop, expect, ids = split_stop(server)
    status, _, body = post(server, {"text": "hi", "stream": True, "rid": "stop-stream",
                                    "sampling_params": {"stop": ["never-there", stop]}})
    assert status == 200
    events = sse_events(body)
    for e in events:  # never a part of the stop string, at any point
        assert expect.startswith(e["text"]), (e["text"], expect)
    last = events[-1]
    assert last["text"] == expect
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert last["output_ids"] == ids and last["meta_info"]["completion_tokens"] == len(ids)
    # The tokenizer finished it and told the scheduler to free its KV, naming
    # the match, so that the scheduler records a stop (metrics, timeline).
    wait_until(lambda: "stop-stream" in server.fake.stops())
    assert [m.matched for m in server.fake.received
            if isinstance(m, StopMatchedReq) and m.rid == "stop-stream"] == [stop]
    assert "stop-stream" not in server.fake.aborts()
    wait_until(lambda: "stop-stream" not in server.in_flight())


def test_stop_string_non_streaming(server: Server) -> None:
    stop, expect, ids = split_stop(server)
    status, _, body = post(server, {"text": "hi", "rid": "stop-plain", "sampling_params": {"stop": stop}})
    assert status == 200
    out = json.loads(body)
    assert out["text"] == expect and out["output_ids"] == ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Rows were asked for as they come, so the stop could end it early.
    assert requests_for(server, "stop-plain")[0].stream
    wait_until(lambda: "stop-plain" in server.fake.stops())


def test_stop_string_prefix_at_the_end_is_released(server: Server) -> None:
    """Text held back as a possible stop string start is shown when the output ends."""
    status, _, body = post(server, {"text": "hi", "stream": True,
                                    "sampling_params": {"stop": TEXT[-2:] + "!!"}})
    events = sse_events(body)
    assert status == 200 and events[-1]["text"] == TEXT
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"  # the EOS token
    assert any(not e["text"].endswith(TEXT[-2:]) for e in events[:-1])


def test_stop_string_in_a_multibyte_tail(server: Server) -> None:
    status, _, body = post(server, {"text": "hi", "sampling_params": {"stop": "🦀"}})
    assert status == 200 and json.loads(body)["text"] == TEXT[:TEXT.index("🦀")]


def test_n_samples(server: Server) -> None:
    status, _, body = post(server, {"text": "hello", "rid": "nsamp",
                                    "sampling_params": {"n": 2, "seed": 7, "max_new_tokens": 5}})
    assert status == 200
    outs = json.loads(body)
    assert isinstance(outs, list) and len(outs) == 2
    assert [o["meta_info"]["id"] for o in outs] == ["nsamp-0", "nsamp-1"]
    for o in outs:
        assert o["output_ids"] == server.script[:5]
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    reqs = requests_for(server, "nsamp")
    assert sorted(r.rid for r in reqs) == ["nsamp-0", "nsamp-1"]
    # Different seeds, so the samples differ; reproducible from the one seed.
    assert sorted(r.sampling_params.seed for r in reqs) == [7, 8]


def test_list_of_prompts_keeps_order(server: Server) -> None:
    # The first one is slower (fake: "slow" rids), so it finishes last.
    body = {"input_ids": [[5, 6, 7], [8, 9]], "rid": ["slow-list", "fast-list"],
            "sampling_params": {"max_new_tokens": 4}}
    status, _, raw = post(server, body)
    assert status == 200
    outs = json.loads(raw)
    assert [o["meta_info"]["id"] for o in outs] == ["slow-list", "fast-list"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    status, _, raw = post(server, {"text": ["hello", "a b"], "sampling_params": {"max_new_tokens": 2}})
    outs = json.loads(raw)
    assert status == 200 and len(outs) == 2
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [
        len(server.tokenizer.encode("hello")), len(server.tokenizer.encode("a b"))]


def test_list_of_prompts_times_n_is_prompt_major(server: Server) -> None:
    status, _, raw = post(server, {"input_ids": [[5], [6, 7]], "rid": "grid",
                                   "sampling_params": {"n": 2, "max_new_tokens": 2}})
    outs = json.loads(raw)
    assert status == 200
    assert [o["meta_info"]["id"] for o in outs] == ["grid-0-0", "grid-0-1", "grid-1-0", "grid-1-1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 1, 2, 2]


def test_single_prompt_list_is_still_a_list(server: Server) -> None:
    status, _, raw = post(server, {"text": ["hello"], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and isinstance(json.loads(raw), list)


def test_duplicate_rid_in_a_group_sends_nothing(server: Server) -> None:
    sock = open_raw(server, {"text": "hi", "stream": True, "rid": "hang-dupg-1"})
    read_until(sock, b"data: ")
    before = len(server.fake.requests())
    status, _, raw = post(server, {"text": "hi", "rid": "hang-dupg", "sampling_params": {"n": 2}})
    assert status == 400 and "hang-dupg-1" in json.loads(raw)["error"]["message"]
    status, _, raw = post(server, {"text": ["a", "b"], "rid": ["same", "same"]})
    assert status == 400 and "same" in json.loads(raw)["error"]["message"]
    assert len(server.fake.requests()) == before  # all or nothing
    sock.close()
    wait_until(lambda: "hang-dupg-1" not in server.in_flight())


def test_logprobs_layout(server: Server) -> None:
    status, _, raw = post(server, {"text": "hi", "return_logprob": True, "top_logprobs_num": 2,
                                   "sampling_params": {"max_new_tokens": 6}})
    assert status == 200
    out = json.loads(raw)
    ids, meta = out["output_ids"], out["meta_info"]
    assert meta["output_token_logprobs"] == [[-t / 1000, t, None] for t in ids]
    assert meta["output_top_logprobs"] == [[[-t / 1000, t, None], [-(t + 1) / 1000, t + 1, None]]
                                           for t in ids]
    req = server.fake.requests()[-1]
    assert req.return_logprob and req.top_logprobs_num == 2


def test_prompt_logprobs_layout(server: Server) -> None:
    prompt = [11, 12, 13, 14, 15]
    status, _, raw = post(server, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                   "top_logprobs_num": 2, "return_text_in_logprobs": True,
                                   "sampling_params": {"max_new_tokens": 2}})
    assert status == 200
    meta = json.loads(raw)["meta_info"]
    text = lambda t: server.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    # SGLang's layout: one entry per prompt token, the first's logprob null
    assert meta["input_token_logprobs"] == [[None, 11, text(11)]] + [[-t / 1000, t, text(t)] for t in prompt[1:]]
    assert meta["input_top_logprobs"] == [None] + [[[-t / 1000, t, text(t)], [-(t + 1) / 1000, t + 1, text(t + 1)]]
                                                   for t in prompt[1:]]
    assert server.fake.requests()[-1].logprob_start_len == 0
    # from position 3, no top-n: entries for tokens 3 and 4, and no input_top_logprobs
    status, _, raw = post(server, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 3,
                                   "sampling_params": {"max_new_tokens": 2}})
    meta = json.loads(raw)["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 14, None], [-15 / 1000, 15, None]]
    assert "input_top_logprobs" not in meta
    # -1 (SGLang's default) asks for none
    status, _, raw = post(server, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": -1,
                                   "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and "input_token_logprobs" not in json.loads(raw)["meta_info"]


def test_logprobs_with_text(server: Server) -> None:
    status, _, raw = post(server, {"text": "hi", "return_logprob": True, "top_logprobs_num": 1,
                                   "return_text_in_logprobs": True})
    out = json.loads(raw)
    assert status == 200
    text = lambda t: server.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    ids = out["output_ids"]
    assert ids[-1] == server.eos  # the stop token has a logprob like any other
    assert out["meta_info"]["output_token_logprobs"] == [[-t / 1000, t, text(t)] for t in ids]
    assert out["meta_info"]["output_top_logprobs"] == [[[-t / 1000, t, text(t)]] for t in ids]


def test_logprobs_without_top(server: Server) -> None:
    status, _, raw = post(server, {"text": "hi", "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 3}})
    meta = json.loads(raw)["meta_info"]
    assert status == 200 and len(meta["output_token_logprobs"]) == 3
    assert meta["output_top_logprobs"] == [[], [], []]
    assert server.fake.requests()[-1].top_logprobs_num == 0


def test_logprobs_streamed_and_cut_at_a_stop_string(server: Server) -> None:
    stop, expect, ids = split_stop(server)
    status, _, raw = post(server, {"text": "hi", "stream": True, "return_logprob": True,
                                   "sampling_params": {"stop": stop}})
    events = sse_events(raw)
    assert status == 200
    for e in events:  # cumulative, aligned with output_ids at every step
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"])
    assert [x[1] for x in events[-1]["meta_info"]["output_token_logprobs"]] == ids
    assert events[-1]["text"] == expect


def test_no_logprobs_unless_asked(server: Server) -> None:
    out = json.loads(post(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})[2])
    assert "output_token_logprobs" not in out["meta_info"]


def test_disconnect_aborts_every_sample(server: Server) -> None:
    sock = open_raw(server, {"text": "hi", "rid": "hang-nab", "sampling_params": {"n": 2}})
    wait_until(lambda: len(requests_for(server, "hang-nab")) == 2)
    sock.close()
    wait_until(lambda: {"hang-nab-0", "hang-nab-1"} <= set(server.fake.aborts()))
    wait_until(lambda: not {"hang-nab-0", "hang-nab-1"} & server.in_flight())


def test_disconnect_aborts_every_prompt_of_a_list(server: Server) -> None:
    sock = open_raw(server, {"text": ["a", "b", "c"], "rid": ["hang-l1", "hang-l2", "hang-l3"]})
    wait_until(lambda: len(requests_for(server, "hang-l")) == 3)
    sock.close()
    wait_until(lambda: {"hang-l1", "hang-l2", "hang-l3"} <= set(server.fake.aborts()))


def test_many_fanned_out_requests_at_once(server: Server) -> None:
    body = {"text": ["x", "y"], "sampling_params": {"n": 3, "stop": "wör"}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post(server, body), range(4)))
    for status, _, raw in results:
        outs = json.loads(raw)
        assert status == 200 and len(outs) == 6
        assert all(o["text"] == TEXT[:TEXT.index("wör")] for o in outs)
    wait_until(lambda: not server.in_flight())


def test_streaming_a_list_with_n_interleaves_every_output_with_its_index(server: Server) -> None:
    body = {"text": ["x", "y"], "rid": ["sl-a", "sl-b"], "sampling_params": {"n": 2, "max_new_tokens": 7}}
    status, _, raw = post(server, body)
    assert status == 200
    whole = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    status, _, raw = post(server, {**body, "rid": ["st-a", "st-b"], "stream": True})
    assert status == 200
    events = sse_events(raw)
    by_index: dict[int, list[dict]] = {}
    for e in events:
        by_index.setdefault(e["index"], []).append(e)
    assert sorted(by_index) == [0, 1, 2, 3]  # prompt-major: x#0, x#1, y#0, y#1
    for k, evs in by_index.items():
        texts = [e["text"] for e in evs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts  # cumulative
        assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])
        last = evs[-1]
        assert last["text"] == whole[k]["text"] and last["output_ids"] == whole[k]["output_ids"]
        assert last["meta_info"]["finish_reason"] == whole[k]["meta_info"]["finish_reason"]
    assert len(events) > 4  # more than one event per output: they streamed


def test_timeout_reaches_the_scheduler_on_every_route_and_bad_ones_are_400s(server: Server) -> None:
    status, _, _ = post(server, {"text": "hi", "timeout": 2.5, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and server.fake.requests()[-1].timeout_s == 2.5
    status, _, _ = post(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and server.fake.requests()[-1].timeout_s is None  # the server's default applies
    status, _, _ = post(server, {"prompt": "hi", "max_tokens": 2, "timeout": 7}, "/v1/completions")
    assert status == 200 and server.fake.requests()[-1].timeout_s == 7
    for bad in (0, -1, "soon", 1e9):
        status, _, raw = post(server, {"text": "hi", "timeout": bad})
        assert status == 400 and "timeout" in json.loads(raw)["error"]["message"], raw


def test_priority_reaches_the_scheduler_on_every_route_and_bad_ones_are_400s(server: Server) -> None:
    status, _, _ = post(server, {"text": "hi", "priority": 7, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and server.fake.requests()[-1].priority == 7
    status, _, _ = post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3},
                        "/v1/chat/completions")
    assert status == 200 and server.fake.requests()[-1].priority == -3
    for bad in (1.5, "high", 2**40):
        status, _, raw = post(server, {"text": "hi", "priority": bad})
        assert status == 400 and "priority" in json.loads(raw)["error"]["message"], raw
