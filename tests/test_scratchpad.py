"""The reasoning testbed: the `scratchpad` task (multi-step sums with written partial sums), its verifier, its
imperfect teacher, and the shipped warm start of the `scratchpad` recipe."""

from __future__ import annotations

import pytest

from postrl import recipes
from postrl.config import load_config
from postrl.data import load_source
from postrl.errors import ConfigError
from postrl.models.builtin import SHIPPED, builtin_name


def _task(**kw):
    return load_source({"name": "scratchpad", **kw})


def test_verifier_reads_the_number_after_the_last_so():
    t = _task()
    row = {"answer": "42"}
    assert t.verify("23+7=30;30+4=34;34+8=42;so 42", row) == 1.0
    assert t.verify("so 42", row) == 1.0  # a direct answer is right when its number is
    assert t.verify("23+7=30;so 41", row) == 0.0
    assert t.verify("23+7=30;30+4=34;34+8=42", row) == 0.0  # no answer
    assert t.verify("so 40;so 42", row) == 1.0  # the last answer counts
    assert t.verify("so 42, I think", row) == 0.0  # the answer must be a bare integer
    assert t.verify("so 42", {}) is None


def test_the_teacher_writes_the_partial_sums():
    t = _task(numbers=4, digits=2, step_digits=1)
    for r in t.train_rows(0, 50, 0):
        nums = r["numbers"]
        assert r["prompt"] == "+".join(map(str, nums)) + "=" and int(r["answer"]) == sum(nums)
        assert len(nums) == 4 and nums[0] < 100 and all(0 < x < 10 for x in nums[1:])
        steps = r["solution"].split(";")
        assert len(steps) == 4 and steps[-1] == f"so {r['answer']}"
        acc = nums[0]
        for x, step in zip(nums[1:], steps):  # "acc+x=acc'"
            assert step == f"{acc}+{x}={acc + x}"
            acc += x
        assert t.verify(r["solution"], r) == 1.0


def test_direct_verbose_and_slipping_teachers():
    assert all(r["solution"] == f"so {r['answer']}" for r in _task(direct=1.0).train_rows(0, 20, 0))
    for r in _task(verbose=1.0).train_rows(0, 20, 0):
        steps = r["solution"].split(";")
        # each partial sum is followed by its check: "30+4=34;34-4=30"
        assert len(steps) == 2 * 3 + 1
        for add, check in zip(steps[0:-1:2], steps[1:-1:2]):
            a, rest = add.split("+")
            x, total = rest.split("=")
            assert check == f"{total}-{x}={a}"
        assert _task().verify(r["solution"], r) == 1.0
    rows = _task(slip=1.0).train_rows(0, 30, 0)
    for r in rows:  # every partial sum is off by 1..3
        a, rest = r["solution"].split(";")[0].split("+")
        x, total = map(int, rest.split("="))
        assert 1 <= abs(total - (int(a) + x)) <= 3
    assert sum(_task().verify(r["solution"], r) for r in rows) < len(rows) / 2


def test_fractions_of_the_teacher_must_add_up():
    with pytest.raises(ConfigError, match="direct \\+ verbose"):
        load_config(None, ["task={name: scratchpad, direct: 0.6, verbose: 0.5}"])


def test_the_recipe_ships_its_warm_start_and_it_writes_long_partly_wrong_traces():
    from postrl.generation import SamplingParams, encode_prompt
    from postrl.models import load_model_and_tokenizer
    from postrl.rollout.hf import HFGenerator

    cfg = load_config(None, [], base=recipes.load("scratchpad"))
    path = SHIPPED / builtin_name(cfg)
    assert (path / "config.json").is_file(), "rebuild it: make builtin-scratchpad"
    task = load_source(cfg.task.model_dump())
    rows = task.eval_rows(24, 0)
    model, tok = load_model_and_tokenizer(path)
    ids = [encode_prompt(tok, r["prompt"], "auto") for r in rows]
    out = HFGenerator(model, tok).generate(ids, 4, SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                                                  temperature=1.0), seed=0)
    right = [task.verify(t, rows[i // 4]) for i, t in enumerate(out.texts)]
    # partly wrong: a useful RL start has both right and wrong samples
    assert 0.1 <= sum(right) / len(right) <= 0.9, sum(right) / len(right)
    # the teacher's three styles show up in the samples: direct answers, plain and verbose (checked) scratchpads
    direct = sum(t.startswith("so ") for t in out.texts)
    verbose = sum("-" in t for t in out.texts)
    assert direct >= 4 and verbose >= 8, (direct, verbose)
    long = [len(t) for t in out.texts if "-" in t]
    assert sum(long) / len(long) > 1.5 * sum(len(t) for t in out.texts if ";" in t and "-" not in t) / max(
        1, sum(";" in t and "-" not in t for t in out.texts))


def test_the_recipe_trains_from_its_shipped_model(tmp_path, monkeypatch):
    from postrl.cli import main

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("POSTRL_CACHE", str(cache))
    out = tmp_path / "run"
    assert main(["train", "--recipe", "scratchpad", "--quiet", f"output_dir={out}", "train.steps=2",
                 "train.prompts_per_step=2", "rollout.group_size=4", "train.eval_size=4", "train.eval_k=1"]) == 0
    assert not any(cache.iterdir())  # RL started from the shipped warm start: nothing was built
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["length/mean"] > 5 for r in rows)  # scratchpads, not bare answers
