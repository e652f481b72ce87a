"""Prompt sources: procedural tasks and their verifiers, file/dataset sources, reasoning-gym adapter."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from postrl.data import (
    ArithmeticTask,
    CountdownTask,
    FileSource,
    is_held_out,
    load_source,
    verify_row,
)
from postrl.data.tasks import eval_countdown_expr
from postrl.errors import ConfigError, DataError

# ------------------------------------------------------------------------------------------ verifiers


def test_arithmetic_verify_cases():
    row = {"prompt": "47+385=", "answer": "432", "task": "arithmetic"}
    assert ArithmeticTask.verify("432", row) == 1.0
    assert ArithmeticTask.verify("  +432 \n", row) == 1.0
    assert ArithmeticTask.verify("431", row) == 0.0
    for bad in ["", "12 13", "432abc", "432 432", "4_32", "432.0", "abc", "--432", "٤٣٢"]:
        assert ArithmeticTask.verify(bad, row) == 0.0, bad
    neg = {"prompt": "3-10=", "answer": "-7", "task": "arithmetic"}
    assert ArithmeticTask.verify("-7", neg) == 1.0
    assert ArithmeticTask.verify("7", neg) == 0.0


def test_countdown_verify_cases():
    row = {"prompt": "3 5 7 -> 22:", "numbers": [3, 5, 7], "target": 22, "task": "countdown"}
    assert CountdownTask.verify("3*5+7", row) == 1.0
    assert CountdownTask.verify(" (7*3)+5-5+1 ", row) == 0.0  # 5 used twice, 1 not given
    assert CountdownTask.verify("7*3+5", row) == 0.0  # value 26
    assert CountdownTask.verify("5*5-3", row) == 0.0  # 5 used twice although 22 is right
    assert CountdownTask.verify("(3+5)*7-34", row) == 0.0
    for bad in ["", "3*5+", "3 5 7", "22", "__import__('os')", "__import__('os').system('true')",
                "x+1", "3**5", "15//3+7", "-3+25", "0x3*5+7", "3*5+7=22", "(" * 300 + "3" + ")" * 300]:
        assert CountdownTask.verify(bad, row) == 0.0, bad
    dup = {"numbers": [4, 4, 2], "target": 18}
    assert CountdownTask.verify("4*4+2", dup) == 1.0  # two 4s given, two used


def test_eval_countdown_expr_rejects_code():
    assert eval_countdown_expr("__import__('os')") is None
    assert eval_countdown_expr("(lambda: 1)()") is None
    assert eval_countdown_expr("(2+3)*4") == (20, [2, 3, 4])


def test_verify_row_dispatch():
    assert verify_row("5", {"prompt": "2+3=", "answer": "5", "task": "arithmetic"}) == 1.0
    assert verify_row("5", {"prompt": "2+3=", "answer": "5"}) is None
    assert verify_row("5", {"prompt": "2+3=", "answer": "5", "task": "no_such_task"}) is None
    assert verify_row("5", {"prompt": "x", "task": "os:system"}) is None  # no import from data


# ------------------------------------------------------------------------------------------ procedural tasks


@pytest.mark.parametrize(
    "task",
    [
        ArithmeticTask(digits=3, ops="+-*"),
        CountdownTask(),
        CountdownTask(numbers=4, max_number=20, min_target=10, max_target=200),
    ],
    ids=["arithmetic", "countdown3", "countdown4"],
)
def test_train_rows_deterministic_and_solutions_verify(task):
    a = task.train_rows(3, 16, seed=7)
    assert a == task.train_rows(3, 16, seed=7)
    assert a != task.train_rows(4, 16, seed=7)
    assert a != task.train_rows(3, 16, seed=8)
    rows = [r for step in range(50) for r in task.train_rows(step, 40, seed=0)]
    for r in rows:
        assert r["task"] == task.name
        assert task.verify(r["solution"], r) == 1.0, r
        assert verify_row(r["solution"], r) == 1.0


def test_arithmetic_operand_digits():
    task = ArithmeticTask(digits=3, min_digits=3, ops="+")
    for r in task.train_rows(0, 100, seed=1):
        a, b = r["prompt"][:-1].split("+")
        assert len(a) == 3 and len(b) == 3
        assert int(r["answer"]) == int(a) + int(b)


def test_countdown_targets_in_range():
    task = CountdownTask(numbers=3, max_number=9, min_target=10, max_target=50)
    for r in task.train_rows(0, 200, seed=0):
        assert 10 <= r["target"] <= 50
        assert r["prompt"] == " ".join(map(str, r["numbers"])) + f" -> {r['target']}:"


@pytest.mark.parametrize("task", [ArithmeticTask(digits=2, ops="+-"), CountdownTask()], ids=["arith", "countdown"])
def test_held_out_disjoint(task):
    train = {r["prompt"] for step in range(100) for r in task.train_rows(step, 30, seed=step % 3)}
    ev = task.eval_rows(200, seed=0)
    prompts = [r["prompt"] for r in ev]
    assert len(prompts) == len(set(prompts)) > 50  # deduplicated
    assert all(is_held_out(p) for p in prompts)
    assert not train & set(prompts)
    assert ev == task.eval_rows(200, seed=0)
    for r in ev:
        assert task.verify(r["solution"], r) == 1.0


def test_eval_rows_small_space_returns_what_exists():
    task = ArithmeticTask(digits=1, ops="+")  # 100 problems, ~10 held out
    ev = task.eval_rows(1000, seed=0)
    assert 0 < len(ev) < 30


def test_task_param_validation():
    # refused when the task is loaded from its config (annotations and the registered checks), in one line
    cases = [({"name": "arithmetic", "ops": "/"}, "task.ops: expected a non-empty string of '+', '-', '*', got '/'"),
             ({"name": "arithmetic", "ops": ""}, "task.ops: expected a non-empty string"),
             ({"name": "arithmetic", "digits": 0}, "task.digits: expected a value >= 1 and <= 1000, got 0"),
             ({"name": "arithmetic", "digits": 2.0}, "task.digits: expected an integer, got 2.0"),
             ({"name": "arithmetic", "digits": 2, "min_digits": 3}, "task.min_digits: expected a value <= digits (2)"),
             ({"name": "arithmetic", "min_digits": 3}, "task.min_digits: expected a value <= digits (2), got 3"),
             ({"name": "countdown", "min_target": 50, "max_target": 10},
              "task.max_target: expected a value >= min_target (50), got 10"),
             ({"name": "countdown", "numbers": 1}, "task.numbers: expected a value >= 2, got 1"),
             ({"name": "reasoning_gym", "dataset": "x", "config": {"seed": 1}},
              "task.config: set 'seed' as a task parameter, not inside config"),
             ({"name": "reasoning_gym", "dataset": "x", "size": 0}, "task.size: expected a value >= 1, got 0"),
             ({"name": "file", "path": "x.jsonl", "eval_fraction": 1.0},
              "task.eval_fraction: expected a value >= 0 and < 1, got 1.0"),
             ({"name": "file", "path": "x.jsonl", "verifier": "file"},
              "task.verifier: 'file' is a data source, not a task with a verifier")]
    for spec, message in cases:
        with pytest.raises(ConfigError) as e:
            load_source(spec)
        assert str(e.value).startswith(message), str(e.value)


# ------------------------------------------------------------------------------------------ load_source


def test_load_source_registered_and_errors():
    src = load_source({"name": "arithmetic", "digits": 3})
    assert isinstance(src, ArithmeticTask) and src.digits == 3
    with pytest.raises(ConfigError) as e:
        load_source({"name": "arithmetc"})
    msg = str(e.value)
    assert "arithmetc" in msg and "arithmetic" in msg and "countdown" in msg and "\n" not in msg
    with pytest.raises(ConfigError) as e:
        load_source({"name": "countdown", "numbrs": 4})
    assert "numbrs" in str(e.value) and "numbers" in str(e.value)
    with pytest.raises(ConfigError, match="name"):
        load_source({"digits": 3})


# ------------------------------------------------------------------------------------------ file sources


def _records(n):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": i} for i in range(n)]


def _write(path, rows):
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_file_source_epochs(tmp_path, suffix):
    path = _write(tmp_path / f"data{suffix}", _records(50))
    src = FileSource(path=str(path), verifier="arithmetic")
    ev = src.eval_rows(100, seed=0)
    assert len(ev) == 5
    train_ids = [r["id"] for r in src.train_rows(0, 45, seed=3)]
    assert len(train_ids) == len(set(train_ids)) == 45
    assert not {r["id"] for r in ev} & set(train_ids)
    assert {str(r["id"]) for r in ev} | {str(i) for i in train_ids} == {str(i) for i in range(50)}
    # steps of 9 rows walk through epoch 0 then epoch 1, each a full permutation of the 45 train rows
    walked = [r["id"] for step in range(10) for r in src.train_rows(step, 9, seed=3)]
    assert walked[:45] == train_ids
    assert sorted(walked[45:], key=str) == sorted(train_ids, key=str)
    assert walked[45:] != train_ids  # a new permutation per epoch
    assert src.train_rows(4, 9, seed=3) == src.train_rows(4, 9, seed=3)
    assert src.train_rows(0, 9, seed=4) != src.train_rows(0, 9, seed=3)
    r = src.train_rows(0, 1, seed=0)[0]
    assert r["task"] == "arithmetic"
    assert src.verify(r["answer"], r) == 1.0 and verify_row(r["answer"], r) == 1.0
    assert verify_row("nope", r) == 0.0


def test_file_source_columns_and_eval_path(tmp_path):
    path = _write(tmp_path / "train.jsonl", [{"q": f"p{i}", "answer": str(i), "extra": 1} for i in range(10)])
    evp = _write(tmp_path / "eval.jsonl", [{"q": "e0", "answer": "0", "extra": 1}])
    src = load_source({"name": "file", "path": str(path), "prompt_column": "q", "columns": ["answer"],
                       "eval_path": str(evp)})
    rows = src.train_rows(0, 10, seed=0)
    assert {r["prompt"] for r in rows} == {f"p{i}" for i in range(10)}
    assert set(rows[0]) == {"prompt", "answer"}
    assert src.eval_rows(5, seed=0) == [{"prompt": "e0", "answer": "0"}]
    assert src.verify("0", rows[0]) is None  # no verifier


def test_file_source_errors(tmp_path):
    with pytest.raises(DataError, match="missing.jsonl.*not found"):
        FileSource(path=str(tmp_path / "missing.jsonl"))
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(DataError) as e:
        FileSource(path=str(bad))
    msg = str(e.value)
    assert "bad.jsonl" in msg and "row 2" in msg and "'prompt'" in msg and "\n" not in msg
    nocol = _write(tmp_path / "nocol.csv", [{"prompt": "a", "x": "1"}])
    with pytest.raises(DataError) as e:
        FileSource(path=str(nocol), columns=["answer"])
    msg = str(e.value)
    assert "nocol.csv" in msg and "row 1" in msg and "'answer'" in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl.*no rows"):
        FileSource(path=str(empty))
    notjson = tmp_path / "broken.jsonl"
    notjson.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match="broken.jsonl: line 2"):
        FileSource(path=str(notjson))
    with pytest.raises(DataError, match="unsupported"):
        FileSource(path=str(_write(tmp_path / "x.jsonl", _records(2)).rename(tmp_path / "x.txt")))
    with pytest.raises(ConfigError, match=r"^task.verifier: unknown task 'arithmetc'; valid: .*arithmetic"):
        load_source({"name": "file", "path": str(_write(tmp_path / "ok.jsonl", _records(3))), "verifier": "arithmetc"})


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = _write(tmp_path / "d.parquet", _records(3))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"d.parquet.*postrl\[data\]"):
        FileSource(path=str(path))


def test_dataset_source_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(_records(20))
    ds.save_to_disk(str(tmp_path / "ds"))
    src = load_source({"name": "dataset", "name_or_path": str(tmp_path / "ds"), "verifier": "arithmetic"})
    assert len(src.eval_rows(10, seed=0)) == 2
    rows = src.train_rows(0, 18, seed=0)
    assert len({r["id"] for r in rows}) == 18
    assert all(src.verify(r["answer"], r) == 1.0 for r in rows)
    with pytest.raises(DataError, match="split 'test'"):
        datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
        load_source({"name": "dataset", "name_or_path": str(tmp_path / "dd"), "split": "test"})


# ------------------------------------------------------------------------------------------ reasoning-gym


def test_reasoning_gym_source():
    pytest.importorskip("reasoning_gym")
    src = load_source({"name": "reasoning_gym", "dataset": "basic_arithmetic", "size": 60})
    rows = src.train_rows(0, 8, seed=0)
    assert rows == src.train_rows(0, 8, seed=0)
    for r in rows:
        assert r["task"] == "reasoning_gym" and r["rg_dataset"] == "basic_arithmetic"
        assert src.verify(r["answer"], r) == 1.0
        assert verify_row(" " + r["answer"] + "\n", r) == 1.0
        assert src.verify("definitely wrong", r) == 0.0
        assert src.verify(str(int(r["answer"]) + 1), r) == 0.0
    train = {r["prompt"] for step in range(10) for r in src.train_rows(step, 6, seed=0)}
    ev = src.eval_rows(100, seed=0)
    assert not train & {r["prompt"] for r in ev}


def test_reasoning_gym_unknown_dataset():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(DataError) as e:
        load_source({"name": "reasoning_gym", "dataset": "no_such_dataset"})
    assert "no_such_dataset" in str(e.value) and "basic_arithmetic" in str(e.value)


def test_reasoning_gym_entry_json_round_trip():
    from postrl.data.reasoning_gym import entry_from_json, entry_to_json

    entry = {"question": "q", "answer": "a", "metadata": {"output": ((1, 2), (3, 4)), "s": {5}, "m": {1: "x"},
                                                          "l": [1, (2,)], "n": None}}
    text = entry_to_json(entry)
    assert isinstance(text, str) and entry_from_json(text) == entry


def test_arithmetic_chatty_teacher_changes_only_the_demonstrations():
    from postrl.data import ArithmeticTask

    plain = ArithmeticTask(digits=2).train_rows(0, 400, seed=1)
    chatty = ArithmeticTask(digits=2, chatty=0.6).train_rows(0, 400, seed=1)
    verbose = [r for r in chatty if r["solution"].endswith(", I think")]
    assert 0.5 < len(verbose) / len(chatty) < 0.7  # about the requested fraction
    for r in chatty:  # the answer and the verifier are unchanged: the chatty demonstration itself scores 0
        assert r["solution"] in (r["answer"], f"{r['answer']}, I think")
        assert ArithmeticTask.verify(r["answer"], r) == 1.0
        assert ArithmeticTask.verify(r["solution"], r) == (1.0 if r["solution"] == r["answer"] else 0.0)
    assert all(r["solution"] == r["answer"] for r in plain)
    with pytest.raises(ConfigError, match=r"^task.chatty: expected a value >= 0 and <= 1, got 1.5$"):
        load_source({"name": "arithmetic", "chatty": 1.5})
