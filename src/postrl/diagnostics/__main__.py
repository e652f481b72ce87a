"""``python -m postrl.diagnostics docs/metrics.md``: rewrite the tables of docs/metrics.md generated from
:mod:`postrl.diagnostics.engines` (metric and option names of postrl, TRL and verl)."""

from postrl.diagnostics.engines import main

raise SystemExit(main())
