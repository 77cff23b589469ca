"""The native CPU ops, one C++ module each, built on first use with
torch.utils.cpp_extension into a persistent cache directory and reused
afterwards (ninja rebuilds only when the source or flags change):

- `attention` (attention.cpp): decode and extend attention over the paged pool;
- `layers` (layers.cpp): the bfloat16 matmuls with their epilogues, RMSNorm, rotary;
- `quant` (quant.cpp): matmuls on GGUF-quantized weight blocks (model_proc/quant/);
- `quant_dot` (quant_dot.cpp): the same with x quantized to 8-bit blocks, integer dot products.

`load(name)` returns the compiled module, or None when it cannot be built
(no compiler, a failed build, not a CPU build of torch...); the reason is
logged once, and the caller keeps its torch path. `python -m
model_proc.native` builds them ahead of time (scripts/install.sh does).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = ("attention", "layers", "quant", "quant_dot")
CFLAGS = ["-O3", "-fopenmp", "-march=native", "-std=c++17"]
# a module's own flags besides: quant's dequantization equals gguf-py's bit for bit,
# which needs each float32 multiply and add rounded apart (g++ fuses them by default)
# (quant_dot: its AVX2 and scalar paths agree bit for bit, the same float ops in the same order)
MODULE_CFLAGS = {"quant": ["-ffp-contract=off"], "quant_dot": ["-ffp-contract=off"]}
# the headers a module's source includes (from this folder): copied beside it and hashed with it
MODULE_HEADERS = {"quant": ["ggml_blocks.h"], "quant_dot": ["ggml_blocks.h"]}
# what each module is for, in its log lines
PURPOSE = {"attention": "native attention op", "layers": "native layer ops", "quant": "native quantized matmul",
           "quant_dot": "native 8-bit-activation quantized matmul"}

_modules: dict[str, ModuleType] = {}
_failures: dict[str, str] = {}


def cflags(name: str) -> list[str]:
    return CFLAGS + MODULE_CFLAGS.get(name, [])


def build_dir(name: str = "attention") -> str:
    """~/.cache/batchserve/native/<name>-<torch version>-<machine>-<cpu flags + torch path hash>-<source hash>:
    the binary is built for this processor (-march=native), this torch and
    this source. The source is in the name because checkouts share the cache
    (worktrees, other branches): without it one checkout's build would
    replace another's under the same name."""
    root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "batchserve", "native")
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    # the torch installation too: ninja rebuilds when the compile line changes, and a
    # virtual environment's torch has other include paths, so two environments sharing
    # one directory rebuilt it in turn (each test's model process waiting a minute on it)
    cpu = hashlib.sha1((flags + os.path.dirname(torch.__file__)).encode()).hexdigest()[:10]
    text = b"".join(open(os.path.join(HERE, f), "rb").read() for f in [f"{name}.cpp", *MODULE_HEADERS.get(name, [])])
    digest = hashlib.sha1(text + " ".join(cflags(name)).encode()).hexdigest()[:10]
    path = os.path.join(root, f"{name}-torch{torch.__version__}-{platform.machine()}-{cpu}-{digest}")
    os.makedirs(path, exist_ok=True)
    return path


def _source_copy(name: str, directory: str) -> str:
    """The source and its headers, copied into its build directory (whose name
    holds their hash): ninja's build file names the source's path, so building
    from each checkout's own file would rebuild whenever another checkout used
    the cache. Returns the source's copy."""
    for file in [*MODULE_HEADERS.get(name, []), f"{name}.cpp"]:
        path = os.path.join(directory, file)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}"
            shutil.copyfile(os.path.join(HERE, file), tmp)
            os.replace(tmp, path)  # atomic: a concurrent build sees the whole file or none
    return path


@contextlib.contextmanager
def _build_lock(directory: str) -> Iterator[None]:
    """One builder of a directory at a time, by a lock the kernel drops when
    its holder dies. torch's own lock is a file that a killed build leaves
    behind (a server stopped during its first start), and every later load
    then waits for it forever; under ours, such a file is stale and removed."""
    fd = os.open(os.path.join(directory, "build.flock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, "lock"))  # torch.utils.file_baton's
        yield
    finally:
        os.close(fd)  # releases the lock


def load(verbose: bool = False, name: str = "attention") -> ModuleType | None:
    """The compiled module `name`, built if needed; None (and one log line) if it cannot be."""
    if name in _modules or name in _failures:
        return _modules.get(name)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _failures[name] = f"no C++ compiler ({compiler!r} not on PATH)"
    else:
        try:
            from torch.utils.cpp_extension import load as cpp_load
            directory = build_dir(name)
            with _build_lock(directory):
                _modules[name] = cpp_load(name=f"batchserve_native_{name}", sources=[_source_copy(name, directory)],
                                          extra_cflags=cflags(name), extra_ldflags=["-fopenmp"],
                                          build_directory=directory, verbose=verbose)
        except Exception as e:  # any build or import failure: keep the torch path
            _failures[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    if name in _failures:
        logger.warning("%s unavailable, using the torch path: %s", PURPOSE[name], _failures[name])
    return _modules.get(name)


def failure(name: str = "attention") -> str | None:
    """Why load(name) returned None (None if it has not, or has not been called)."""
    return _failures.get(name)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages (madvise MADV_HUGEPAGE) under the
    2 MiB-aligned interior of a CPU tensor's memory: pages not yet touched
    then fault in 2 MiB at a time. Decode reads K/V rows at scattered slots,
    one TLB miss per row with 4 KiB pages; on 2 MiB pages the native decode
    on scattered slots is faster (python -m bench.micro.attention_bench, with
    and without --no-huge-pages; /sys/kernel/mm/transparent_hugepage/enabled
    = madvise, as on this machine). False where it cannot (not Linux, not
    CPU, too small, refused); harmless then."""
    if t.device.type != "cpu" or not os.path.exists("/sys/kernel/mm/transparent_hugepage"):
        return False
    start = (t.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose memory starts on a 2 MiB boundary
    and is advised onto transparent huge pages before anything touches it
    (a tensor that has been written is already on 4 KiB pages). Used for the
    packed matmul weights (layers.move_packed_onto_huge_pages): a decode step
    streams all of them, and on 4 KiB pages every 4 KiB is a TLB miss and
    the end of the hardware prefetcher's run. Where the advice is refused the
    buffer is ordinary memory."""
    # whole huge pages from an aligned start: the last one, only partly
    # used, is still inside the allocation, so it is advised too
    pages = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    raw = torch.empty(pages + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    advise_huge_pages(raw[start:start + pages])
    return raw[start:start + nbytes]
