"""The scheduler loop driven by a fake model (isolates the scheduler)."""

import logging

import pytest

from common.messages import AbortReq, BatchTokenOut, SamplingParams, StopMatchedReq, TokenizedGenerateReq
from common.server_args import ServerArgs
from scheduler_proc.create import create_scheduler
from scheduler_proc.kv_invariant import check_kv_invariant
from scheduler_proc.queries import scheduler_state
from scheduler_proc.scheduler import Scheduler
from tests.scheduler.fake_model import EOS, FakeModel, fake_model_info, next_token
from tokenizer_proc.finish_json import finish_json


class Harness:
    def __init__(self, max_running: int = 4, max_total_tokens: int = 4096,
                 max_prefill_tokens: int = 16384, context_len: int = 512, eos_one_in: int = 0,
                 **args) -> None:
        # step-by-step tests of SGLang's plain loop; the mixed one asks for it
        args.setdefault("enable_mixed_chunk", False)
        # a slot per token: these tests count slots token by token; the paged
        # pool (the server's default) has its own tests, with page_size given
        args.setdefault("page_size", 1)
        args = ServerArgs(model_path="fake", max_running_requests=max_running,
                          max_prefill_tokens=max_prefill_tokens, **args)
        self.model = FakeModel(eos_one_in)
        self.outputs: list[BatchTokenOut] = []
        self.sched = create_scheduler(args, fake_model_info(max_total_tokens, context_len), self.model,
                                      self.outputs.append)

    def submit(self, rid: str, n_prompt: int, max_new: int, stream: bool = False,
               stop_ids: list[int] | None = None, ignore_eos: bool = False) -> None:
        sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=stop_ids or [],
                            ignore_eos=ignore_eos)
        self.sched.process_input_requests([TokenizedGenerateReq(
            rid=rid, input_ids=[(i * 13 + len(rid)) % 900 + 10 for i in range(n_prompt)],
            sampling_params=sp, stream=stream)])

    def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if self.sched.step() is None and self.sched.is_idle():
                return
        raise AssertionError("scheduler did not go idle")

    def finals(self) -> dict:
        out = {}
        for msg in self.outputs:
            for i, rid in enumerate(msg.rids):
                if msg.finished_reasons[i] is not None:
                    assert rid not in out, f"{rid} finished twice"
                    out[rid] = (finish_json(msg.finished_reasons[i]), msg.completion_tokens[i])
        return out

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.outputs for r, ts in zip(m.rids, m.new_token_ids) if r == rid
                for t in ts]

    def assert_no_leak(self) -> None:
        assert_no_leak(self.sched)
        assert not self.sched.queue.by_rid


def assert_no_leak(sched: Scheduler) -> None:
    """Nothing held: the accounts add up, no request is resident, every slot is
    free or cached and evictable; flushing the cache then frees every slot."""
    cache = sched.cache
    assert check_kv_invariant(cache) is None, check_kv_invariant(cache)
    assert not cache.resident
    assert cache.available() == cache.size
    assert cache.req_to_token_pool.available() == cache.req_to_token_pool.num_rows
    cache.flush()
    assert cache.allocator.available() == cache.size


# the key behaviours hold with the overlap schedule on and off
MODES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])


def expected_tokens(prompt_last: int, n: int) -> list[int]:
    out, last = [], prompt_last
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


@MODES
def test_every_request_gets_exactly_its_tokens_and_a_length_finish(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    for i in range(6):
        h.submit(f"r{i}", n_prompt=3 + i, max_new=2 + i)
    h.run_until_idle()
    finals = h.finals()
    assert set(finals) == {f"r{i}" for i in range(6)}
    for i in range(6):
        reason, n = finals[f"r{i}"]
        assert reason == {"type": "length", "length": 2 + i} and n == 2 + i
        assert len(h.tokens(f"r{i}")) == 2 + i
    h.assert_no_leak()


@MODES
def test_running_batch_never_exceeds_max_running_requests(overlap):
    h = Harness(max_running=3, disable_overlap_schedule=not overlap)
    for i in range(8):
        h.submit(f"r{i}", n_prompt=4, max_new=5)
    sizes = []
    for _ in range(200):
        batch = h.sched.step()
        if batch is None:
            break
        running = len(h.sched.decode.running_batch) if h.sched.decode.running_batch else 0
        if batch.forward_mode == "extend":
            running += len(batch)
        sizes.append(running)
    assert max(sizes) <= 3
    assert len(h.finals()) == 8
    h.assert_no_leak()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_rows_join_and_leave_the_running_batch_mid_flight(overlap):
    h = Harness(max_running=4, disable_overlap_schedule=not overlap)
    h.submit("long", n_prompt=4, max_new=20)
    for _ in range(3):
        h.sched.step()
    h.submit("short", n_prompt=6, max_new=3)
    batch = h.sched.step()
    assert batch.forward_mode == "extend" and [r.rid for r in batch.reqs] == ["short"]
    batch = h.sched.step()  # the prefilled row joined the running decode batch
    assert batch.forward_mode == "decode" and [r.rid for r in batch.reqs] == ["long", "short"]
    h.sched.step()
    if not overlap:  # with overlap, that step's result is read during the next one
        assert "short" in h.finals()  # finished: 1 token at prefill + 2 decode steps
    batch = h.sched.step()
    # the finished row left at once (with overlap: its last token, in flight, was
    # known to end it by length, so it was not sent again)
    assert [r.rid for r in batch.reqs] == ["long"]
    assert "short" in h.finals()
    h.run_until_idle()
    assert h.finals()["long"][1] == 20
    h.assert_no_leak()


@MODES
def test_stop_token_finishes_with_matched_id(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=3, max_new=50)
    prompt_last = h.sched.queue.waiting[0].origin_input_ids[-1]
    third = expected_tokens(prompt_last, 3)[-1]
    h.sched.queue.waiting[0].stop_token_ids = frozenset({EOS, third})
    h.run_until_idle()
    assert h.finals()["a"] == ({"type": "stop", "matched": third}, 3)
    h.assert_no_leak()


@MODES
def test_streaming_request_gets_tokens_every_step_and_non_streaming_once(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    h.submit("s", n_prompt=3, max_new=5, stream=True)
    h.submit("n", n_prompt=3, max_new=5, stream=False)
    h.run_until_idle()
    s_msgs = [m for m in h.outputs if "s" in m.rids]
    n_msgs = [m for m in h.outputs if "n" in m.rids]
    assert len(s_msgs) == 5 and len(n_msgs) == 1
    assert h.tokens("s") == h.tokens("n") or len(h.tokens("s")) == 5


@MODES
def test_abort_right_after_a_static_prefill_keeps_the_row_as_padding(overlap):
    h = Harness(batching="static", disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=4, max_new=6)
    h.submit("b", n_prompt=5, max_new=6)
    h.sched.step()  # the static batch's prefill
    h.sched.process_input_requests([AbortReq(rid="a")])
    h.run_until_idle()
    assert h.finals()["a"][0]["type"] == "abort" and h.finals()["b"][1] == 6
    assert all(len(b.req_pool_indices) == 2 for b in h.model.batches)  # "a" stays as padding
    h.assert_no_leak()


@MODES
def test_abort_of_running_request_frees_its_kv_at_once(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=10, max_new=100)
    # a prompt of its own (same-length rids get the same prompt, whose KV the
    # prefix cache would share: a's prompt slots would stay held by "bb")
    h.submit("bb", n_prompt=10, max_new=5)
    h.sched.step()  # prefill both
    h.sched.step()  # decode
    used_before = h.sched.cache.size - h.sched.cache.available()  # held by requests
    h.sched.process_input_requests([AbortReq(rid="a")])
    used_after = h.sched.cache.size - h.sched.cache.available()
    assert used_before - used_after == 11  # a's 10 prompt tokens and 1 decoded token
    assert h.finals()["a"][0]["type"] == "abort"
    h.run_until_idle()
    assert h.finals()["bb"][0]["type"] == "length"
    assert all(len(b.req_pool_indices) == 1 for b in h.model.batches[2:])
    h.assert_no_leak()


@MODES
def test_a_stop_string_matched_by_the_tokenizer_finishes_as_a_stop_not_an_abort(overlap):
    """The tokenizer process matches stop strings on the text and sends an
    AbortReq naming the match: the KV is freed at once as for an abort, but the
    request ends (final row, timeline) as a stop, so metrics count it as one."""
    h = Harness(disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=10, max_new=100)
    h.sched.step()
    h.sched.step()
    h.sched.process_input_requests([StopMatchedReq(rid="a", matched=" the end")])
    assert h.sched.cache.available() == h.sched.cache.size and not h.sched.cache.resident
    assert h.finals()["a"][0] == {"type": "stop", "matched": " the end"}
    h.run_until_idle()
    finished = [e for e in h.sched.timeline.since(0.0)[0] if e.get("event") == "finished"]
    assert [(e["rid"], e["reason"]) for e in finished] == [("a", "stop")]
    h.assert_no_leak()


def test_abort_of_waiting_request_removes_it_from_the_queue():
    h = Harness(max_running=1)
    h.submit("a", n_prompt=3, max_new=5)
    h.submit("b", n_prompt=3, max_new=5)
    h.sched.step()
    h.sched.process_input_requests([AbortReq(rid="b")])
    assert not h.sched.queue.waiting
    h.run_until_idle()
    assert h.finals()["b"][0]["type"] == "abort" and h.finals()["b"][1] == 0
    h.assert_no_leak()


def test_request_that_can_never_fit_in_the_pool_gets_an_error_not_a_hang():
    h = Harness(max_total_tokens=64)
    h.submit("big", n_prompt=60, max_new=10)
    h.submit("ok", n_prompt=10, max_new=5)
    h.run_until_idle()
    reason, _ = h.finals()["big"]
    assert reason["type"] == "abort" and "KV pool" in reason["message"]
    assert reason["status_code"] == 400  # the HTTP layer answers 400, not a 200 with nothing
    assert h.finals()["ok"][0]["type"] == "length"
    h.assert_no_leak()


@MODES
def test_admission_waits_for_kv_instead_of_overcommitting(overlap):
    h = Harness(max_running=8, max_total_tokens=64, disable_overlap_schedule=not overlap)
    for i in range(4):  # each needs 10 + 20 = 30 slots: only two fit at once
        h.submit("r" * (i + 1), n_prompt=10, max_new=20)  # prompts of their own: nothing shared
    h.run_until_idle()
    assert max(len(b.req_pool_indices) for b in h.model.batches) == 2
    assert all(f[0]["type"] == "length" for f in h.finals().values())
    h.assert_no_leak()


def test_duplicate_rid_in_flight_is_dropped_without_touching_the_first():
    h = Harness()
    h.submit("a", n_prompt=3, max_new=5)
    h.submit("a", n_prompt=30, max_new=9)
    assert len(h.sched.queue.waiting) == 1 and not h.outputs
    h.run_until_idle()
    assert h.finals()["a"] == ({"type": "length", "length": 5}, 5)
    h.assert_no_leak()


def test_state_counts_the_request_in_chunked_prefill():
    h = Harness(chunked_prefill_size=16, disable_overlap_schedule=True)
    h.submit("long", n_prompt=50, max_new=3)
    h.sched.step()  # the first 16-token chunk
    state = scheduler_state(h.sched)
    assert (state["num_running_reqs"], state["num_waiting_reqs"], state["num_chunked_prefill_reqs"]) == (1, 0, 1)
    assert state["free_kv_slots"] == state["total_kv_slots"] - 16
    h.run_until_idle()
    assert scheduler_state(h.sched)["num_chunked_prefill_reqs"] == 0
    h.assert_no_leak()


@MODES
def test_decode_log_line_counts_the_rows_of_the_step_it_reports(overlap, caplog):
    """The 40th decode step is the last of all three rows: with overlap they
    have left the running batch before its result is read; the line still
    reports the step's 3 rows, not 0."""
    h = Harness(disable_overlap_schedule=not overlap)
    for rid in ("a", "b", "c"):
        h.submit(rid, n_prompt=5, max_new=41)  # 1 token from the prefill + 40 decode steps
    with caplog.at_level(logging.INFO, logger="scheduler_proc.scheduler"):
        h.run_until_idle()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert len(lines) == 1 and "#running-req: 3," in lines[0], lines
    h.assert_no_leak()
