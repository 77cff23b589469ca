"""Data parallelism as a user runs it: scripts/serve-dp.sh starts 2 replicas
of the real server behind SGLang's real router (sglang-router, cache-aware
policy). Mixed requests (native, OpenAI, streaming) through the router are
answered as one replica answers them; requests sharing a long prefix land on
the replica that cached it; a replica killed mid-run is routed around;
stopping the script stops every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import requests

from tests.e2e.server_process import ROOT, children_of, free_port, free_port_run, pid_alive

pytest.importorskip("sglang_router", reason="sglang-router is the [scale] extra (scripts/install.sh installs it)")

FLAGS = ["--max-running-requests", "4", "--max-total-tokens", "4096", "--dtype", "float32"]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.fixture(scope="module")
def cluster():
    port, base = free_port(), free_port_run(2)  # the replicas listen on base and base + 1
    env = {**os.environ, "PORT": str(port), "BASE_PORT": str(base)}
    log = open(os.path.join(ROOT, ".pytest_serve_dp.log"), "wb")
    proc = subprocess.Popen(["bash", "scripts/serve-dp.sh", "2", *FLAGS], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, open(log.name).read()[-3000:]
        assert time.monotonic() < deadline, "the router never answered"
        try:
            if requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                             timeout=10).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    yield proc, url, replicas
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()
    os.remove(log.name)


def greedy(url: str, text: str, n: int = 8) -> list[int]:
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": n,
                                                                                 "temperature": 0.0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_mixed_requests_through_the_router_are_answered_as_a_replica_answers_them(cluster):
    _, url, replicas = cluster
    prompts = [f"Tell me about the number {k}." for k in range(6)]
    direct = {p: greedy(replicas[0], p) for p in prompts}
    for p in prompts:
        assert greedy(url, p) == direct[p]
        body = {"model": "m", "prompt": p, "max_tokens": 8, "temperature": 0}
        routed, alone = (requests.post(u + "/v1/completions", json=body, timeout=120) for u in (url, replicas[0]))
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        with requests.post(url + "/v1/chat/completions", stream=True, timeout=120, json={
                "model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": 8, "stream": True}) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and len(events) >= 3


def test_requests_sharing_a_long_prefix_land_on_the_replica_that_cached_it(cluster):
    _, url, replicas = cluster
    prefix = "You are a careful assistant. " * 40  # ~240 tokens
    cached = []
    for k in range(6):
        r = requests.post(url + "/generate", timeout=120, json={
            "text": prefix + f"Question {k}: what is {k} plus {k}?", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        cached.append(r.json()["meta_info"]["cached_tokens"])
    assert all(c >= 200 for c in cached[1:]), cached  # each found the prefix: the same replica
    loads = [requests.get(r + "/get_load", timeout=10).json() for r in replicas]
    assert all(isinstance(entry, list) and set(entry[0]) >= {"num_reqs", "num_waiting_reqs", "num_tokens"}
               for entry in loads)


def test_a_killed_replica_is_routed_around_and_stopping_the_script_stops_everything(cluster):
    proc, url, replicas = cluster
    victim = next(pid for pid in children_of(proc.pid)
                  if f"--port {replicas[1].rsplit(':', 1)[1]}" in open(f"/proc/{pid}/cmdline").read().replace("\0", " "))
    os.kill(victim, signal.SIGKILL)  # launch.py of replica 2; its children follow it
    time.sleep(5)  # the router's health check (every 2 s, scripts/serve-dp.sh) drops it
    codes = []
    for k in range(8):
        r = requests.post(url + "/generate", json={"text": f"After the crash {k}", "sampling_params": {
            "max_new_tokens": 2}}, timeout=120)
        codes.append((r.status_code, r.text[:200] if r.status_code != 200 else ""))
    assert all(c == 200 for c, _ in codes), codes
    everything = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143  # stopped on request, as the script says
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in everything) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in everything if pid_alive(pid)]
