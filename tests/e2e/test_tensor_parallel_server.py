"""Tensor parallelism through the real server (launch.py, gloo on the CPU):

- greedy answers with --tp-size 2 (speculative decoding on) and --tp-size 3
  (a tiny model of 12 heads / 6 KV heads, intermediate 192: 3 and 2 KV heads
  per rank; a vocabulary of 512, padded to a multiple of 3 for tp3) are the
  --tp-size 1 answers (the near-tie criterion), in a run with chunked prefill
  and a retraction;
- two "nodes" on localhost (two launch.py, --nnodes 2): node 1 runs only its
  model rank, node 0 everything else; same answers; when node 0 stops in
  order both exit 0, and when node 1's rank dies node 0 fails every request
  and exits non-zero;
- a SIGKILLed rank (rank 0 or rank 1): every client answered within 5 s,
  launch.py exits non-zero, no process or socket folder left.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import requests

from common.peer_watch import read_pids
from tests.e2e.server_process import ROOT, ServerProcess, children_of, free_port, pid_alive
from tests.helpers import make_tiny_llama
from tests.reliability.greedy_check import check_against_reference
from tests.reliability.inflight import CLIENT_TIMEOUT_S, InFlight
from tests.reliability.server_probe import ipc_dir, scheduler_state, stopped_cleanly, wait_gone
from tests.reliability.test_faults import assert_all_answered_with_errors, assert_health_stops

# A pool of 90 slots and a low conservativeness: the four requests are
# admitted together and then overflow it, so one is retracted (as in
# tests/e2e/test_dashboard.py); prompts of 18-24 tokens prefill in chunks of 16.
SCENARIO = ("--dtype", "float32", "--max-running-requests", "8", "--max-total-tokens", "90",
            "--schedule-conservativeness", "0.3", "--chunked-prefill-size", "16")
MAX_NEW = 24
TINY_PROMPTS = [[(i * 37 + 11 * k) % 500 + 3 for i in range(18 + 2 * k)] for k in range(4)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # a long context, so that the killed-rank test's requests outlast the test; heads
    # that both 2 and 3 ranks divide (the default model's 9 / 3 took tp3 30 s on 2 cores)
    return make_tiny_llama(str(tmp_path_factory.mktemp("tp_tiny")), max_position_embeddings=4096,
                           hidden_size=192, num_attention_heads=12, num_key_value_heads=6,
                           intermediate_size=192)


def ask_all(srv: ServerProcess, prompts: list[Any]) -> list[dict[str, Any]]:
    def ask(prompt: Any) -> dict[str, Any]:
        body = {("text" if isinstance(prompt, str) else "input_ids"): prompt,
                "return_logprob": True, "top_logprobs_num": 5,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
        r = requests.post(srv.url + "/generate", json=body, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def serve_and_ask(prompts: list[Any], *flags: str) -> list[dict[str, Any]]:
    srv = ServerProcess(*SCENARIO, *flags)
    try:
        return ask_all(srv, prompts)
    finally:
        srv.kill()


def assert_same_greedy(ours: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert any(a["meta_info"]["num_retractions"] for a in ours), "the scenario must retract a request"
    for answer, ref in zip(ours, reference):
        check_against_reference(answer, MAX_NEW, ref)  # identical, or parted once at a near-tie


@pytest.fixture(scope="module")
def tiny_reference(tiny_model: str, default_model_dir: str) -> list[dict[str, Any]]:
    return serve_and_ask(TINY_PROMPTS, "--model-path", tiny_model, "--tokenizer-path", default_model_dir)


def test_tp2_with_speculation_greedy_answers_equal_tp1_with_chunked_prefill_and_a_retraction(
        tiny_model, default_model_dir, tiny_reference):
    """With speculative decoding on too (every draft verified: not adaptive),
    so verify steps run across the ranks beside chunked prefill and the
    retraction; the 2-node and killed-rank tests below run tp2 without it."""
    ours = serve_and_ask(TINY_PROMPTS, "--model-path", tiny_model, "--tokenizer-path", default_model_dir,
                         "--tp-size", "2", "--speculative-algorithm", "NGRAM", "--disable-speculative-adaptive")
    assert_same_greedy(ours, tiny_reference)
    verified = [a["meta_info"].get("spec_verify_ct", 0) for a in ours]
    accepted = [a["meta_info"].get("spec_accept_length", 0) for a in ours]
    assert sum(verified) > 0 and max(accepted) > 1, (verified, accepted)  # drafts kept across the ranks


def test_tp3_greedy_answers_equal_tp1_with_chunked_prefill_and_a_retraction(tiny_model, default_model_dir,
                                                                           tiny_reference):
    ours = serve_and_ask(TINY_PROMPTS, "--model-path", tiny_model, "--tokenizer-path", default_model_dir,
                         "--tp-size", "3")
    assert_same_greedy(ours, tiny_reference)


class TwoNodes:
    """Node 1 (launch.py --node-rank 1: its model rank only) started first,
    then node 0 (everything else), which is ready once rank 1 has joined."""

    def __init__(self, model: str, tokenizer: str, log_path: str, *flags: str) -> None:
        multi = ("--model-path", model, "--tokenizer-path", tokenizer, "--tp-size", "2", "--nnodes", "2",
                 "--dist-init-addr", f"127.0.0.1:{free_port()}", *flags)
        self.log = open(log_path, "w+")
        self.node1 = subprocess.Popen([sys.executable, "launch.py", *multi, "--node-rank", "1"], cwd=ROOT,
                                      stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.node0: ServerProcess | None = None
        try:
            self.node0 = ServerProcess(*multi, "--node-rank", "0")
        except BaseException:
            self.close()
            raise
        self.node1_ranks = children_of(self.node1.pid)

    def node1_log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.node0 is not None:
            self.node0.kill()
        if self.node1.poll() is None:
            os.killpg(self.node1.pid, signal.SIGKILL)
            self.node1.wait()
        self.log.close()


def test_two_nodes_on_localhost_answer_as_tp1_and_node_1_leaves_with_node_0(tiny_model, default_model_dir,
                                                                           tiny_reference, tmp_path):
    nodes = TwoNodes(tiny_model, default_model_dir, str(tmp_path / "node1.log"), *SCENARIO)
    try:
        srv = nodes.node0
        assert "Node 1 is ready: model ranks 1..1 of 2" in nodes.node1_log()
        # node 0 runs the scheduler, the tokenizer and rank 0; node 1 rank 1 alone
        assert set(read_pids(ipc_dir(srv))) == {"model", "scheduler", "tokenizer"}
        assert len(nodes.node1_ranks) == 1
        assert_same_greedy(ask_all(srv, TINY_PROMPTS), tiny_reference)
        assert srv.stop(signal.SIGTERM) == 0  # an orderly stop of node 0...
        # ...ends node 1 too, in order: rank 0 told its rank to stop
        assert nodes.node1.wait(timeout=30) == 0
        assert not wait_gone(srv.child_pids + nodes.node1_ranks, 5.0), "a rank outlived its node"
    finally:
        nodes.close()


def test_a_rank_killed_on_node_1_fails_every_request_on_node_0(tiny_model, default_model_dir, tmp_path):
    nodes = TwoNodes(tiny_model, default_model_dir, str(tmp_path / "node1.log"),
                     "--max-running-requests", "2", "--max-total-tokens", "8192")
    try:
        srv = nodes.node0
        load = InFlight(srv.url)
        load.add("running-stream", long_tiny_body(0, True))
        assert load.started.wait(60), "the first request never produced a token"
        load.add("running-plain", long_tiny_body(1, False))
        load.add("queued-plain", long_tiny_body(2, False))
        os.kill(nodes.node1_ranks[0], signal.SIGKILL)  # beyond node 0's peer watch
        t0 = time.monotonic()
        assert_health_stops(srv.url, t0)
        assert_all_answered_with_errors(load.results(), t0)
        assert stopped_cleanly(srv) != 0
        assert nodes.node1.wait(timeout=30) != 0
    finally:
        nodes.close()


def long_tiny_body(k: int, stream: bool) -> dict[str, Any]:
    """A request that outlasts any test: 4000 tokens of the tiny model."""
    return {"input_ids": TINY_PROMPTS[k], "stream": stream,
            "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}


@pytest.mark.parametrize("victim", ["model", "model_tp1"])
def test_a_killed_rank_fails_every_request_and_the_server(victim, tiny_model, default_model_dir):
    srv = ServerProcess("--model-path", tiny_model, "--tokenizer-path", default_model_dir, "--tp-size", "2",
                        "--max-running-requests", "2", "--max-total-tokens", "8192")
    try:
        load = InFlight(srv.url)
        load.add("running-stream", long_tiny_body(0, True))
        assert load.started.wait(60), "the first request never produced a token"
        load.add("running-plain", long_tiny_body(1, False))
        load.add("queued-stream", long_tiny_body(2, True))
        load.add("queued-plain", long_tiny_body(3, False))
        deadline = time.monotonic() + 30
        while (state := scheduler_state(srv))["num_waiting_reqs"] < 2:
            assert time.monotonic() < deadline, f"never had 2 running and 2 queued: {state}"
            time.sleep(0.05)
        pid = read_pids(ipc_dir(srv))[victim][0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert_health_stops(srv.url, t0)
        assert_all_answered_with_errors(load.results(), t0)
        assert stopped_cleanly(srv) != 0
        assert not pid_alive(pid)
    finally:
        srv.kill()


def test_a_tp_size_that_does_not_divide_the_heads_stops_the_start_with_the_reason(tiny_model):
    out = subprocess.run([sys.executable, "launch.py", "--model-path", tiny_model, "--tp-size", "5",
                          "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "cannot start: --tp-size 5 does not divide the model's 12 attention heads" in out.stderr
    assert "Traceback" not in out.stderr
