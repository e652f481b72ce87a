"""Helper generation processes (``rollout.processes``, postrl.accel.helpers): the rows of one process, the
optimizer's in-place updates seen through shared memory, errors as one line, the trainer's use and shutdown, no
re-run of a script without a main guard, and the libgomp spin setting of the postrl command."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from postrl.rollout.base import SamplingParams
from postrl.rollout.hf import HFGenerator
from test_rollout import PROMPTS, _ids, eos_model, model, tok  # noqa: F401 - the fixtures

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def pair(tok, eos_model):
    """(a generator with one helper process, started; a one-process generator on a copy of the same weights)."""
    two = HFGenerator(eos_model, tok, threads=1, processes=2)
    assert two.start_helpers(wait=120.0)
    yield two, HFGenerator(copy.deepcopy(eos_model), tok, threads=1)
    two.close()


def _same(a, b):
    for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert a.texts == b.texts
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)  # (float rounding of smaller batches)


def test_helper_generates_the_rows_of_one_process(tok, pair):
    two, one = pair
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop=["="])
    prompts = _ids(tok, PROMPTS)  # different lengths: the parts' prompt widths differ
    seeds = [11, 12, 13, 14]
    out = two.generate(prompts, 3, params, seeds)
    assert two.last_processes == 2
    ref = one.generate(prompts, 3, params, seeds)
    assert ref.completion_mask.sum(-1).unique().numel() > 2  # rows of several lengths (EOS, stop), both parts
    _same(out, ref)
    # one seed for all prompts: the noise is drawn for all rows at once, so no split
    _same(two.generate(prompts, 2, params, 5), one.generate(prompts, 2, params, 5))
    assert two.last_processes == 1
    # the training process's EOS list reaches the helper (the benchmark empties it: every row runs to the limit)
    two.eos_ids, one.eos_ids = [], []
    try:
        out = two.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0), seeds)
        assert (out.completion_mask.sum(-1) == 12).all()
        _same(out, one.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0), seeds))
    finally:
        two.eos_ids, one.eos_ids = list(one._eos_ids(one.model, tok)), list(one._eos_ids(one.model, tok))


def test_helper_sees_the_in_place_updates(tok, pair):
    two, one = pair
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    prompts = _ids(tok, PROMPTS[:2])
    before = two.generate(prompts, 4, params, [1, 2])
    with torch.no_grad():  # as an optimizer step does: the same tensors, new values
        for a, b in zip(two.model.parameters(), one.model.parameters()):
            a.mul_(1.5)
            b.mul_(1.5)
    after = two.generate(prompts, 4, params, [1, 2])
    assert two.last_processes == 2 and not torch.allclose(after.logprobs[4:], before.logprobs[4:])
    _same(after, one.generate(prompts, 4, params, [1, 2]))


def test_a_failure_here_leaves_the_helper_in_step(tok, pair, monkeypatch):
    """This process's part raises: the error comes through, the helper's reply is read anyway, and the next
    generation gets its own rows (not the stale reply of the failed one)."""
    two, one = pair
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    prompts = _ids(tok, PROMPTS[:2])
    real = HFGenerator._generate

    def fail_once(self, *a, **k):
        monkeypatch.setattr(HFGenerator, "_generate", real)
        raise KeyError("boom")

    monkeypatch.setattr(HFGenerator, "_generate", fail_once)
    with pytest.raises(KeyError, match="boom"):
        two.generate(prompts, 2, params, [7, 8])
    _same(two.generate(prompts, 2, params, [3, 4]), one.generate(prompts, 2, params, [3, 4]))
    assert two.last_processes == 2


def test_a_dead_helper_is_a_one_line_error(tok, eos_model):
    gen = HFGenerator(copy.deepcopy(eos_model), tok, threads=1, processes=2)
    assert gen.start_helpers(wait=120.0)
    gen.helpers.procs[0].kill()
    gen.helpers.procs[0].join()
    with pytest.raises(RuntimeError, match=r"^generation helper process 1 exited \(exit code -9\); "
                                           r"rollout.processes=1 generates in the training process only$"):
        gen.generate(_ids(tok, PROMPTS[:2]), 2, SamplingParams(max_new_tokens=4), [1, 2])
    gen.close()
    with pytest.raises(ValueError, match="processes must be >= 1"):
        HFGenerator(eos_model, tok, processes=0)


def test_trainer_generates_with_a_helper_and_stops_it(tmp_path):
    from postrl.config import load_config
    from postrl.models.tiny import build_local
    from postrl.train.trainer import Trainer
    from test_train import small

    build_local(tmp_path / "model", size="nano", seed=0)
    cfg = load_config(None, small(tmp_path / "model", tmp_path / "run", "train.steps=2", "train.save_every=0",
                                  "rollout.processes=2"))
    t = Trainer(cfg, cfg.output_dir)
    assert t.backend.start_helpers(wait=120.0)
    procs = list(t.backend.helpers.procs)
    m = t.train_step(0)
    assert t.backend.last_processes == 2 and m["length/mean"] > 0  # a step's prompts have a seed each: split
    t.train()
    assert not any(p.is_alive() for p in procs)  # train() stops its helpers


def test_a_script_without_a_main_guard_is_not_run_again(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        print("TOP-LEVEL RAN", flush=True)
        from postrl.models.tiny import build_model, build_tokenizer
        from postrl.rollout.base import SamplingParams
        from postrl.rollout.hf import HFGenerator
        tok = build_tokenizer()
        gen = HFGenerator(build_model(tok, size="nano", seed=0), tok, threads=1, processes=2)
        assert gen.start_helpers(wait=120.0)
        out = gen.generate([tok.encode("1+1="), tok.encode("2+2=")], 2, SamplingParams(max_new_tokens=3), [1, 2])
        print("PROCESSES", gen.last_processes, len(out.texts), flush=True)
        gen.close()
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("TOP-LEVEL RAN") == 1 and "PROCESSES 2 4" in r.stdout


@pytest.mark.parametrize("env, pre_import, want", [({}, "", "True 10000"), ({"GOMP_SPINCOUNT": "5"}, "", "False 5"),
                                                   ({}, "import torch; ", "False None")],
                         ids=["unset", "user-set", "torch-loaded"])
def test_postrl_command_quiets_openmp_spin_before_torch_loads(env, pre_import, want):
    code = f"{pre_import}import os; from postrl.cli import quiet_openmp_spin; " \
           f"print(quiet_openmp_spin(), os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**base, **env, "PYTHONPATH": SRC})
    assert r.stdout.strip() == want, r.stderr
