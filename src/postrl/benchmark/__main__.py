"""``python -m postrl.benchmark [worker|run-steps] ...``: the benchmark's entry point (its worker processes too)."""

import sys

from postrl.benchmark.harness import main

sys.exit(main())
