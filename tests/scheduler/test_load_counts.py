"""/get_load and /get_server_info count every admitted request as running
(fake model): one in the prefill step in flight, in a mixed step or part way
through a chunked prefill as much as one in the running batch. Routers
balance on these numbers; before, a server in a prefill step showed 0
running while it held thousands of KV slots."""

from __future__ import annotations

import random

import pytest

from scheduler_proc.queries import scheduler_state
from tests.scheduler.test_scheduler import Harness


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "unmixed"])
def test_held_kv_slots_imply_running_or_waiting_requests_at_every_sample(overlap, mixed):
    rng = random.Random(29)
    h = Harness(max_running=6, max_total_tokens=2048, chunked_prefill_size=64, page_size=16,
                enable_mixed_chunk=mixed, disable_overlap_schedule=not overlap)
    samples = 0
    in_prefill = 0  # samples taken while no request sat in the running batch
    for k in range(60):
        if rng.random() < 0.5:
            h.submit(f"r{k}", n_prompt=rng.randint(5, 200), max_new=rng.randint(1, 12))
        h.sched.step()
        # a StateQuery is answered here, between two steps
        state = scheduler_state(h.sched)
        live = h.sched.queue.by_rid.values()
        admitted = sum(1 for r in live if r.req_pool_idx)
        samples += 1
        if state["held_kv_slots"] - state["protected_kv_slots"] > 0:
            assert state["num_running_reqs"] + state["num_waiting_reqs"] > 0, state
        assert state["num_running_reqs"] == admitted, (state, admitted)
        assert state["num_running_reqs"] <= 6
        if admitted and h.sched.decode.running_batch is None:
            in_prefill += 1
    h.run_until_idle()
    state = scheduler_state(h.sched)
    assert (state["num_running_reqs"], state["num_waiting_reqs"], state["held_kv_slots"]) == (0, 0, 0)
    assert in_prefill >= 3, "the load never caught a request outside the running batch"
    h.assert_no_leak()
