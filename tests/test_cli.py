"""The ``postrl`` command: every command's help, the package's import graph, user stages found from the current
folder and the config's folder as the console script runs them, warnings as one line, ``postrl methods NAME``."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import postrl
from postrl import registry
from postrl.cli import build_parser, main
from postrl.cli.common import add_import_paths, format_warning
from postrl.cli.methods import stage_parameters
from test_layers import cycles, module_graph

SRC = Path(postrl.__file__).resolve().parents[1]  # the folder that holds the postrl package
PKG = SRC / "postrl"


# ------------------------------------------------------------------------------------------------ help
def _commands(parser: argparse.ArgumentParser, prefix: tuple = ()) -> list[tuple[str, ...]]:
    """Every command path (('train',), ('rm', 'train'), ...) of the parser, found by walking its sub-parsers."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append(prefix + (name,))
                out += _commands(sub, prefix + (name,))
    return out


def test_every_command_has_help(capsys):
    cmds = _commands(build_parser())
    assert {("train",), ("sft",), ("eval",), ("methods",), ("config",), ("config", "show"), ("config", "reference"),
            ("bench",), ("samples",), ("report",), ("doctor",), ("probe-reward",), ("rm",), ("rm", "train"),
            ("rm", "eval"), ("prm",), ("prm", "train"), ("calibrate",), ("sandbox",)} <= set(cmds)
    for cmd in [(), *cmds]:
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--help"])
        assert e.value.code == 0, cmd
        out = capsys.readouterr().out
        assert out.startswith(f"usage: postrl {' '.join(cmd)}".rstrip()), (cmd, out[:80])


def test_help_lists_the_commands_in_order():
    text = build_parser().format_help()
    order = ["train", "sft", "eval", "methods", "config", "bench", "samples", "report", "doctor", "probe-reward",
             "rm", "prm", "calibrate", "sandbox"]
    pos = [re.search(rf"\n    {c}\s", text).start() for c in order]
    assert pos == sorted(pos)


def test_help_does_not_load_torch():
    r = subprocess.run([sys.executable, "-c", "import sys; from postrl.cli import build_parser; build_parser(); "
                        "print('torch' in sys.modules)"], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# ------------------------------------------------------------------------------------------------ import graph
def _module_graph() -> dict[str, set[str]]:
    """tests/test_layers.py's module graph, a package and its own modules one unit (importing a submodule runs its
    package's __init__)."""
    return {m: {r for r in targets if not m.startswith(r + ".") and not r.startswith(m + ".")}
            for m, targets in module_graph().items()}


def test_no_import_cycle_through_the_cli_or_the_report():
    graph = _module_graph()
    assert "postrl.cli.train" in graph and "postrl.report.commands" not in graph
    assert not any(m.startswith("postrl.cli") for m in graph["postrl.report.html"] | graph["postrl.diagnostics.sinks"])
    # postrl.bench's own entry point still calls postrl.cli.main (the benchmark moves into its own package,
    # which drops that edge); every other cycle through the CLI or the report is an error
    bad = [sorted(c) for c in cycles(graph) if any(m.startswith(("postrl.cli", "postrl.report")) for m in c)
           and c != {"postrl.cli", "postrl.bench"}]
    assert bad == []


# ------------------------------------------------------------------------------------------------ import paths
def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(SRC)
    env.update(extra)
    return env


def _console_script(tmp_path: Path) -> Path:
    """The script pip installs as ``postrl`` (``[project.scripts] postrl = "postrl.cli:main"``), in its own folder:
    run with ``python SCRIPT``, sys.path[0] is that folder, not the current one (unlike ``python -m`` / ``-c``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "postrl"
    script.write_text("import re\nimport sys\nfrom postrl.cli import main\nif __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
    return script


README_REWARD = textwrap.dedent("""\
    def exact_answer(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
    """)


def test_readme_reward_resolves_from_the_current_folder_with_the_console_script(tmp_path):
    script = _console_script(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_rewards.py").write_text(README_REWARD)
    reward = "rewards=[{name: my_rewards:exact_answer, weight: 1.0}]"
    r = subprocess.run([sys.executable, str(script), "config", "show", reward], cwd=work, capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "name: my_rewards:exact_answer" in r.stdout
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(script), "train", reward, "train.steps=1", "train.prompts_per_step=2",
                        "rollout.group_size=2", "train.eval_size=2", "train.eval_k=1", f"output_dir={out}",
                        "--quiet"], cwd=work, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["reward/my_rewards:exact_answer/failures"] == 0.0  # the README's reward scored every completion


def test_stage_module_resolves_from_the_config_files_folder(tmp_path):
    script = _console_script(tmp_path)
    proj = tmp_path / "project"
    proj.mkdir()
    (proj / "team_rewards.py").write_text(README_REWARD)
    (proj / "run.yaml").write_text("rewards:\n  - {name: team_rewards:exact_answer}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cmd in (["config", "show", str(proj / "run.yaml")], ["probe-reward", str(proj / "run.yaml"), "--json"]):
        r = subprocess.run([sys.executable, str(script), *cmd], cwd=elsewhere, capture_output=True, text=True,
                           env=_env(), timeout=120)
        assert r.returncode == 0, (cmd, r.stderr)
    assert "team_rewards:exact_answer" in r.stdout
    # a module that exists nowhere on the path is still one clear line
    r = subprocess.run([sys.executable, str(script), "config", "show", "rewards=[{name: nowhere:f}]"],
                       cwd=elsewhere, capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("postrl: error: reward 'nowhere:f': cannot import module")
    assert "Traceback" not in r.stderr


def test_add_import_paths_order_and_no_duplicates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    path = ["/some/site-packages"]
    assert add_import_paths(cfg_dir / "run.yaml", path) == [str(tmp_path), str(cfg_dir)]
    assert path == [str(tmp_path), str(cfg_dir), "/some/site-packages"]  # like python -m: the current folder first
    assert add_import_paths(cfg_dir / "other.yaml", path) == [] and len(path) == 3
    path = [""]  # python -m / -c: '' is the current folder already
    assert add_import_paths(None, path) == [] and path == [""]


# ------------------------------------------------------------------------------------------------ warnings
def test_warning_lines_are_one_line():
    own = str(PKG / "train" / "trainer.py")
    assert format_warning(UserWarning("group_size=1:\n  every advantage is 0"), UserWarning, own, 172) == \
        "warning: group_size=1: every advantage is 0"
    lib = "/usr/lib/python3/site-packages/transformers/x.py"
    assert format_warning("old API", FutureWarning, lib, 9) == f"warning: old API [FutureWarning, {lib}:9]"


def test_group_size_one_warning_prints_as_one_console_line(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import sys; from postrl.cli import main; sys.exit(main())", "train",
                        "rollout.group_size=1", "train.steps=1", "train.prompts_per_step=2", "train.eval_size=2",
                        "train.eval_k=1", f"output_dir={tmp_path / 'run'}", "--quiet"],
                       cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # today's text: "warning: advantage 'grpo' uses the group as its baseline and rollout.group_size=1: every
    # advantage is 0 (...)"; before: "<file>:<line>: UserWarning: advantage ..." and the source line below it
    lines = [x for x in r.stderr.splitlines() if "group_size=1" in x]
    assert len(lines) == 1 and re.fullmatch(r"warning: advantage 'grpo' .*group_size=1.*", lines[0]), r.stderr
    assert "UserWarning" not in r.stderr and "Trainer(" not in r.stderr


def test_show_warnings_as_lines_writes_through_warnings(capsys):
    from postrl.cli.common import show_warnings_as_lines

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show_warnings_as_lines()
        warnings.warn_explicit("a\nb", UserWarning, str(PKG / "config.py"), 3)
    assert capsys.readouterr().err == "warning: a b\n"


# ------------------------------------------------------------------------------------------------ methods NAME
def test_methods_name_shows_the_model_rewards_parameters(capsys):
    assert main(["methods", "model", "--kind", "reward", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    params = {p["name"]: p for p in d["parameters"]}
    assert params["path"] == {"name": "path", "type": "str", "default": None, "required": True}
    assert params["aggregate"]["default"] == "mean" and not params["aggregate"]["required"]
    assert params["calibrator"] == {"name": "calibrator", "type": "null or str", "default": None, "required": False}
    # the range or the choices, from the annotation (the schema the config is validated against)
    assert params["aggregate"]["type"] == '"mean" / "min" / "uwo"'
    assert params["batch_size"]["type"] == "int, >= 1" and params["member"]["type"] == "null or int, >= 0"
    assert list(params)[:3] == ["path", "aggregate", "uwo_lambda"]  # declaration order
    assert d["source"].startswith("a trained reward model") and d["defined_in"] == "postrl.rewards.model:model_reward"
    assert "ensemble" in d["description"]
    assert main(["methods", "model", "--kind", "reward"]) == 0
    text = capsys.readouterr().out
    assert "path" in text and "required" in text and "'mean'" in text and "calibrator" in text


def test_methods_name_shows_ranges_and_choices(capsys):
    from postrl.cli.methods import type_text

    assert main(["methods", "ppo_clip", "--kind", "loss", "--json"]) == 0
    params = {p["name"]: p["type"] for p in json.loads(capsys.readouterr().out)["parameters"]}
    assert params == {"eps_low": "float, >= 0 and < 1", "eps_high": "float, >= 0", "dual_clip": "null or float, > 1"}
    assert main(["methods", "grpo", "--kind", "advantage"]) == 0
    text = capsys.readouterr().out
    assert '"group" / "batch" / "none"' in text and "float, >= 0" in text
    fmt = {p["name"]: p["type"] for p in stage_parameters(registry.get("reward", "format"))}
    assert fmt["pattern"] == "str, a regular expression (Python re)"
    assert type_text(registry.get("sampling", "multi_temperature").__init__.__annotations__["temperatures"]) == \
        "Annotated[tuple[Annotated[float, Ge(0)], ...], MinLen(1)]"  # unresolved (a string): shown as written
    assert stage_parameters(registry.get("sampling", "multi_temperature"))[0]["type"] == \
        "list of (float, >= 0), at least 1 item"


def test_stage_parameters_of_every_registered_stage_match_its_signature():
    import inspect

    for e in registry.all_entries():
        params = stage_parameters(e.fn)
        target = e.fn.__init__ if inspect.isclass(e.fn) else e.fn
        sig = inspect.signature(target).parameters.values()
        kw = [p.name for p in sig if p.kind is p.KEYWORD_ONLY]
        assert [p["name"] for p in params if not p["name"].startswith("**")] == kw, (e.kind, e.name)
        for p in params:
            if p["name"] in kw:
                d = inspect.signature(target).parameters[p["name"]].default
                assert p["required"] == (d is inspect.Parameter.empty) and (p["required"] or p["default"] == d)


def test_methods_name_of_a_class_stage_and_errors(capsys):
    cls = next(e for e in registry.all_entries() if isinstance(e.fn, type) and stage_parameters(e.fn))
    assert main(["methods", cls.name, "--kind", cls.kind, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["parameters"] == json.loads(json.dumps(stage_parameters(cls.fn), default=repr))
    assert main(["methods", "no_such_stage"]) == 2
    assert "no stage 'no_such_stage'" in capsys.readouterr().err


def test_methods_name_of_a_user_stage_by_import_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    (tmp_path / "user_stage_mod.py").write_text(
        "def bonus(prompts, completions, *, scale: float = 2.0, tag: str):\n    '''Scaled bonus.'''\n")
    assert main(["methods", "user_stage_mod:bonus", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["parameters"] == [{"name": "scale", "type": "float", "default": 2.0, "required": False},
                               {"name": "tag", "type": "str", "default": None, "required": True}]
