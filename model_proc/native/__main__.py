"""Build (or find already built) the native attention op: python -m model_proc.native"""

import logging
import sys
import time

from model_proc import native

logging.basicConfig(level=logging.INFO, format="%(message)s")
start = time.perf_counter()
module = native.load(verbose="-v" in sys.argv)
if module is None:
    sys.exit(f"native attention op: not built ({native.failure()}); the server will use the torch path")
print(f"native attention op ready ({module.simd}) in {native.build_dir()}, {time.perf_counter() - start:.1f} s")
