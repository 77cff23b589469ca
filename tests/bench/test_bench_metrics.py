"""bench/lib/metrics.py, the token clock of bench/lib/backends.py, and bench/lib/utilisation.py."""

from __future__ import annotations

import numpy as np
import pytest

from bench.lib.backends import TokenClock
from bench.lib.metrics import RequestResult, format_summary, percentile_ms, summarize, tpot
from bench.lib.utilisation import batch_utilisation, expected_utilisation, groups_by_first_token, harmonic


def result(ttft: float, itl: list[float], prompt: int = 10, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, prompt_len=prompt, output_len=len(itl) + 1, ttft=ttft, itl=itl,
                         latency=ttft + sum(itl), error="" if ok else "boom")


def test_percentiles_interpolate_and_convert_to_ms():
    assert percentile_ms([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2500.0)
    assert percentile_ms([0.1] * 99 + [1.0], 99) == pytest.approx(100 + 0.01 * 900)
    assert percentile_ms([], 99) == 0.0


def test_summary_of_synthetic_timings():
    rs = [result(0.1, [0.05, 0.05, 0.05]), result(0.3, [0.1]), result(0.2, [], ok=False)]
    s = summarize(rs, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 6
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["total_throughput"] == pytest.approx(13.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_itl_ms"] == pytest.approx(1000 * 0.25 / 4)  # all gaps of all requests
    assert s["median_itl_ms"] == pytest.approx(50.0)
    # TPOT per request: (latency - ttft) / (tokens - 1): 50 ms and 100 ms
    assert s["mean_tpot_ms"] == pytest.approx(75.0)
    assert s["mean_e2e_latency_ms"] == pytest.approx(1000 * (0.25 + 0.4) / 2)
    assert s["concurrency"] == pytest.approx((0.25 + 0.4) / 2.0)


def test_tpot_needs_two_tokens():
    assert tpot(result(0.1, [])) is None
    assert tpot(result(0.1, [0.2, 0.4])) == pytest.approx(0.3)


def test_summary_prints_the_sglang_lines():
    text = format_summary({**summarize([result(0.1, [0.05])], 1.0), "backend": "sglang"})
    for line in ("Successful requests:", "Benchmark duration (s):", "Output token throughput (tok/s):",
                 "Mean TTFT (ms):", "Median ITL (ms):", "P99 TPOT (ms):", "Mean E2E (ms):", "Concurrency:"):
        assert line in text


def test_token_clock_spreads_a_multi_token_chunk_over_its_tokens():
    c = TokenClock(start=10.0)
    c.saw(1, 10.5)  # first token: TTFT only
    c.saw(1, 10.6)  # no new token (a text-only update): ignored
    c.saw(3, 10.9)  # two tokens in one chunk: two gaps of 0.2
    c.saw(4, 11.0)
    assert c.ttft == pytest.approx(0.5)
    assert c.itl == pytest.approx([0.2, 0.2, 0.1])


def test_static_batch_utilisation_is_mean_over_max():
    assert batch_utilisation([[16, 40, 64, 96, 152, 224, 352, 1024]]) == pytest.approx(1968 / 8192)
    assert batch_utilisation([[1], [2, 4]]) == pytest.approx(7 / 9)
    assert batch_utilisation([]) == 1.0


def test_one_over_harmonic_is_close_to_sampled_exponential_utilisation():
    rng = np.random.default_rng(0)
    assert harmonic(1) == 1.0 and harmonic(4) == pytest.approx(25 / 12)
    assert expected_utilisation(1, 5.0, rng, 200) == pytest.approx(1.0)
    for b in (4, 16, 64):  # an approximation: within a few points, and it errs low
        sampled = expected_utilisation(b, 1.0, rng, 20000)
        assert sampled == pytest.approx(1 / harmonic(b), abs=0.06)
        assert sampled > 1 / harmonic(b)


def test_batches_are_recovered_from_first_token_times():
    first = [0.50, 0.0, 0.51, 2.0, 0.01, 2.02, 2.03]
    assert groups_by_first_token(first, max_batch=8) == [[1, 4], [0, 2], [3, 5, 6]]
    assert groups_by_first_token(first[3:], max_batch=2) == [[1], [0, 2], [3]]  # split at 2


def test_cpu_wait_share_from_pressure_stall_counters(tmp_path):
    from bench.lib.cpu_pressure import CpuWait, some_total_us

    psi = tmp_path / "cpu"
    psi.write_text("some avg10=1.00 avg60=2.00 avg300=3.00 total=1000000\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert some_total_us(str(psi)) == 1_000_000
    with CpuWait(str(psi)) as w:
        psi.write_text("some avg10=1.00 avg60=2.00 avg300=3.00 total=1000000000\n")
    assert w.share is not None and w.share > 0
    with CpuWait(str(tmp_path / "missing")) as w:
        pass
    assert w.share is None and some_total_us(str(tmp_path / "missing")) is None


def test_waiting_for_a_quiet_cpu_reads_the_10s_average(tmp_path):
    from bench.lib.cpu_pressure import some_avg, wait_for_quiet

    psi = tmp_path / "cpu"
    psi.write_text("some avg10=12.50 avg60=2.00 avg300=3.00 total=5\n")
    assert some_avg(10, str(psi)) == pytest.approx(0.125) and some_avg(60, str(psi)) == pytest.approx(0.02)
    assert wait_for_quiet(0.2, timeout=5, path=str(psi)) == pytest.approx(0.125)  # quiet: at once
    assert wait_for_quiet(0.1, timeout=0, path=str(psi)) == pytest.approx(0.125)  # busy, but no time left
    psi.write_text("some avg10=1.00 avg60=40.00 avg300=3.00 total=5\n")  # a burst a minute ago counts
    assert wait_for_quiet(0.2, timeout=0, path=str(psi)) == pytest.approx(0.4)
