"""The scheduler's timeline: events per request in order, per-step records, a bounded buffer."""

from __future__ import annotations

from scheduler_proc.timeline import Timeline
from tests.scheduler.test_scheduler import Harness


def events_by_rid(timeline: Timeline) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in timeline.events:
        if e["type"] == "req":
            out.setdefault(e["rid"], []).append(e["event"])
    return out


def test_scripted_run_records_every_request_event_in_order_including_a_retraction():
    # pool of 100: three 10 + 30 requests are admitted at ratio 0.7 and then
    # overflow it, so the youngest is retracted and later recomputed; "long"
    # arrives later with a prompt that is prefilled in chunks of 16
    h = Harness(max_running=8, max_total_tokens=100, chunked_prefill_size=16)
    for i in range(3):  # prompts of their own (a shared one would be cached and fit)
        h.submit("r" * (i + 1), n_prompt=10, max_new=30)
    for _ in range(5):
        h.sched.step()
    h.submit("long", n_prompt=40, max_new=2)
    h.run_until_idle()
    tl = h.sched.timeline
    seen = events_by_rid(tl)
    assert h.sched.decode.total_retractions >= 1
    retracted = [rid for rid, evs in seen.items() if "retracted" in evs]
    assert retracted
    for rid, evs in seen.items():
        assert evs[0] == "arrived" and evs[1] == "admitted" and evs[-1] == "finished", (rid, evs)
        assert evs.count("first_token") == 1 and evs.count("finished") == 1
        # a retraction is always followed by a re-admission before the finish
        for k, e in enumerate(evs):
            if e == "retracted":
                assert "readmitted" in evs[k + 1:], (rid, evs)
        assert evs.count("retracted") == evs.count("readmitted")
    assert seen["long"][:4] == ["arrived", "admitted", "chunk", "chunk"]
    assert seen["long"].index("first_token") > seen["long"].index("chunk")
    # timestamps never go backwards; every step is recorded with its kind and size
    ts = [e["t"] for e in tl.events]
    assert ts == sorted(ts)
    steps = [e for e in tl.events if e["type"] == "step"]
    assert {e["kind"] for e in steps} == {"extend", "decode"}
    assert all(e["batch_size"] >= 1 and 0 <= e["kv_usage"] <= 1 and e["step_time"] >= 0
               for e in steps)
    finished = [e for e in tl.events if e["type"] == "req" and e["event"] == "finished"]
    assert {e["reason"] for e in finished} == {"length"}


def test_ring_buffer_drops_the_oldest_events_beyond_its_bound():
    tl = Timeline(capacity=5)
    for i in range(12):
        tl.request(f"r{i}", "arrived", t=float(i))
    assert [e["rid"] for e in tl.events] == ["r7", "r8", "r9", "r10", "r11"]
    assert tl.seq == 12  # a reader can tell it missed events
    assert [e["rid"] for e in tl.since(8.5)[0]] == ["r9", "r10", "r11"]


def test_a_reader_pages_through_the_timeline_with_a_cursor():
    tl = Timeline(capacity=100)
    for i in range(12):
        tl.request(f"r{i}", "arrived", t=float(i))
    page, more = tl.since(2.5, limit=4)  # the oldest first, and more to come
    assert [e["rid"] for e in page] == ["r3", "r4", "r5", "r6"] and more
    page, more = tl.since(2.5, after_seq=page[-1]["seq"], limit=4)
    assert [e["rid"] for e in page] == ["r7", "r8", "r9", "r10"] and more
    page, more = tl.since(2.5, after_seq=page[-1]["seq"], limit=4)
    assert [e["rid"] for e in page] == ["r11"] and not more
    assert tl.since(after_seq=tl.seq) == ([], False)


def test_timeline_query_returns_events_since_a_time():
    from common.messages import TimelineQuery
    from scheduler_proc.queries import answer

    h = Harness()
    h.submit("a", n_prompt=3, max_new=3)
    h.run_until_idle()
    mid = h.sched.timeline.events[2]["t"]
    reply = answer(h.sched, TimelineQuery(query_id="q", since=mid))
    assert reply.ok and all(e["t"] > mid for e in reply.data["events"])
    assert reply.data["more"] is False and reply.data["next_seq"] == reply.data["events"][-1]["seq"]
    first = answer(h.sched, TimelineQuery(query_id="q", limit=2)).data
    assert len(first["events"]) == 2 and first["more"]
    rest = answer(h.sched, TimelineQuery(query_id="q", after_seq=first["next_seq"])).data
    assert [e["seq"] for e in first["events"] + rest["events"]] == \
        [e["seq"] for e in h.sched.timeline.events]
    assert reply.data["seq"] == h.sched.timeline.seq and reply.data["now"] >= mid
