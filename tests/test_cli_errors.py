"""Hostile inputs to the command line: each is one ``postrl: error: ...`` line and exit status 2, never a traceback
(issue 26, round 3). The inputs that reached a Python exception before (UnicodeDecodeError, RecursionError,
ValueError from the int-string limit or the RNG, FileExistsError, TypeError from a missing task parameter or the
tokenizer) and the ones accepted silently (a learning rate that makes NaN, a weight of -1e308, an empty stop
string, a model path that is a file, eval counts of 0, a reward-model lr of inf, negative margins under --margin).

Most cases run ``postrl.cli.main`` in this process (an exception would fail the test as a traceback would); a
few run the real command in a subprocess to show the console output itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import postrl
from postrl.cli import main
from postrl.config import load_config

SRC = Path(postrl.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The hostile files, and a nano model folder, in one folder."""
    d = tmp_path_factory.mktemp("hostile")
    (d / "latin1.yaml").write_bytes("optim:\n  lr: 1.0e-5\n# caf\u00e9 au lait\n".encode("latin-1"))
    (d / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "bigint.yaml").write_text("seed: " + "9" * 5000 + "\n")
    (d / "binary.jsonl").write_bytes(b"\x00\x01\xff\xfe\x80binary")
    (d / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    (d / "latin1.csv").write_bytes("prompt,answer\ncaf\u00e9,1\n".encode("latin-1"))
    (d / "surrogate.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "x\\ud800y", "answer": "1"}\n')
    (d / "empty.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "", "answer": "1"}\n')
    (d / "pairs.bin.jsonl").write_bytes(b"\xff\xfe{\x00\"\x00p\x00")
    (d / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "x", "rejected": "y", "margin": 1}\n'
                                   '{"prompt": "b", "chosen": "x", "rejected": "z", "margin": -2}\n')
    from postrl.models.tiny import build_local

    build_local(d / "nano", size="nano")
    return d


def _cases() -> list[tuple[str, list[str], str]]:
    """(id, argv with {d} for the files folder, regex the one error line must match after 'postrl: error: ')."""
    t = ["train", "--quiet", "output_dir={d}/run"]
    return [
        # section 1: tracebacks before
        ("digits", [*t, "task.digits=100000"], r"task\.digits: expected a value >= 1 and <= 1000, got 100000"),
        ("yaml-int-5000-digits", [*t[:2], "{d}/bigint.yaml"], r"config file '.*bigint\.yaml': an integer with more "
         r"than 4300 digits"),
        ("override-int-5000-digits", [*t, "seed=" + "9" * 5000], r"override seed: an integer with more than 4300"),
        ("seed-overflow", [*t, "seed=100000000000000000000000"], r"seed: input should be less than or equal to "
         r"9223372036854775807 \(got 100000000000000000000000\)"),
        ("output-dev-null", ["train", "--quiet", "output_dir=/dev/null"], r"output_dir '/dev/null' is a file, not a "
         r"folder"),
        ("output-proc-mem", ["train", "--quiet", "output_dir=/proc/self/mem"], r"output_dir '/proc/self/mem' is a "
         r"file"),
        ("yaml-latin1", ["config", "show", "{d}/latin1.yaml"], r"config file '.*latin1\.yaml': not UTF-8 text "
         r"\(byte 0xe9 at offset \d+\); save it as UTF-8"),
        ("yaml-deep", ["config", "show", "{d}/deep.yaml"], r"config file '.*deep\.yaml': nested too deeply"),
        ("prompts-binary", [*t, "task={{name: file, path: {d}/binary.jsonl}}"], r".*binary\.jsonl: not UTF-8 text "
         r"\(byte 0xff at offset 2\)"),
        ("prompts-latin1-jsonl", [*t, "task={{name: file, path: {d}/latin1.jsonl}}"], r".*latin1\.jsonl: not UTF-8"),
        ("prompts-latin1-csv", [*t, "task={{name: file, path: {d}/latin1.csv}}"], r".*latin1\.csv: not UTF-8"),
        ("prompt-surrogate", [*t, "task={{name: file, path: {d}/surrogate.jsonl}}"], r".*surrogate\.jsonl: row 2 "
         r"column 'prompt' holds \\ud800 at character 1, a lone surrogate"),
        ("prompt-empty", [*t, "task={{name: file, path: {d}/empty.jsonl}}"], r".*empty\.jsonl: row 2 column "
         r"'prompt' is empty"),
        ("rm-binary-pairs", ["rm", "train", "{d}/pairs.bin.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm"],
         r".*pairs\.bin\.jsonl: not UTF-8 text"),
        ("train-file-no-path", [*t, "task.name=file"], r"task\.path: required parameter missing"),
        ("eval-file-no-path", ["eval", "{d}/nano", "--task", "file"], r"task\.path: required parameter missing"),
        ("eval-max-new-tokens-neg", ["eval", "{d}/nano", "--max-new-tokens", "-5"], r"--max-new-tokens must be an "
         r"integer >= 1 and <= 131072, got -5"),
        # section 2: accepted silently before
        ("lr-1e308", [*t, "optim.lr=1e308"], r"optim\.lr: 1e\+308 is above 1 "),
        ("sft-lr", [*t, "sft.lr=2"], r"sft\.lr: 2 is above 1 "),
        ("weight-neg-1e308", [*t, "rewards.0.weight=-1e308"], r"rewards\.0\.weight: -1e\+308 is outside "
         r"\[-1e\+06, 1e\+06\]"),
        ("reward-weights-list", [*t, "reward.weights=[1, 1e7]"], r"reward\.weights\.1: 1e\+07 is outside"),
        ("stop-empty", [*t, "rollout.stop=['']"], r"rollout\.stop: an empty stop string ends every completion"),
        ("model-nonexistent", ["config", "show", "model.path=/nonexistent"], r"model\.path '/nonexistent': no such "
         r"folder"),
        ("model-etc", ["config", "show", "model.path=/etc"], r"model\.path '/etc': no config\.json in it"),
        ("model-etc-passwd", ["config", "show", "model.path=/etc/passwd"], r"model\.path '/etc/passwd': a file, not "
         r"a folder"),
        ("eval-n-0", ["eval", "{d}/nano", "--n", "0"], r"--n must be an integer >= 1 .*, got 0"),
        ("eval-n-neg", ["eval", "{d}/nano", "--n", "-3"], r"--n must be an integer >= 1 .*, got -3"),
        ("eval-k-0", ["eval", "{d}/nano", "--k", "0"], r"--k must be an integer >= 1 .*, got 0"),
        ("eval-k-neg", ["eval", "{d}/nano", "--k", "-1"], r"--k must be an integer >= 1 .*, got -1"),
        ("eval-max-new-tokens-0", ["eval", "{d}/nano", "--max-new-tokens", "0"], r"--max-new-tokens must be .*got 0"),
        ("rm-lr-inf", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm", "--lr", "inf"],
         r"rm train: lr must be a finite number in \(0, 1\], got inf"),
        ("rm-max-length-0", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm",
                             "--max-length", "0"], r"--max-length must be an integer >= 1, got 0"),
        ("rm-weight-decay-neg", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm",
                                 "--weight-decay", "-1"], r"rm train: weight_decay must be a finite number >= 0"),
        ("rm-negative-margin", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm",
                                "--margin", "--eval-fraction", "0"], r".*pairs\.jsonl: row 2: field 'margin' is -2; "
         r"the margin loss \(--margin\) needs a preference strength >= 0"),
        ("rm-beta-min-above-max", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm",
                                   "--rationality", "judged", "--beta-min", "2"],
         r"rm train: expected 0 <= beta_min <= beta_max and beta_max > 0, got beta_min=2.0, beta_max=1.0"),
        ("rm-beta-max-inf", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm",
                             "--rationality", "judged", "--beta-max", "inf"], r"rm train: expected 0 <= beta_min"),
        ("rm-judge-timeout-0", ["rm", "train", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm",
                                "--rationality", "judged", "--bias-judge", "x:y", "--bias-judge-timeout", "0"],
         r"--bias-judge-timeout must be .*> 0.*, got 0"),
        ("prm-max-length-0", ["prm", "train", "--records", "{d}/pairs.jsonl", "--backbone", "tiny:nano", "--out",
                              "{d}/prm", "--max-length", "0"], r"--max-length must be an integer >= 1, got 0"),
    ]


CASES = _cases()


@pytest.mark.parametrize("argv, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_is_one_error_line(files, capsys, monkeypatch, argv, pattern):
    monkeypatch.chdir(files)
    args = [a.format(d=files) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("postrl: error: "), err
    assert re.match(pattern, lines[0][len("postrl: error: "):]), lines[0]
    assert len(lines[0]) < 400  # one readable line, not the 5000-digit value


@pytest.mark.parametrize("argv", [
    ["config", "show", "{d}/latin1.yaml"],
    ["train", "--quiet", "task.digits=100000"],
    ["train", "--quiet", "output_dir=/dev/null"],
    ["rm", "train", "{d}/pairs.bin.jsonl", "--backbone", "tiny:nano", "--out", "{d}/rm"],
], ids=["latin1-yaml", "digits", "dev-null", "rm-binary"])
def test_the_console_shows_one_line_and_no_traceback(files, argv):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(SRC)
    r = subprocess.run([sys.executable, "-m", "postrl", *[a.format(d=files) for a in argv]], capture_output=True,
                       text=True, env=env, cwd=files, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("postrl: error: "), r.stderr


@pytest.mark.parametrize("overrides, check", [
    (["optim.lr=1"], lambda c: c.optim.lr == 1.0),
    (["rewards.0.weight=-1000000"], lambda c: c.rewards[0].weight == -1e6),
    (["reward.weights=[1, 0]", "rewards=[{name: correct}, {name: format}]"], lambda c: c.reward.weights == [1.0, 0.0]),
    (['rollout.stop=["\\n", "."]'], lambda c: c.rollout.stop == ["\n", "."]),
    ([f"seed={2**63 - 1}"], lambda c: c.seed == 2**63 - 1),
    (["task.digits=1000"], lambda c: c.task.params["digits"] == 1000),
], ids=["lr-1", "weight-1e6", "weight-0", "stop", "seed-max", "digits-1000"])
def test_the_bounds_themselves_are_accepted(overrides, check):
    assert check(load_config(None, overrides))


def test_conversational_prompts_are_rows_and_bad_messages_one_line(tmp_path):
    """A prompt may be TRL's conversational format (a list of {role, content}); a malformed one names the row."""
    from postrl.data import load_source
    from postrl.errors import DataError

    f = tmp_path / "chat.jsonl"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    f.write_text(json.dumps({"prompt": msgs, "answer": "4"}) + "\n" + json.dumps({"prompt": "3+3=", "answer": "6"})
                 + "\n")
    src = load_source({"name": "file", "path": str(f), "eval_fraction": 0})
    assert sorted(map(str, (r["prompt"] for r in src.train_rows(0, 2, 0)))) == sorted([str(msgs), "3+3="])
    f.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "4"}) + "\n")
    with pytest.raises(DataError, match=r"row 1 column 'prompt': message 0 needs a string 'role' and a string "
                                        r"'content'"):
        load_source({"name": "file", "path": str(f)})


def test_a_conversation_needs_a_chat_template_and_an_empty_encoding_is_one_line():
    from postrl.errors import PostrlError
    from postrl.generation import encode_prompt
    from postrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    with pytest.raises(PostrlError, match="a conversational prompt .* needs a chat template, but the tokenizer has "
                                          "no chat template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert encode_prompt(tok, [{"role": "user", "content": "hi"}]) == encode_prompt(tok, "hi", "none")
    with pytest.raises(PostrlError, match="needs a chat template, but model.chat_template is none"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}], "none")
    assert encode_prompt(tok, "", "none") == []  # an empty text asked for on purpose (reward models) stays empty
