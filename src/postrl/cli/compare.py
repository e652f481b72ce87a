"""``postrl compare SPEC.yaml``: a base config and its variants x seeds, with confidence intervals (docs/compare.md)."""

from __future__ import annotations

from postrl.cli.common import add_import_paths
from postrl.errors import ConfigError


def run(args) -> int:
    from pathlib import Path

    from rich.console import Console

    from postrl.compare import cell_state, load_spec, plan, run_comparison

    add_import_paths(args.spec)
    spec = load_spec(args.spec)
    if args.out:
        spec.out = Path(args.out)
    if args.jobs < 1:
        raise ConfigError(f"--jobs: expected at least 1, got {args.jobs}")
    console = Console()
    if not console.is_terminal:  # a log file: the table's full width, not 80 columns
        console = Console(width=160)
    cells = plan(spec)  # resolves and validates every cell's config first
    if args.dry_run:
        console.print(f"{spec.name}: {len(cells)} cells ({len(spec.all_variants)} variants x {len(spec.seeds)} "
                      f"seeds) into {spec.out}")
        for c in cells:
            console.print(f"  {c.label:<32} {cell_state(c):<7} {c.run_dir}  steps={c.cfg.train.steps} "
                          f"advantage={c.cfg.advantage.name} loss={c.cfg.loss.name}")
        return 0
    run_comparison(spec, jobs=args.jobs, progress=not args.quiet, console=console)
    console.print(f"wrote {spec.out / 'results.json'}, {spec.out / 'report.html'}, {spec.out / 'table.txt'}")
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="run a base config and its variants over seeds; means, 95%% CIs, paired "
                       "tests and an HTML report", description="Train every (variant, seed) cell of SPEC (resumable: "
                       "finished cells are not re-run) and write a comparison directory (docs/compare.md).")
    c.add_argument("spec", metavar="SPEC.yaml")
    c.add_argument("--jobs", type=int, default=1, help="cells trained at once (1: in this process; more: that many "
                   "`postrl train` processes)")
    c.add_argument("--out", help="comparison directory (default: the spec's `out`, else compare/<spec name>)")
    c.add_argument("--dry-run", action="store_true", help="print the cells and their state, train nothing")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=run)
