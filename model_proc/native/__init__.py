"""The native CPU attention op (attention.cpp), built on first use with
torch.utils.cpp_extension into a persistent cache directory and reused
afterwards (ninja rebuilds only when the source or flags change).

`load()` returns the compiled module, or None when it cannot be built (no
compiler, a failed build, not a CPU build of torch...); the reason is
logged once, and the caller keeps the torch path. `python -m
model_proc.native` builds it ahead of time (scripts/install.sh does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.cpp")
CFLAGS = ["-O3", "-fopenmp", "-march=native", "-std=c++17"]

_module: ModuleType | None = None
_failure: str | None = None


def build_dir() -> str:
    """~/.cache/batchserve/native/<torch version>-<machine>-<cpu flags hash>:
    the binary is built for this processor (-march=native) and this torch."""
    root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "batchserve", "native")
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    cpu = hashlib.sha1(flags.encode()).hexdigest()[:10]
    path = os.path.join(root, f"torch{torch.__version__}-{platform.machine()}-{cpu}")
    os.makedirs(path, exist_ok=True)
    return path


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled op, built if needed; None (and one log line) if it cannot be."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _failure = f"no C++ compiler ({compiler!r} not on PATH)"
    else:
        try:
            from torch.utils.cpp_extension import load as cpp_load
            _module = cpp_load(name="batchserve_native_attention", sources=[SOURCE],
                               extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                               build_directory=build_dir(), verbose=verbose)
        except Exception as e:  # any build or import failure: keep the torch path
            _failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    if _failure is not None:
        logger.warning("native attention op unavailable, using the torch attention path: %s", _failure)
    return _module


def failure() -> str | None:
    """Why load() returned None (None if it has not, or has not been called)."""
    return _failure
