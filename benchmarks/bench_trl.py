"""postrl's training step vs TRL's GRPOTrainer, side by side at equal work, on CPU.

The same as ``postrl bench`` (the harness lives in ``postrl.benchmark.harness``); for example::

    python benchmarks/bench_trl.py --quick                 # < 1 minute: 1M model, 32 tokens
    python benchmarks/bench_trl.py --also trl@1            # full tables (+ TRL on 1 thread) and the scaling table
    python benchmarks/bench_trl.py --markdown out.md --json out.json

Needs ``pip install 'postrl[bench]'`` (trl). Results and how to read them: docs/benchmarks.md.
"""

import sys

from postrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
