"""Atomic, resumable checkpoints: round trips, HF compatibility, pruning and crash safety."""

from __future__ import annotations

import json
import os
import random
import subprocess

import numpy as np
import pytest
import torch

from postrl.errors import PostrlError
from postrl.models.tiny import build_model, build_tokenizer
from postrl.train import checkpoint as ckpt_mod
from postrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _setup(tok, seed=0):
    model = build_model(tok, size="nano", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _batch(tok, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, len(tok), (2, 12), generator=g)


def _train_step(model, opt, sched, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path, tok):
    model, opt, sched = _setup(tok)
    for i in range(3):
        _train_step(model, opt, sched, _batch(tok, i))
    path = save_checkpoint(tmp_path, 3, model, tok, opt, sched, {"episodes": 7, "metrics": {"reward": 0.5}})
    assert path == tmp_path / "checkpoints" / "step-00000003"
    saved = _params(model)
    expected_draws = (torch.rand(4), random.random(), np.random.rand(3))
    _train_step(model, opt, sched, _batch(tok, 99))  # continue without save/restore
    continued = _params(model)

    other, opt2, sched2 = _setup(tok, seed=1)
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    state = load_checkpoint(path, other, opt2, sched2)
    assert state == {"episodes": 7, "metrics": {"reward": 0.5}, "step": 3}

    for k, v in other.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == pytest.approx([1e-2 / 4])
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)

    draws = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(draws[0], expected_draws[0])
    assert draws[1] == expected_draws[1]
    assert np.array_equal(draws[2], expected_draws[2])

    _train_step(other, opt2, sched2, _batch(tok, 99))
    for k, v in other.state_dict().items():
        assert torch.equal(v, continued[k]), k


def test_restore_rng_false_leaves_rng_alone(tmp_path, tok):
    model, opt, sched = _setup(tok)
    path = save_checkpoint(tmp_path, 1, model, tok, opt, sched, {})
    other = build_model(tok, size="nano", seed=2)  # (build_model seeds torch itself)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    load_checkpoint(path, other, restore_rng=False)
    assert torch.equal(torch.rand(3), expected)


def test_folder_loads_with_from_pretrained(tmp_path, tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, opt, sched = _setup(tok)
    _train_step(model, opt, sched, _batch(tok, 0))
    path = save_checkpoint(tmp_path, 1, model, tok, opt, sched, {})
    assert (path / "model.safetensors").is_file()

    hf_model = AutoModelForCausalLM.from_pretrained(path)
    hf_tok = AutoTokenizer.from_pretrained(path)
    text = "12+30=42"
    ids = hf_tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == tok(text, return_tensors="pt").input_ids.tolist()
    model.eval(), hf_model.eval()
    with torch.no_grad():
        assert torch.equal(hf_model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_keep_last_prunes_older_checkpoints(tmp_path, tok):
    model, opt, sched = _setup(tok)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, tok, opt, sched, {"n": step}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path) == root / "step-00000004"

    # The checkpoint just written is always kept, even if it is not the highest step.
    save_checkpoint(tmp_path, 2, model, tok, opt, sched, {"n": 2}, keep_last=2)
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000004"]

    save_checkpoint(tmp_path, 5, model, tok, opt, sched, {}, keep_last=None)
    assert len(os.listdir(root)) == 3
    with pytest.raises(PostrlError, match="keep_last"):
        save_checkpoint(tmp_path, 6, model, tok, opt, sched, {}, keep_last=0)
    assert latest_checkpoint(tmp_path) == root / "step-00000005"


def test_resave_same_step_replaces_atomically(tmp_path, tok, monkeypatch):
    model, opt, sched = _setup(tok)
    save_checkpoint(tmp_path, 5, model, tok, opt, sched, {"v": 1})
    save_checkpoint(tmp_path, 5, model, tok, opt, sched, {"v": 2})
    root = tmp_path / "checkpoints"
    assert os.listdir(root) == ["step-00000005"]
    assert json.loads((root / "step-00000005" / "trainer_state.json").read_text())["v"] == 2

    # Fallback where renameat2(RENAME_EXCHANGE) is unavailable: rename aside, then into place.
    monkeypatch.setattr(ckpt_mod, "_rename_exchange", lambda a, b: False)
    save_checkpoint(tmp_path, 5, model, tok, opt, sched, {"v": 3})
    assert os.listdir(root) == ["step-00000005"]
    assert json.loads((root / "step-00000005" / "trainer_state.json").read_text())["v"] == 3


def test_crash_between_aside_and_rename_is_recovered(tmp_path, tok):
    model, opt, sched = _setup(tok)
    path = save_checkpoint(tmp_path, 5, model, tok, opt, sched, {"v": 1})
    # A process died right after renaming the old step-5 aside (fallback path of a same-step re-save).
    os.rename(path, path.with_name(f".step-00000005.old-{_dead_pid()}"))
    assert latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path, model)["v"] == 1


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path, tok):
    model, opt, sched = _setup(tok)
    prev = save_checkpoint(tmp_path, 8, model, tok, opt, sched, {})
    # What a process killed mid-save leaves behind: a temporary folder with partial files.
    tmp = tmp_path / "checkpoints" / f".step-00000009.tmp-{_dead_pid()}"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    (tmp / "model.safetensors").write_bytes(b"\x00" * 10)
    (tmp / "trainer_state.json").write_text('{"step": 9}')
    assert latest_checkpoint(tmp_path) == prev

    save_checkpoint(tmp_path, 10, model, tok, opt, sched, {})
    assert not tmp.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000010"


def test_tmp_dir_of_live_writer_is_kept(tmp_path, tok):
    model, opt, sched = _setup(tok)
    save_checkpoint(tmp_path, 1, model, tok, opt, sched, {})
    parent = os.getppid()  # alive: stands in for another process in the middle of a save
    tmp = tmp_path / "checkpoints" / f".step-00000002.tmp-{parent}"
    tmp.mkdir()
    save_checkpoint(tmp_path, 3, model, tok, opt, sched, {})
    assert tmp.exists()


def test_failure_mid_save_leaves_previous_checkpoint(tmp_path, tok, monkeypatch):
    model, opt, sched = _setup(tok)
    prev = save_checkpoint(tmp_path, 1, model, tok, opt, sched, {"v": 1})
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        if str(f).endswith("scheduler.pt"):
            real_save(obj, f, *a, **kw)  # partially written file
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 2, model, tok, opt, sched, {"v": 2}, keep_last=1)
    monkeypatch.undo()

    assert os.listdir(tmp_path / "checkpoints") == ["step-00000001"]
    assert latest_checkpoint(tmp_path) == prev
    assert load_checkpoint(prev, model, opt, sched)["v"] == 1


def test_bad_state_fails_before_writing(tmp_path, tok):
    model, opt, sched = _setup(tok)
    with pytest.raises(PostrlError, match="JSON"):
        save_checkpoint(tmp_path, 1, model, tok, opt, sched, {"t": torch.zeros(1)})
    assert latest_checkpoint(tmp_path) is None
    assert not (tmp_path / "checkpoints").exists()


def test_incomplete_checkpoint_raises_postrl_error(tmp_path, tok):
    model, opt, sched = _setup(tok)
    path = save_checkpoint(tmp_path, 1, model, tok, opt, sched, {})

    with pytest.raises(PostrlError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", model)

    (path / "optimizer.pt").unlink()
    with pytest.raises(PostrlError, match="optimizer.pt") as info:
        load_checkpoint(path, model, opt)
    assert str(path) in str(info.value)
    load_checkpoint(path, model)  # optimizer not asked for: fine

    (path / "trainer_state.json").unlink()
    assert latest_checkpoint(tmp_path) is None  # no longer counts as complete
    with pytest.raises(PostrlError, match="trainer_state.json") as info:
        load_checkpoint(path, model)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_mismatched_model_raises_postrl_error(tmp_path, tok):
    model, opt, sched = _setup(tok)
    path = save_checkpoint(tmp_path, 1, model, tok, None, None, {})
    with pytest.raises(PostrlError, match="does not"):
        load_checkpoint(path, build_model(tok, size="tiny"))


def test_sharded_weights_round_trip(tmp_path, tok, monkeypatch):
    model, _, _ = _setup(tok)
    orig = model.save_pretrained
    monkeypatch.setattr(model, "save_pretrained", lambda d, **kw: orig(d, max_shard_size="50KB", **kw))
    path = save_checkpoint(tmp_path, 1, model, tok, None, None, {})
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1

    other = build_model(tok, size="nano", seed=3)
    load_checkpoint(path, other)
    for k, v in other.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_model_saved_in_original_layout_still_loads(tmp_path):
    # transformers >= 5 writes MoE experts unfused (original checkpoint keys), unlike the in-memory state_dict.
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    path = save_checkpoint(tmp_path, 1, model, None, None, None, {})
    torch.manual_seed(1)
    other = MixtralForCausalLM(cfg)
    load_checkpoint(path, other)
    for k, v in other.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


# --------------------------------------------------------------------------------------- validation and fallback


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path):
    path.write_bytes(os.urandom(4096))


def _empty(path):
    path.write_bytes(b"")


def _state(**fields):
    def edit(ckpt):
        state = json.loads((ckpt / "trainer_state.json").read_text())
        state.pop("step")
        state.update(fields)
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return edit


CORRUPTIONS = {
    "weights truncated": (lambda c: _truncate(c / "model.safetensors"), "model.safetensors"),
    "weights garbage": (lambda c: _garbage(c / "model.safetensors"), "model.safetensors"),
    "weights empty": (lambda c: _empty(c / "model.safetensors"), "model.safetensors"),
    "weights padded": (lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()
                                                                        + b"\0" * 16), "model.safetensors"),
    "state without step": (_state(), "trainer_state.json"),
    "state step a string": (_state(step="4"), "trainer_state.json"),
    "state step a float": (_state(step=4.5), "trainer_state.json"),
    "state step a bool": (_state(step=True), "trainer_state.json"),
    "state step of another folder": (_state(step=3), "trainer_state.json"),
    "state not json": (lambda c: (c / "trainer_state.json").write_text('{"step": 4'), "trainer_state.json"),
    "optimizer truncated": (lambda c: _truncate(c / "optimizer.pt"), "optimizer.pt"),
    "rng garbage": (lambda c: _garbage(c / "rng.pt"), "rng.pt"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_latest_checkpoint_is_skipped_for_the_previous_good_one(tmp_path, tok, kind):
    """Each corruption of the newest checkpoint is found without loading it (checkpoint_problem names the file);
    resumable_checkpoint / latest_checkpoint fall back to the previous checkpoint, which then loads."""
    corrupt, culprit = CORRUPTIONS[kind]
    model, opt, sched = _setup(tok)
    good = save_checkpoint(tmp_path, 3, model, tok, opt, sched, {"v": 3})
    _train_step(model, opt, sched, _batch(tok, 0))
    bad = save_checkpoint(tmp_path, 4, model, tok, opt, sched, {"v": 4})
    assert ckpt_mod.checkpoint_problem(bad) is None and ckpt_mod.checkpoint_problem(good) is None
    corrupt(bad)

    problem = ckpt_mod.checkpoint_problem(bad)
    assert problem is not None and problem.startswith(culprit) and "\n" not in problem
    found, skipped = ckpt_mod.resumable_checkpoint(tmp_path)
    assert found == good and skipped == [(bad, problem)]
    if culprit in ("optimizer.pt", "rng.pt"):  # the weights alone are fine: usable by from_pretrained
        assert latest_checkpoint(tmp_path) == bad
    else:
        assert latest_checkpoint(tmp_path) == good
    other, opt2, sched2 = _setup(tok, seed=1)
    assert load_checkpoint(found, other, opt2, sched2)["v"] == 3


def test_no_good_checkpoint_and_quarantine(tmp_path, tok):
    model, opt, sched = _setup(tok)
    a = save_checkpoint(tmp_path, 1, model, tok, opt, sched, {})
    b = save_checkpoint(tmp_path, 2, model, tok, opt, sched, {})
    _empty(b / "model.safetensors")
    _state(step="1")(a)
    found, skipped = ckpt_mod.resumable_checkpoint(tmp_path)
    assert found is None and [p for p, _ in skipped] == [b, a]

    moved = ckpt_mod.quarantine_checkpoint(b)
    assert moved.name == "step-00000002.corrupt" and (moved / "trainer_state.json").is_file() and not b.exists()
    # a quarantined folder is no checkpoint: not resumed from, not pruned, not cleaned up
    save_checkpoint(tmp_path, 3, model, tok, opt, sched, {}, keep_last=1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002.corrupt", "step-00000003"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000003"


def test_final_model_folder_is_written_atomically(tmp_path, tok, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first, _, _ = _setup(tok, seed=0)
    final = ckpt_mod.save_final_model(tmp_path, first, tok)
    assert final == tmp_path / "final"
    second, _, _ = _setup(tok, seed=1)
    ids = tok("3+4=7", return_tensors="pt").input_ids

    def logits(m):
        m.eval()
        with torch.no_grad():
            return m(input_ids=ids).logits

    # a failure in the middle of the second save (tokenizer written after the weights) leaves the first whole
    monkeypatch.setattr(tok, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(OSError, match="disk full"):
        ckpt_mod.save_final_model(tmp_path, second, tok)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["final"]  # no temporary folder left
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(final)), logits(first))

    ckpt_mod.save_final_model(tmp_path, second, tok)  # replaces it
    assert os.listdir(tmp_path) == ["final"]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(final)), logits(second))
    assert AutoTokenizer.from_pretrained(final)("3+4=7").input_ids == ids[0].tolist()


# --------------------------------------------------------------------------------------- run directory lock


def test_run_lock_names_its_holder_and_a_dead_holder_does_not_block(tmp_path):
    import socket
    import sys

    from postrl.train.run_state import RunLock, holder_alive, read_holder

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom postrl.train.run_state import RunLock\n"
        f"lock = RunLock({str(tmp_path)!r})\nprint('locked', flush=True)\ntime.sleep(120)\n")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(PostrlError) as info:
            RunLock(tmp_path)
        msg = str(info.value)
        assert f"is in use by pid {holder.pid} on {socket.gethostname()} (started 20" in msg and "\n" not in msg
        assert read_holder(tmp_path)["pid"] == holder.pid and holder_alive(read_holder(tmp_path)) is True
    finally:
        holder.kill()  # SIGKILL: no clean-up; the kernel drops the flock
        holder.wait()
    assert holder_alive(read_holder(tmp_path)) is False  # the file still names the killed holder
    lock = RunLock(tmp_path)
    assert read_holder(tmp_path)["pid"] == os.getpid()
    again = RunLock(tmp_path)  # trainers in one process share the lock
    again.release()
    assert read_holder(tmp_path)["pid"] == os.getpid()
    lock.release()
    assert read_holder(tmp_path) is None and (tmp_path / "run.lock").read_text() == ""
    lock.release()  # idempotent
