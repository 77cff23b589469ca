"""Build (or find already built) the native ops: python -m model_proc.native [-v]"""

import logging
import sys
import time

from model_proc import native

logging.basicConfig(level=logging.INFO, format="%(message)s")
missing = []
for name in native.MODULES:
    start = time.perf_counter()
    module = native.load(verbose="-v" in sys.argv, name=name)
    if module is None:
        print(f"{native.PURPOSE[name]}: not built ({native.failure(name)}); the server will use the torch path")
        missing.append(name)
    else:
        print(f"{native.PURPOSE[name]} ready in {native.build_dir(name)}, {time.perf_counter() - start:.1f} s")
sys.exit(1 if missing else 0)
