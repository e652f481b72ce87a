"""The library API: ``import postrl`` exposes ``__all__`` lazily (fast, no torch at import), ships ``py.typed``,
and every Python example of docs/api.md runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import postrl

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(postrl.__file__).resolve().parents[1]


def test_import_postrl_is_light():
    code = ("import sys, postrl; heavy = [m for m in ('torch', 'transformers', 'pydantic', 'numpy', 'yaml') "
            "if m in sys.modules]; print(heavy, sorted(postrl.__all__) == sorted(set(postrl.__all__)))")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["[]", "True"], r.stdout + r.stderr


def test_every_public_name_resolves_to_its_definition():
    from postrl import config, rewards
    from postrl.batch import RolloutBatch
    from postrl.train.trainer import Trainer

    for name in postrl.__all__:
        assert getattr(postrl, name) is not None, name
        assert name in dir(postrl)
    assert postrl.Trainer is Trainer and postrl.RolloutBatch is RolloutBatch
    assert postrl.Config is config.Config and postrl.load_config is config.load_config
    assert postrl.score_batch is rewards.score_batch and postrl.register is postrl.registry.register
    assert postrl.losses.ppo_clip is postrl.registry.get("loss", "ppo_clip")
    assert postrl.advantages.grpo is postrl.registry.get("advantage", "grpo")
    assert postrl.losses.token_mean is postrl.registry.get("aggregation", "token_mean")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        postrl.nope  # noqa: B018


def test_py_typed_is_shipped():
    assert (SRC / "postrl" / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; the package supports 3.10)
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^postrl = \[[^\]]*"py\.typed"', section, re.M), section


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "api.md").read_text(), re.S | re.M)


def test_api_doc_names_every_public_name():
    doc = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in postrl.__all__ if n != "__version__" and f"`{n}" not in doc and f"postrl.{n}" not in doc
               and not re.search(rf"[`, ]{re.escape(n)}[`(,]", doc)]
    assert missing == []


@pytest.mark.parametrize("i", range(4))
def test_api_doc_examples_run(i, tmp_path, monkeypatch, capsys):
    blocks = _python_blocks()
    assert len(blocks) == 4  # a new example gets its own parameter above
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[i], f"docs/api.md[python block {i}]", "exec"), {"__name__": f"api_doc_{i}"})
    out = capsys.readouterr().out
    if i == 2:  # the training run reached its end and printed the held-out accuracies
        assert re.fullmatch(r"[0-9.]+ -> [0-9.]+\n", out), out
