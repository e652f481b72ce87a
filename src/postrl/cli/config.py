"""``postrl config show|reference``: the resolved configuration, the configuration reference."""

from __future__ import annotations

from postrl.cli.common import add_import_paths, split_args


def run_show(args) -> int:
    from postrl.config import dump_yaml, load_config

    path, overrides = split_args(args.items)
    add_import_paths(path)
    cfg = load_config(path, overrides)
    if cfg.model.path != "builtin":  # what train would refuse when it loads the model, said here too
        from postrl.models import check_model_folder

        check_model_folder(cfg.model.path)
    if cfg.output_dir is not None:
        from postrl.train.run_state import check_run_dir

        check_run_dir(cfg.output_dir)
    print(dump_yaml(cfg), end="")
    return 0


def run_reference(args) -> int:
    from postrl.config import reference_markdown

    print(reference_markdown())
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    cs = csub.add_parser("show", help="print the resolved config")
    cs.add_argument("items", nargs="*", metavar="[FILE] [KEY=VALUE]")
    cs.set_defaults(fn=run_show)
    cr = csub.add_parser("reference", help="print the configuration reference (markdown)")
    cr.set_defaults(fn=run_reference)
