"""Imported by workers in start-up tests: ``PARALLEL_TEST_SLOW_IMPORT=<dir>`` announces the import with a
file named after the worker's pid, then takes 60 s; ``PARALLEL_TEST_FAIL_IMPORT=1`` raises. Rank 0,
which imports it first and without those variables, is left alone."""

import os
import time

if os.environ.get("PARALLEL_TEST_SLOW_IMPORT"):
    open(os.path.join(os.environ["PARALLEL_TEST_SLOW_IMPORT"], str(os.getpid())), "w").close()
    time.sleep(60)
if os.environ.get("PARALLEL_TEST_FAIL_IMPORT"):
    raise RuntimeError("import failed on purpose")
