"""GET /metrics (Prometheus text) and POST /flush_cache, against the fake scheduler."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import pytest

from tests.tokenizer_proc.server_harness import Server, get, post, request, wait_until
from tokenizer_proc.metrics import Histogram
from tokenizer_proc.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def metered(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"),
                 enable_metrics=True)
    yield srv
    srv.stop()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from:\n{text}"
    return float(m.group(1))


def test_metrics_report_scheduler_gauges_and_request_counters(metered: Server) -> None:
    status, ctype, raw = get(metered, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    before = raw.decode()
    assert metric(before, "batchserve_num_queue_reqs") == 2  # the fake scheduler's state
    assert metric(before, "batchserve_num_retractions_total") == 3
    assert "# TYPE batchserve_time_to_first_token_seconds histogram" in before
    for _ in range(3):
        status, _, raw = post(metered, {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        assert status == 200
    out = json.loads(raw)
    wait_until(lambda: not metered.in_flight())
    after = get(metered, "/metrics")[2].decode()
    gen = out["meta_info"]["completion_tokens"]
    assert metric(after, "batchserve_generation_tokens_total") - \
        metric(before, "batchserve_generation_tokens_total") == 3 * gen
    assert metric(after, "batchserve_e2e_request_latency_seconds_count") - \
        metric(before, "batchserve_e2e_request_latency_seconds_count") == 3
    assert metric(after, 'batchserve_e2e_request_latency_seconds_bucket{le="+Inf"}') == \
        metric(after, "batchserve_e2e_request_latency_seconds_count")


def test_metrics_route_is_off_by_default(server: Server) -> None:
    assert get(server, "/metrics")[0] == 404


def test_flush_cache_answers_when_idle(server: Server) -> None:
    status, _, raw = request(server, "POST", "/flush_cache")
    assert status == 200 and b"Cache flushed" in raw


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram("x", "x", (1.0, 2.0))
    for v in (0.5, 1.5, 1.5, 3.0):
        h.observe(v)
    lines = h.render()
    assert 'batchserve_x_bucket{le="1.0"} 1' in lines
    assert 'batchserve_x_bucket{le="2.0"} 3' in lines
    assert 'batchserve_x_bucket{le="+Inf"} 4' in lines
    assert "batchserve_x_count 4" in lines and "batchserve_x_sum 6.5" in lines


def test_timeline_rejects_a_bad_since_and_dashboard_is_served(server: Server) -> None:
    assert get(server, "/timeline?since=abc")[0] == 400
    assert get(server, "/timeline?since=nan")[0] == 400
    assert get(server, "/timeline?after_seq=-1")[0] == 400
    assert get(server, "/timeline?limit=1e9")[0] == 400
    status, ctype, raw = get(server, "/dashboard")
    assert status == 200 and ctype.startswith("text/html") and b"/timeline" in raw
    assert b"http://" not in raw and b"https://" not in raw  # works offline: nothing fetched


def test_integers_beyond_int64_get_400_not_a_crash(server: Server) -> None:
    for sp in ({"top_k": 2**63}, {"seed": 2**63, "temperature": 0}, {"seed": -1},
               {"stop_token_ids": [2**64]}, {"top_k": 2**64}):
        status, _, raw = post(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sp}})
        assert status == 400, (sp, raw)
    assert post(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})[0] == 200
