"""Build (or find already built) the native ops: python -m model_proc.native [-v]

Each module is one C++ file compiled on one core: they are built side by
side, one process per core (the install's share of a fresh machine's CI time).
"""

import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from model_proc import native


def build(name: str) -> tuple[str, str | None, float]:
    """(name, why it was not built or None, seconds)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    module = native.load(verbose="-v" in sys.argv, name=name)
    return name, None if module is not None else native.failure(name), time.perf_counter() - start


if __name__ == "__main__":
    missing = []
    with ProcessPoolExecutor(max_workers=max(1, min(len(native.MODULES), os.cpu_count() or 1))) as pool:
        for name, failure, seconds in pool.map(build, native.MODULES):
            if failure is not None:
                print(f"{native.PURPOSE[name]}: not built ({failure}); the server will use the torch path")
                missing.append(name)
            else:
                print(f"{native.PURPOSE[name]} ready in {native.build_dir(name)}, {seconds:.1f} s")
    sys.exit(1 if missing else 0)
