"""The CPU runtime the model process starts with: its memory allocator and
its OpenMP thread count.

torch's CPU ops allocate and free many short-lived tensors in every step;
glibc's malloc hands the large ones back to the kernel and faults them in
again the next step, tcmalloc keeps them in its caches. CPU engines start
with tcmalloc preloaded (vLLM's and SGLang's CPU guides); so does our model
process where the library is installed (Debian/Ubuntu:
`apt install libtcmalloc-minimal4`): it makes the decode step faster here,
while Intel OpenMP and OpenMP thread binding gained nothing, so neither is set
(docs/performance.md, "The model process's allocator").

The allocator must be in place before the process starts (LD_PRELOAD): the
launcher adds it to the model process's environment only.

Idle OpenMP threads (`GOMP_SPINCOUNT`): between two parallel regions
libgomp's threads spin 300,000 iterations before they sleep, milliseconds
on this CPU. Every layer's ops are such regions, so when another process
takes one of the model's cores for a moment (the front end reading a 4 MiB
body), the thread on the other core spins until its partner is back and
the step stalls for the whole burst. The model process spins 10,000
iterations instead (unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set): quiet
steps cost the same, a step that meets such a burst stalls far less, and
sleeping at once (OMP_WAIT_POLICY=passive) would slow every quiet step
(docs/performance.md, "A burst of huge posts against the streams").

Threads (`--cpu-threads`): by default torch's, one per physical core; with
several tensor-parallel ranks on a node, the cores the process may run on
(its affinity mask) divided among them. Fewer leave cores to the tokenizer
and scheduler processes on a machine that has cores to spare. On this
2-core machine the default (2) is the fastest: every native op and oneDNN
matmul splits its work over them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import os

logger = logging.getLogger(__name__)

TCMALLOC_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # ctypes.util.find_library names


class CpuAllocator(enum.StrEnum):
    AUTO = "auto"          # tcmalloc where installed, else the system's malloc
    TCMALLOC = "tcmalloc"  # tcmalloc, or a start-up error if it is not installed
    SYSTEM = "system"      # the system's malloc (glibc)


def find_tcmalloc() -> str | None:
    """The tcmalloc library's soname (what LD_PRELOAD resolves through the
    loader's cache), or None if it is not installed."""
    for name in TCMALLOC_LIBRARIES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def allocator_preload(allocator: CpuAllocator, device: str, tcmalloc: str | None = None) -> str | None:
    """The library to preload into the model process, or None: tcmalloc on a
    CPU device (a GPU's memory is not malloc's) unless SYSTEM. `tcmalloc`:
    the library, found if not given. Raises RuntimeError for TCMALLOC when it
    is not installed; AUTO then logs one line and keeps the system's."""
    if allocator == CpuAllocator.SYSTEM or not device.startswith("cpu"):
        return None
    library = tcmalloc or find_tcmalloc()
    if library is None:
        if allocator == CpuAllocator.TCMALLOC:
            raise RuntimeError("--cpu-allocator tcmalloc: tcmalloc is not installed "
                               "(Debian/Ubuntu: apt install libtcmalloc-minimal4)")
        logger.info("tcmalloc not found: the model process uses the system's malloc "
                    "(apt install libtcmalloc-minimal4 makes CPU steps ~5-15% faster)")
    return library


OMP_SPIN_COUNT = 10_000  # libgomp's idle spin before sleeping (its default: 300,000)


def with_omp_spin(env: dict[str, str], device: str) -> dict[str, str]:
    """`env` with the model process's short OpenMP spin on a CPU device,
    unless the user chose a wait policy or a spin count."""
    if not device.startswith("cpu") or "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return env
    return {**env, "GOMP_SPINCOUNT": str(OMP_SPIN_COUNT)}


def with_preload(env: dict[str, str], library: str | None) -> dict[str, str]:
    """`env` with `library` first in LD_PRELOAD (other preloads kept; None: unchanged)."""
    if library is None:
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    if library not in preload:
        preload.insert(0, library)
    return {**env, "LD_PRELOAD": " ".join(preload)}


def preloaded_allocator() -> str:
    """What this process runs on: "tcmalloc" if it is mapped, else "system"
    (for /get_server_info)."""
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" if "tcmalloc" in f.read() else "system"
    except OSError:
        return "unknown"


def release_free_memory() -> bool:
    """Hand the allocator's free memory back to the kernel: tcmalloc's
    `MallocExtension_ReleaseFreeMemory` where it is loaded, else glibc's
    `malloc_trim`. tcmalloc keeps what a process frees for its next
    allocations, which is what a step wants, but a model load's transients
    (a GGUF's one-time conversion to a float folder, the file's separate
    q/k/v blocks once stacked) are never asked for again: kept, they stay
    out of the KV pool's budget and in the process for its whole life.
    False where neither function is there."""
    process = ctypes.CDLL(None)  # the process's global symbols, a preloaded tcmalloc's among them
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        release = getattr(process, name, None)
        if release is not None:
            release(*args)
            return True
    return False


def model_threads(cpu_threads: int | None, ranks_per_node: int, cores: int | None = None) -> int | None:
    """OpenMP threads for one model rank: --cpu-threads if given; else, with
    several ranks on the node, the process's cores (`cores`, default its
    affinity mask) shared by them; else None: torch's own default, one
    thread per physical core."""
    if cpu_threads is not None:
        return cpu_threads
    if ranks_per_node <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // ranks_per_node)
