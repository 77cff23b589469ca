"""bench_serving against a real server (launch.py, the default model), every backend."""

from __future__ import annotations

import json

import pytest

from bench.serving import bench_serving
from tests.e2e.server_process import ServerProcess

NUM, OUT = 3, 4


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    # the session's shared server (tests/conftest.py): bench_serving reads its counters as
    # differences over the run, so what other modules sent before does not count
    return shared_server


@pytest.mark.parametrize("backend,extra", [("sglang", []), ("openai", []), ("openai-chat", []),
                                           ("openai", ["--disable-stream"])])
def test_bench_serving_counts_every_token_of_a_tiny_trace(server, tmp_path, capsys, backend, extra):
    out_file = tmp_path / "result.jsonl"
    r = bench_serving.main(["--backend", backend, "--base-url", server.url, "--dataset-name", "random",
                            "--num-prompts", str(NUM), "--random-input-len", "8", "--random-output-len",
                            str(OUT), "--random-range-ratio", "1.0", "--seed", "7", "--disable-tqdm",
                            "--output-file", str(out_file), *extra])
    assert r["completed"] == NUM and r["failed"] == 0
    assert r["total_output_tokens"] == NUM * OUT  # ignore_eos: exactly what was asked
    assert r["output_tokens_not_reported"] == 0  # the counts are the server's
    # the text agrees with the counts, give or take tokens that merge when encoded again
    assert abs(r["total_output_tokens_retokenized"] - NUM * OUT) <= 2 * NUM
    if backend == "openai-chat":
        assert r["total_input_tokens"] > r["total_input_tokens_client"]  # the chat template's tokens
    else:
        assert r["total_input_tokens"] == r["total_input_tokens_client"]
    assert r["batch_utilisation"] in (None, pytest.approx(1.0))  # continuous: no padded rows
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2e_latency_ms"]
    if backend == "sglang":  # exact: every event says how many tokens it carries
        assert all(len(itl) == OUT - 1 for itl in r["itls"])
    else:  # a chunk per visible text delta: held-back bytes merge two tokens into one chunk
        assert all(len(itl) <= OUT - 1 for itl in r["itls"])

    printed = capsys.readouterr().out
    assert f"Successful requests:{NUM:>30}" in printed
    assert "Output token throughput (tok/s):" in printed
    line = json.loads(out_file.read_text().splitlines()[-1])
    assert line["completed"] == NUM and line["backend"] == backend and line["request_rate"] == "inf"
