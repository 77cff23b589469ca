"""What the scheduler sends for penalties, driven by the fake model: a row's
state is built from the request's tokens at its first extend since admission
(so also after a retraction, and whatever the prefix cache served), and its
token counts follow every kept token, with the overlap schedule on and off.
Also the other per-request sampling setting the scheduler honours:
stream_interval."""

from __future__ import annotations

from common.messages import SamplingParams, TokenizedGenerateReq
from tests.scheduler.fake_model import penalized_expected
from tests.scheduler.test_scheduler import MODES, Harness, expected_tokens


def prompt(rid: str, n: int) -> list[int]:
    return [(i * 13 + len(rid)) % 900 + 10 for i in range(n)]


def submit(h: Harness, rid: str, n_prompt: int, max_new: int, **penalties) -> None:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, **penalties)
    h.sched.process_input_requests([TokenizedGenerateReq(rid=rid, input_ids=prompt(rid, n_prompt),
                                                         sampling_params=sp)])


PENALTY_RIDS = [f"{'p' if i % 2 == 0 else 'q'}{'x' * (i % 3)}{i}" for i in range(8)]


def run_penalty_load(overlap: bool, **args) -> Harness:
    """8 requests of 10-40 prompt tokens + 30 in a pool of 200, chunks of 16:
    admission overcommits, rows get retracted and recomputed; same-length
    rids share a prompt, so re-admitted and later requests start from cached
    KV. The "p" requests are penalized. Every request's tokens are checked."""
    h = Harness(max_running=8, max_total_tokens=200, chunked_prefill_size=16,
                disable_overlap_schedule=not overlap, **args)
    for i, rid in enumerate(PENALTY_RIDS):
        if rid.startswith("p"):
            submit(h, rid, 10 + 5 * i, 30, frequency_penalty=0.5)
        else:
            submit(h, rid, 10 + 5 * i, 30)
    h.reqs = dict(h.sched.queue.by_rid)
    h.run_until_idle()
    for i, rid in enumerate(PENALTY_RIDS):
        last = prompt(rid, 10 + 5 * i)[-1]
        want = penalized_expected(last, 30) if rid.startswith("p") else expected_tokens(last, 30)
        assert h.tokens(rid) == want, rid
    h.assert_no_leak()
    return h


@MODES
def test_penalized_rows_keep_their_token_history_through_chunks_retraction_and_overlap(overlap):
    h = run_penalty_load(overlap)
    assert h.sched.decode.total_retractions >= 1
    assert any(h.reqs[r].num_retractions for r in PENALTY_RIDS if r.startswith("p"))


@MODES
def test_a_batch_without_penalties_sends_no_penalty_fields(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    for i in range(3):
        h.submit(f"r{i}", n_prompt=5, max_new=4)
    h.run_until_idle()
    assert all(not b.penalty_rows and not b.penalty_inits for b in h.model.batches)


def test_init_carries_the_prompt_only_for_repetition_and_stop_ids_only_for_min_new_tokens():
    h = Harness(disable_overlap_schedule=True)
    submit(h, "rep", 4, 5, repetition_penalty=1.2)
    submit(h, "freq", 4, 5, frequency_penalty=-0.5, logit_bias={7: 2.0})
    submit(h, "min", 4, 5, min_new_tokens=2, stop_token_ids=[9])
    submit(h, "none", 4, 5)
    h.sched.step()
    batch = h.model.batches[0]
    assert batch.penalty_rows == [0, 1, 2]  # "none" is not listed
    inits = {i.row: i for i in batch.penalty_inits}
    assert set(inits) == {0, 1, 2}
    assert inits[0].prompt_ids == prompt("rep", 4) and inits[0].repetition_penalty == 1.2
    assert inits[1].prompt_ids == [] and inits[1].logit_bias == {7: 2.0} and inits[1].stop_ids == []
    assert inits[2].stop_ids == [2, 9] and inits[2].min_new_tokens == 2  # EOS and its stop id
    h.run_until_idle()
    assert all(not b.penalty_inits for b in h.model.batches[1:])  # once per admission


@MODES
def test_a_min_new_tokens_row_is_penalized_only_until_it_has_them(overlap):
    h = Harness(disable_overlap_schedule=not overlap)
    submit(h, "m", 4, 6, min_new_tokens=3)
    h.run_until_idle()
    listed = [b.sample_steps[0] for b in h.model.batches if b.penalty_rows == [0]]
    assert listed == [0, 1, 2]  # the tokens numbered 1 to 3
    assert len(h.tokens("m")) == 6


def test_a_chunked_prompt_gets_its_state_at_the_first_chunk_and_is_counted_from_its_last():
    h = Harness(chunked_prefill_size=16, disable_overlap_schedule=True)
    submit(h, "long", 40, 3, presence_penalty=1.0)
    h.run_until_idle()
    extends = [b for b in h.model.batches if b.forward_mode == "extend"]
    assert len(extends) == 3
    assert [len(b.penalty_inits) for b in extends] == [1, 0, 0]
    assert [b.penalty_rows for b in extends] == [[], [], [0]]
    assert h.tokens("long") == penalized_expected(prompt("long", 40)[-1], 3)


def test_the_scheduler_refuses_penalties_out_of_range():
    h = Harness()
    for bad in ({"frequency_penalty": 2.5}, {"presence_penalty": -3.0}, {"repetition_penalty": 0.0},
                {"min_new_tokens": 9}, {"logit_bias": {10**6: 1.0}}, {"logit_bias": {3: float("nan")}},
                {"logit_bias": {3: 1e300}},
                {"stream_interval": 0}):
        submit(h, "bad", 4, 5, **bad)
        reason, _ = h.finals()["bad"]
        assert reason["type"] == "abort" and reason["status_code"] == 400, bad
        h.outputs.clear()


@MODES
def test_a_request_may_set_its_own_stream_interval(overlap):
    h = Harness(disable_overlap_schedule=not overlap)  # --stream-interval 1
    sp = SamplingParams(max_new_tokens=7, temperature=0.0, stream_interval=3)
    h.sched.process_input_requests([TokenizedGenerateReq(rid="s", input_ids=prompt("s", 4), sampling_params=sp,
                                                         stream=True)])
    h.submit("t", n_prompt=4, max_new=3, stream=True)
    h.run_until_idle()
    sizes = {rid: [len(ts) for m in h.outputs for r, ts in zip(m.rids, m.new_token_ids) if r == rid]
             for rid in ("s", "t")}
    assert sizes == {"s": [1, 3, 3], "t": [1, 1, 1]}  # the first token at once, then every 3
