"""common/cpu_runtime.py: the model process's allocator preload."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common import cpu_runtime
from common.cpu_runtime import OMP_SPIN_COUNT, CpuAllocator, allocator_preload, with_omp_spin, with_preload


def test_auto_preloads_tcmalloc_first_and_keeps_other_preloads() -> None:
    library = allocator_preload(CpuAllocator.AUTO, "cpu", tcmalloc="libtcmalloc_minimal.so.4")
    env = with_preload({"LD_PRELOAD": "libfoo.so", "X": "1"}, library)
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libfoo.so" and env["X"] == "1"
    assert with_preload(env, library)["LD_PRELOAD"] == env["LD_PRELOAD"]  # not twice
    assert with_preload({"X": "1"}, None) == {"X": "1"}


def test_system_and_gpu_devices_preload_nothing() -> None:
    assert allocator_preload(CpuAllocator.SYSTEM, "cpu", tcmalloc="libtcmalloc.so.4") is None
    assert allocator_preload(CpuAllocator.TCMALLOC, "cuda:0", tcmalloc="libtcmalloc.so.4") is None


def test_without_tcmalloc_auto_falls_back_and_tcmalloc_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_runtime, "find_tcmalloc", lambda: None)
    assert allocator_preload(CpuAllocator.AUTO, "cpu") is None
    with pytest.raises(RuntimeError, match="libtcmalloc-minimal4"):
        allocator_preload(CpuAllocator.TCMALLOC, "cpu")


def test_the_model_spins_briefly_on_a_cpu_unless_the_user_chose_a_wait() -> None:
    assert with_omp_spin({"A": "1"}, "cpu") == {"A": "1", "GOMP_SPINCOUNT": str(OMP_SPIN_COUNT)}
    assert with_omp_spin({"GOMP_SPINCOUNT": "300000"}, "cpu") == {"GOMP_SPINCOUNT": "300000"}
    assert with_omp_spin({"OMP_WAIT_POLICY": "active"}, "cpu") == {"OMP_WAIT_POLICY": "active"}
    assert with_omp_spin({}, "cuda") == {}


def test_a_process_started_with_the_spin_count_has_libgomp_read_it() -> None:
    """libgomp reads GOMP_SPINCOUNT when it loads: the value reaches the
    process's OpenMP runtime (OMP_DISPLAY_ENV prints what it took)."""
    env = with_omp_spin({"PATH": "/usr/bin:/bin", "OMP_DISPLAY_ENV": "verbose"}, "cpu")
    out = subprocess.run([sys.executable, "-c", "import torch; torch.ones(64, 64).sum()"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"GOMP_SPINCOUNT = '{OMP_SPIN_COUNT}'" in out.stderr, out.stderr


def test_a_process_started_with_the_preload_runs_on_tcmalloc() -> None:
    library = cpu_runtime.find_tcmalloc()
    if library is None:
        pytest.skip("tcmalloc is not installed (apt install libtcmalloc-minimal4)")
    code = "from common.cpu_runtime import preloaded_allocator; print(preloaded_allocator())"
    for allocator, expected in ((CpuAllocator.AUTO, "tcmalloc"), (CpuAllocator.SYSTEM, "system")):
        env = with_preload({"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}, allocator_preload(allocator, "cpu"))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


def test_model_threads_take_the_flag_else_share_the_cores_between_ranks() -> None:
    from common.cpu_runtime import model_threads

    assert model_threads(3, ranks_per_node=1, cores=8) == 3
    assert model_threads(3, ranks_per_node=4, cores=8) == 3
    assert model_threads(None, ranks_per_node=1, cores=8) is None  # torch's default: one per physical core
    assert model_threads(None, ranks_per_node=3, cores=8) == 2
    assert model_threads(None, ranks_per_node=3, cores=2) == 1


def test_cpu_threads_below_one_is_refused() -> None:
    from common.server_args import ServerArgs

    with pytest.raises(ValueError, match="--cpu-threads"):
        ServerArgs(model_path="fake", cpu_threads=0)


RELEASE_PROBE = """
from common.cpu_runtime import release_free_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024

base = rss_mib()
pieces, pins = [], []
for _ in range(4096):  # 256 MiB in 64 KiB pieces, each followed by a small block kept live
    pieces.append(bytearray(65536))
    pins.append(bytearray(64))
pieces.clear()
held = rss_mib() - base
released = release_free_memory()
print(released, held, rss_mib() - base)
"""


@pytest.mark.parametrize("allocator", [CpuAllocator.AUTO, CpuAllocator.SYSTEM])
def test_memory_a_process_freed_goes_back_to_the_kernel_on_either_allocator(allocator: CpuAllocator) -> None:
    """What the model's load freed (a GGUF's first-start conversion: ~3.4 GB
    on the 1B bench model) leaves the process: tcmalloc would keep it for
    the process's life, glibc wherever a live block sits above it."""
    library = allocator_preload(allocator, "cpu")
    if allocator == CpuAllocator.AUTO and library is None:
        pytest.skip("tcmalloc is not installed (apt install libtcmalloc-minimal4)")
    env = with_preload({"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}, library)
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    released, held, after = out.stdout.split()
    assert released == "True"
    assert float(held) > 100, out.stdout  # freed but still the process's: what the call is for
    assert float(after) < 32, out.stdout
