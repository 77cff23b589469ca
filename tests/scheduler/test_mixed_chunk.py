"""--enable-mixed-chunk: the running rows take their decode step inside each
prefill step. Every request still gets exactly the tokens of the plain loop,
through chunks, retractions, aborts, the overlap schedule and penalties, and
the fake model sees every row's KV where the scheduler says it is."""

from __future__ import annotations

import pytest

from common.messages import FUTURE_TOKEN
from common.server_args import ServerArgs
from scheduler_proc.queries import scheduler_state
from tests.scheduler.test_overlap_schedule import random_load, streamed
from tests.scheduler.test_penalty_scheduling import prompt, run_penalty_load
from tests.scheduler.test_scheduler import Harness, expected_tokens


def mixed_steps(h: Harness) -> int:
    return scheduler_state(h.sched)["num_mixed_steps"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("radix_cache", [True, False], ids=["cache", "no-cache"])
def test_mixed_steps_give_the_plain_loops_outputs_under_random_load(overlap, radix_cache, property_seeds):
    mixed = 0
    for seed in property_seeds:
        on = random_load(seed, overlap, "continuous", radix_cache=radix_cache, enable_mixed_chunk=True)
        off = random_load(seed, False, "continuous", radix_cache=radix_cache)
        assert streamed(on.outputs) == streamed(off.outputs), f"seed {seed}"
        mixed += mixed_steps(on)
        assert mixed_steps(off) == 0
    assert mixed > 50  # the loads did mix


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_aborts_in_mixed_steps_cut_outputs_short_and_leak_nothing(overlap, property_seeds):
    for seed in property_seeds:
        cut = streamed(random_load(seed, overlap, "continuous", aborts=True, enable_mixed_chunk=True).outputs)
        full = streamed(random_load(seed, False, "continuous").outputs)
        for rid, (tokens, reason) in cut.items():
            if reason["type"] == "abort":
                assert tokens == full[rid][0][:len(tokens)], (seed, rid)
            else:
                assert (tokens, reason) == full[rid], (seed, rid)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_running_rows_decode_inside_the_prefill_and_never_wait_for_it(overlap):
    h = Harness(max_running=4, enable_mixed_chunk=True, disable_overlap_schedule=not overlap)
    h.submit("a", n_prompt=5, max_new=20)
    for _ in range(3):
        h.sched.step()
    h.submit("bb", n_prompt=40, max_new=5)  # arrives while "a" decodes
    h.run_until_idle()
    step = next(b for b in h.model.batches if b.forward_mode.is_mixed() and len(b.seq_lens) == 2)
    assert step.decode_rows == 1 and step.seq_lens[1] - step.prefix_lens[1] == 1  # "a" decoded its next token in it
    if overlap:  # "a"'s input was the token still in flight
        assert step.input_ids[-1] == FUTURE_TOKEN
    assert h.tokens("a") == expected_tokens(prompt("a", 5)[-1], 20)
    assert h.tokens("bb") == expected_tokens(prompt("bb", 40)[-1], 5)
    h.assert_no_leak()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_penalized_rows_keep_their_history_through_mixed_steps(overlap):
    # test_penalty_scheduling's load (chunks, retractions, shared prompts);
    # here the running rows also decode inside every prefill
    h = run_penalty_load(overlap, enable_mixed_chunk=True)
    assert mixed_steps(h) > 0


def test_mixed_chunk_needs_continuous_batching():
    for batching in ("static", "dynamic"):
        with pytest.raises(ValueError, match="--enable-mixed-chunk"):
            ServerArgs(model_path="fake", batching=batching, enable_mixed_chunk=True)
