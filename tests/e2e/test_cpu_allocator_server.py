"""--cpu-allocator: the model process starts with tcmalloc preloaded where it
is installed (auto, the default), the other processes and `system` without;
and with libgomp's short idle spin (common/cpu_runtime.py)."""

from __future__ import annotations

import os

import pytest
import requests

from common.cpu_runtime import find_tcmalloc, with_omp_spin
from tests.e2e.server_process import ServerProcess
from tests.reliability.server_probe import child_pid


def environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [entry.decode().partition("=") for entry in f.read().split(b"\0") if entry]
    return {k: v for k, _, v in pairs}


def mapped_allocator(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return "tcmalloc" if "tcmalloc" in f.read() else "system"


@pytest.mark.parametrize("flag, model_expected", [("auto", "tcmalloc"), ("system", "system")])
def test_the_model_process_runs_on_the_allocator_asked_for(tiny_llama_dir, default_model_dir, flag: str,
                                                           model_expected: str) -> None:
    if find_tcmalloc() is None:
        pytest.skip("tcmalloc is not installed (apt install libtcmalloc-minimal4)")
    srv = ServerProcess("--model-path", tiny_llama_dir, "--tokenizer-path", default_model_dir,
                        "--cpu-allocator", flag)
    try:
        out = requests.post(f"{srv.url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=60)
        assert out.status_code == 200, out.text
        assert mapped_allocator(child_pid(srv, "model_proc")) == model_expected
        assert mapped_allocator(child_pid(srv, "scheduler_proc")) == "system"
        assert mapped_allocator(child_pid(srv, "tokenizer_proc")) == "system"
        # the spin count the launcher chose (or the one this test's environment set)
        expected = with_omp_spin(dict(os.environ), "cpu").get("GOMP_SPINCOUNT")
        assert environment(child_pid(srv, "model_proc")).get("GOMP_SPINCOUNT") == expected
    finally:
        assert srv.stop() == 0


def test_cpu_threads_sets_the_model_process_thread_count(tiny_llama_dir, default_model_dir) -> None:
    """--cpu-threads 1: the model process runs one OpenMP thread (its
    /get_model_info says so) and still answers."""
    srv = ServerProcess("--model-path", tiny_llama_dir, "--tokenizer-path", default_model_dir,
                        "--cpu-threads", "1")
    try:
        assert requests.get(f"{srv.url}/get_model_info", timeout=30).json()["cpu_threads"] == 1
        out = requests.post(f"{srv.url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=60)
        assert out.status_code == 200, out.text
    finally:
        assert srv.stop() == 0
