"""postrl.integrations.trl: postrl's stages inside TRL's GRPOTrainer, end to end on a tiny model on CPU.

The adapter takes exactly TRL's step when given TRL's method (grpo + seq_mean_token_mean = loss_type='grpo'; gdpo
= multi_objective_aggregation='normalize_then_sum', with TRL's default dapo loss = token_mean), trains a method TRL
lacks (rl_zvp) with its effect in the logged advantages, isolates reward faults and logs postrl's metrics and
alarms through TRL's logging; the README's snippet runs as written.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

from logprob_reference import renormalised_reference  # noqa: E402
from postrl.errors import ConfigError  # noqa: E402
from postrl.integrations.trl import GRPOTrainer, TRLConfigError  # noqa: E402
from postrl.models.tiny import build_local  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
MODULE = Path(__file__).stem  # reward functions below are named 'test_integration_trl:<name>'


# reward functions (TRL's signature), the same objects on both sides
def char_score(prompts, completions, **kwargs):
    """A reward that varies within every group of a random model's completions."""
    return [(sum(map(ord, c)) % 10) / 10 for c in completions]


def length_score(prompts, completions, **kwargs):
    return [float(len(c) % 3) / 2 for c in completions]


def always_zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def fails_on_odd(prompts, completions, **kwargs):
    """Raises whenever a completion of odd length is in the call: postrl isolates those rows."""
    if any(len(c) % 2 for c in completions):
        raise ValueError("odd length")
    return [1.0] * len(completions)


def always_fails(prompts, completions, **kwargs):
    raise RuntimeError("service down")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """TRL's trainer initialises accelerate's process-wide state with its own mixed precision; reset it after each
    test so that the next trainer in this process (TRL's or postrl's) starts from a clean state."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-trl") / "model"
    build_local(path)
    return str(path)


def _dataset(n: int = 16):
    return datasets.Dataset.from_list([{"prompt": f"{i} + {i + 1} =", "answer": str(2 * i + 1)} for i in range(n)])


def _args(out: Path, **kw) -> GRPOConfig:
    """Plain SGD: the update is the gradient (Adam's first step, g / (|g| + eps), turns float rounding in gradient
    entries near 0 into +-lr, whichever program computes them)."""
    base = dict(output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, seed=7,
                max_steps=2, logging_steps=1, num_generations=4, per_device_train_batch_size=8,
                gradient_accumulation_steps=2, max_completion_length=8, learning_rate=0.5, optim="sgd",
                gradient_checkpointing=False, lr_scheduler_type="constant")
    base.update(kw)
    return GRPOConfig(**base)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _run_trl(model_dir, tmp_path, rewards, **kw):
    t = TRLGRPOTrainer(model=model_dir, reward_funcs=rewards, args=_args(tmp_path / "trl", **kw),
                       train_dataset=_dataset())
    t.train()
    return t


def _run_postrl(model_dir, tmp_path, section, eval_dataset=None, **kw):
    t = GRPOTrainer(model=model_dir, postrl=section, args=_args(tmp_path / "postrl", **kw), train_dataset=_dataset(),
                    eval_dataset=eval_dataset)
    t.train()
    return t


def test_import_postrl_does_not_import_trl():
    code = "import sys, postrl, postrl.integrations; assert 'trl' not in sys.modules, 'trl imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_grpo_takes_trls_own_step(model_dir, tmp_path):
    """TRL loss_type='grpo', scale_rewards='group' == postrl grpo (eps 1e-4) + ppo_clip + seq_mean_token_mean, with
    two micro-batches of gradient accumulation per optimizer step and two passes over the batch (num_iterations:
    the second one off-policy, ratio != 1, a non-zero loss)."""
    trl_side = _run_trl(model_dir, tmp_path, [char_score], loss_type="grpo", num_iterations=2)
    ours = _run_postrl(model_dir, tmp_path, {
        "rewards": [{"name": f"{MODULE}:char_score"}], "advantage": {"name": "grpo", "eps": 1e-4},
        "loss": {"name": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "agg": "seq_mean_token_mean"}},
        num_iterations=2)
    a, b = _losses(trl_side), _losses(ours)
    assert len(a) == len(b) == 2 and abs(a[1]) > 1e-3
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert _max_diff(_weights(trl_side), start) > 1e-3  # the step moved the weights
    assert _max_diff(_weights(trl_side), _weights(ours)) < 1e-5
    # TRL's completions table shows the same advantages
    assert torch.allclose(torch.tensor(list(trl_side._logs["advantages"])),
                          torch.tensor(list(ours._logs["advantages"])), atol=1e-5)


def test_gdpo_equals_trl_normalize_then_sum(model_dir, tmp_path):
    """TRL multi_objective_aggregation='normalize_then_sum' (default loss dapo) == postrl gdpo + token_mean."""
    trl_side = _run_trl(model_dir, tmp_path, [char_score, length_score], reward_weights=[1.0, 0.5],
                        multi_objective_aggregation="normalize_then_sum")
    ours = _run_postrl(model_dir, tmp_path, {
        "rewards": [{"name": f"{MODULE}:char_score", "weight": 1.0}, {"name": f"{MODULE}:length_score",
                                                                       "weight": 0.5}],
        "advantage": {"name": "gdpo"}, "loss": {"name": "ppo_clip", "agg": "token_mean"}})
    adv_trl, adv_ours = (torch.tensor(list(t._logs["advantages"])) for t in (trl_side, ours))
    assert adv_trl.abs().max() > 0.1 and torch.allclose(adv_trl, adv_ours, atol=1e-5)
    assert max(abs(x - y) for x, y in zip(_losses(trl_side), _losses(ours))) < 1e-5
    # gdpo's advantages are computed in float64, TRL's in float32 (they differ by ~2e-7); an on-policy gradient
    # sum_i A_i grad log p_i is a small difference of large per-completion terms on a random model, which turns that
    # rounding into ~0.3% of the update (measured: max |diff| 9e-5 for an update of 0.03; the same inputs give the
    # same gradients to the last bit, test_token_mean_has_trls_dapo_gradients)
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    moved = _max_diff(_weights(trl_side), start)
    assert moved > 1e-3 and _max_diff(_weights(trl_side), _weights(ours)) < 0.01 * moved
    # the adapter's own log: the per-component rewards as postrl computes them
    row = next(r for r in ours.state.log_history if f"postrl/reward/{MODULE}:char_score/mean" in r)
    assert f"postrl/reward/{MODULE}:length_score/mean" in row
    assert row[f"rewards/{MODULE}:char_score/mean"] == pytest.approx(row[f"postrl/reward/{MODULE}:char_score/mean"],
                                                                    abs=1e-6)


def test_token_mean_has_trls_dapo_gradients(model_dir, tmp_path, monkeypatch):
    """On the adapter's own micro-batches, postrl's ppo_clip + token_mean (weights over the optimizer step's two
    micro-batches) and TRL's loss_type='dapo' (its default) give the same loss and bitwise the same gradients."""
    seen = []
    original = GRPOTrainer._compute_loss

    def both(self, model, inputs):
        params = [p for p in model.parameters() if p.requires_grad]
        ours = original(self, model, inputs)
        g_ours = torch.autograd.grad(ours, params, allow_unused=True)
        theirs = TRLGRPOTrainer._compute_loss(self, model, inputs)
        g_theirs = torch.autograd.grad(theirs, params, allow_unused=True)
        seen.append((float(ours - theirs), max(float((a - b).abs().max()) for a, b in zip(g_ours, g_theirs)
                                               if a is not None)))
        return original(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", both)
    _run_postrl(model_dir, tmp_path, {"rewards": [{"name": f"{MODULE}:char_score"}],
                                      "loss": {"name": "ppo_clip", "agg": "token_mean"}}, max_steps=1)
    assert len(seen) == 2  # two micro-batches
    assert all(abs(dl) < 1e-7 and dg == 0.0 for dl, dg in seen)


def test_rl_zvp_trains_where_grpo_has_no_signal(model_dir, tmp_path):
    """Every group has zero reward variance: GRPO's advantages are 0 (no step), RL-ZVP gives every token of the
    all-wrong groups a negative entropy-scaled advantage (logged) and the weights move."""
    section = {"rewards": [{"name": f"{MODULE}:always_zero"}]}
    grpo = _run_postrl(model_dir, tmp_path / "g", {**section, "advantage": {"name": "grpo"}})
    zvp = _run_postrl(model_dir, tmp_path / "z", {**section, "advantage": {"name": "rl_zvp", "alpha": 0.1}},
                      eval_dataset=_dataset(8), eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert torch.tensor(list(grpo._logs["advantages"])).abs().max() == 0
    assert _max_diff(_weights(grpo), start) == 0
    adv = torch.tensor(list(zvp._logs["advantages"]))
    assert (adv < 0).all()
    # alpha is the mean magnitude of the token advantages in a group (normalised by the group's mean entropy)
    assert float(adv.abs().mean()) == pytest.approx(0.1, rel=0.3)
    rows = [r for r in zvp.state.log_history if "postrl/advantages/mean" in r]
    assert rows and all(r["postrl/advantages/mean"] < 0 for r in rows)
    # TRL's evaluation runs the same stages on its own batch, logged with TRL's eval_ prefix
    evals = [r for r in zvp.state.log_history if "eval_postrl/advantages/mean" in r]
    assert len(evals) == 2 and all(r["eval_postrl/advantages/mean"] < 0 for r in evals)
    assert _max_diff(_weights(zvp), start) > 1e-3


def test_reward_faults_are_isolated_and_alarms_logged(model_dir, tmp_path):
    t = _run_postrl(model_dir, tmp_path, {
        "rewards": [{"name": f"{MODULE}:char_score"}, {"name": f"{MODULE}:fails_on_odd"},
                    {"name": f"{MODULE}:always_fails"}],
        "reward": {"alarm_rate": 0.5, "on_all_failed": "continue"}})  # (a reward raising everywhere would stop)
    rows = [r for r in t.state.log_history if f"postrl/reward/{MODULE}:fails_on_odd/failures" in r]
    assert len(rows) == 2
    # only the odd-length completions failed: bisection isolated them
    for r in rows:
        assert 0 < r[f"postrl/reward/{MODULE}:fails_on_odd/failure_rate"] < 1
        assert r[f"postrl/reward/{MODULE}:always_fails/failure_rate"] == 1.0
    assert rows[0].get("postrl/alarm/reward_all_failed") == 1.0
    assert any(a["name"] == "reward_all_failed" and "always_fails" in a["message"] for a in t.alarms)
    assert _losses(t) and all(x == x for x in _losses(t))  # trained on, no NaN


def test_keep_mask_filter_masks_dropped_groups(model_dir, tmp_path):
    """dynamic_sampling drops the groups without reward variance: they take no part (advantage 0) and the
    count is logged."""
    t = _run_postrl(model_dir, tmp_path, {
        "rewards": [{"name": f"{MODULE}:always_zero"}], "advantage": {"name": "rl_zvp"},
        "filters": [{"name": "dynamic_sampling", "reward": f"{MODULE}:always_zero", "max_attempts": 1}]})
    rows = [r for r in t.state.log_history if "postrl/filter/dropped_groups" in r]
    assert rows and all(r["postrl/filter/dropped_groups"] == 4 for r in rows)
    assert torch.tensor(list(t._logs["advantages"])).abs().max() == 0


def test_trl_options_that_cannot_carry_over_are_one_line_errors(model_dir, tmp_path):
    """An option with no postrl counterpart, and a TRL option that the postrl section contradicts, are one line
    naming what to do; every error of the adapter is a ConfigError and the ValueError TRL raises."""
    with pytest.raises(ValueError, match=r"GRPOConfig.delta=1.1 must exceed 1 \+ epsilon_high \(1.2\)") as e:
        GRPOTrainer(model=model_dir, reward_funcs=char_score, args=_args(tmp_path, delta=1.1),
                    train_dataset=_dataset())
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)
    with pytest.raises(TRLConfigError, match=r"GRPOConfig.loss_type sets loss.agg='seq_mean_token_mean' but the "
                                             r"postrl section sets loss.agg='token_mean': set it in one place"):
        GRPOTrainer(model=model_dir, reward_funcs=char_score, args=_args(tmp_path, loss_type="grpo"),
                    train_dataset=_dataset(), postrl={"loss": {"agg": "token_mean"}})
    with pytest.raises(ValueError, match="GRPOConfig.epsilon is a parameter of TRL's loss"):
        GRPOTrainer(model=model_dir, reward_funcs=char_score, args=_args(tmp_path, epsilon=0.3),
                    train_dataset=_dataset(), postrl={"loss": {"name": "sapo"}})
    with pytest.raises(ValueError, match="reward_weights weighs reward_funcs"):
        GRPOTrainer(model=model_dir, args=_args(tmp_path, reward_weights=[1.0, 1.0]), train_dataset=_dataset(),
                    postrl={"rewards": [{"name": "correct"}, {"name": "format"}]})
    with pytest.raises(ValueError, match="No reward source provided.*or name rewards in the postrl section"):
        GRPOTrainer(model=model_dir, args=_args(tmp_path), train_dataset=_dataset())  # (TRL's error, and postrl's way)
    with pytest.raises(ValueError, match="unknown advantage 'grpoo'") as e:  # postrl's own errors too
        GRPOTrainer(model=model_dir, reward_funcs=char_score, postrl={"advantage": {"name": "grpoo"}},
                    args=_args(tmp_path), train_dataset=_dataset())
    assert isinstance(e.value, ConfigError)


def test_a_teacher_is_refused_in_one_line(model_dir, tmp_path):
    """The adapter cannot give a teacher's log-probs (on-policy distillation): refused before TRL loads anything."""
    with pytest.raises(ConfigError, match=r"regularizer 'distill' reads teacher_logp: the TRL adapter cannot give a "
                                          r"teacher model's log-probs"):
        GRPOTrainer(model=model_dir, reward_funcs=char_score, postrl={"model": {"teacher": {"path": model_dir}},
                                                                     "regularizers": [{"name": "distill"}]},
                    args=_args(tmp_path), train_dataset=_dataset())


def test_readme_snippet_runs(model_dir, tmp_path, monkeypatch):
    """The README's 'Many GPUs: TRL' code, as written, with the tiny model in place of the hub name."""
    section = README.read_text().split("### Many GPUs: TRL", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    line = 'model = "Qwen/Qwen2.5-0.5B-Instruct"'
    assert line in code
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code.replace(line, f"model = {model_dir!r}"), "README.md", "exec"), ns)
    trainer = ns["trainer"]
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for key in ("postrl/reward/correct/mean", "postrl/reward/format/mean", "postrl/advantages/mean",
                "postrl/pg_loss", "postrl/entropy"):
        assert all(key in r for r in rows), key
    assert trainer.postrl.advantage.name == "gdpo" and trainer.postrl.objective.agg.__name__ == "token_mean"


def test_checkpoint_carries_postrl_state(model_dir, tmp_path):
    """TRL's checkpoints hold postrl's state (step count, stateful stages, KL controller); a run resumed from one
    continues it: it ends at the same step count and adaptive KL coefficient as the uninterrupted run."""
    import json

    section = {"rewards": [{"name": f"{MODULE}:char_score"}],
               "kl": {"coef": 0.05, "controller": "adaptive", "target": 1e-6, "horizon": 10}}
    first = _run_postrl(model_dir, tmp_path, section, save_strategy="steps", save_steps=1, max_steps=2)
    ckpt = tmp_path / "postrl" / "checkpoint-1"
    state = json.loads((ckpt / "postrl_state.json").read_text())
    assert state["step"] == 1 and state["stages"]["kl"]
    resumed = GRPOTrainer(model=model_dir, postrl=section, args=_args(tmp_path / "resumed", max_steps=2),
                          train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert first.postrl_steps == resumed.postrl_steps == 2
    assert first.postrl.objective.kl_ctrl.value != 0.05  # the controller moved
    assert resumed.postrl.objective.kl_ctrl.value == pytest.approx(first.postrl.objective.kl_ctrl.value, rel=1e-5)


# ---------------------------------------------------------------------------------------------- TRL as a drop-in
# The adapter takes TRL's arguments unchanged: the same call gives TRL's step (TRL's own suite, run against the adapter
# offline, is in the report of issue 28; these are its representative cases, each compared with TRL's own trainer).

_CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny sequence-classification reward model (one label) with the policy's tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from postrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(3)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2, num_labels=1,
                                                    pad_token_id=tok.pad_token_id))
    path = tmp_path_factory.mktemp("tiny-rm") / "tiny-rm"
    rm.save_pretrained(path)
    tok.chat_template = _CHAT
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny policy with a chat template (conversational prompts)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    build_local(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = _CHAT
    tok.save_pretrained(path)
    return str(path)


def _chat_dataset(n: int = 16):
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i} + {i + 1} ="}],
                                        "answer": str(2 * i + 1)} for i in range(n)])


def _same_run(a, b, tol: float = 1e-5) -> None:
    """The two trainers took the same steps: losses, advantages and weights (and the weights moved)."""
    la, lb = _losses(a), _losses(b)
    assert len(la) == len(lb) > 0 and max(abs(x - y) for x, y in zip(la, lb)) < tol, (la, lb)
    assert torch.allclose(torch.tensor(list(a._logs["advantages"])), torch.tensor(list(b._logs["advantages"])),
                          atol=tol)
    wa, wb = _weights(a), _weights(b)
    start = AutoModelForCausalLM.from_pretrained(a.model.config._name_or_path).state_dict()
    assert _max_diff(wa, start) > 1e-3
    assert _max_diff(wa, wb) < tol


def eighths(prompts, completions, **kwargs):
    """A reward in multiples of 1/8: with scale_rewards='none' the advantages r - mean_g(r) are exact in float32
    (TRL) and float64 (postrl's grpo) alike, so the two trainers' steps can be compared to the last bits (an
    on-policy gradient, a small difference of large per-completion terms, turns a 1e-7 rounding difference of the
    advantages into ~1e-4 of the weights, enough to flip a clipping decision at the next step)."""
    return [(sum(map(ord, c if isinstance(c, str) else c[0]["content"])) % 8) / 8 for c in completions]


def _both(model_dir, tmp_path, dataset=None, **kw):
    """TRL's trainer and the adapter on the same call (``kw``: GRPOTrainer's keywords plus ``args``; default
    scale_rewards='none', see ``eighths``)."""
    args = {"scale_rewards": "none", **kw.pop("args", {})}
    out = []
    for cls, sub in ((TRLGRPOTrainer, "trl"), (GRPOTrainer, "postrl")):
        t = cls(model=model_dir, args=_args(tmp_path / sub, **args), train_dataset=dataset or _dataset(), **kw)
        t.train()
        out.append(t)
    return out


def test_reward_funcs_and_weights_as_trl_takes_them(model_dir, tmp_path):
    """reward_funcs (two callables) with reward_weights and TRL's loss_type='grpo', no postrl section: the adapter
    takes TRL's step and logs TRL's metric names (rewards/<function name>/mean, reward = the weighted sum)."""
    trl_side, ours = _both(model_dir, tmp_path, reward_funcs=[eighths, length_score],
                           args=dict(loss_type="grpo", reward_weights=[1.0, 0.5], num_iterations=2))
    _same_run(trl_side, ours)
    for a, b in zip(trl_side.state.log_history, ours.state.log_history):
        for key in ("reward", "rewards/eighths/mean", "rewards/length_score/mean", "entropy",
                    "clip_ratio/region_mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-5), key
    # postrl's own metric of the same source (logged when the generation's last pass ends)
    mine = next(r["postrl/reward/eighths/mean"] for r in ours.state.log_history if "postrl/reward/eighths/mean" in r)
    assert mine == pytest.approx(next(r["rewards/eighths/mean"] for r in ours.state.log_history
                                      if "rewards/eighths/mean" in r), abs=1e-6)
    assert ours.reward_func_names == ["eighths", "length_score"]
    assert ours.postrl_config.advantage.params == {"scale": "none", "eps": 1e-4}  # TRL's scale_rewards


def test_reward_model_by_folder_and_by_object(model_dir, reward_model_dir, tmp_path):
    """A reward model given as TRL takes one (a local folder, or a PreTrainedModel with reward_processing_classes)
    is scored as TRL scores it (logits[:, 0] of prompt + completion): the same steps as TRL's trainer, the metric
    named after the model (rewards/<folder name>/mean)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    trl_side, by_folder = _both(model_dir, tmp_path, reward_funcs=reward_model_dir)
    _same_run(trl_side, by_folder)
    assert any("rewards/tiny-rm/mean" in r for r in by_folder.state.log_history)
    rm = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    by_object = GRPOTrainer(model=model_dir, reward_funcs=rm, args=_args(tmp_path / "obj", scale_rewards="none"),
                            train_dataset=_dataset(),
                            reward_processing_classes=AutoTokenizer.from_pretrained(reward_model_dir))
    by_object.train()
    _same_run(trl_side, by_object)
    # the model is a postrl reward source: its failures would be isolated and counted like any other source's
    assert by_object.postrl.scorer.specs[0].name == "tiny-rm"
    assert any("postrl/reward/tiny-rm/mean" in r for r in by_object.state.log_history)


seen_calls: list = []


def conversational_reward(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer,
                          **kwargs):
    """Records what it receives (TRL's contract) and scores the completion's content."""
    seen_calls.append(dict(prompts=prompts, completions=completions, state=trainer_state,
                           ids=completion_ids, answer=answer))
    log_extra("chars", [len(c[0]["content"]) for c in completions])
    log_metric("calls", 1.0)
    return eighths(prompts, completions)


def test_conversational_rewards_get_trls_arguments(chat_model_dir, reward_model_dir, tmp_path):
    """Conversational data: a reward function gets TRL's arguments (prompts and completions as message lists,
    completion_ids, the columns, trainer_state = TRL's TrainerState, log_extra / log_metric into TRL's logs), a
    reward model scores the chat template of prompt + completion; the same steps as TRL's trainer."""
    from transformers import TrainerState

    trl_side, ours = _both(chat_model_dir, tmp_path, dataset=_chat_dataset(),
                           reward_funcs=[conversational_reward, reward_model_dir])
    _same_run(trl_side, ours)
    calls = seen_calls[len(seen_calls) // 2:]  # the adapter's calls (TRL's came first)
    assert len(calls) == 2
    for call in calls:
        assert call["prompts"][0][0]["role"] == "user" and call["completions"][0][0]["role"] == "assistant"
        assert isinstance(call["state"], TrainerState) and call["state"] is ours.state
        assert all(isinstance(i, list) and all(isinstance(t, int) for t in i) for i in call["ids"])
        assert len(call["answer"]) == len(call["completions"]) == 16  # the generation batch: 8 x 2 micro-batches
    assert list(ours._logs["extra"]["chars"]) == list(trl_side._logs["extra"]["chars"])
    assert [r.get("calls") for r in ours.state.log_history] == [r.get("calls") for r in trl_side.state.log_history]


def test_beta_follows_trls_bias_corrected_kl(model_dir, tmp_path):
    """beta with TRL's default use_bias_correction_kl=True (the KL times the differentiable ratio pi/pi_old) and
    with it off: both take TRL's steps (3 steps, two passes over each batch), and the two differ."""
    runs = {}
    for corr in (True, False):
        trl_side, ours = _both(model_dir, tmp_path / str(corr), reward_funcs=eighths,
                               args=dict(beta=0.2, use_bias_correction_kl=corr, max_steps=3, num_iterations=2))
        _same_run(trl_side, ours)
        assert ours.postrl_config.kl.is_correction == ("token" if corr else "none")
        assert all(a.get("kl") == pytest.approx(b.get("kl"), abs=1e-6) for a, b in
                   zip(trl_side.state.log_history, ours.state.log_history))
        runs[corr] = _weights(ours)
    assert _max_diff(runs[True], runs[False]) > 1e-5


@pytest.mark.parametrize("loss_type, kw", [
    ("dr_grpo", {}), ("bnpo", {"gradient_accumulation_steps": 1}), ("cispo", {"epsilon_high": 5.0}),
    ("cispo", {}), ("sapo", {}), ("luspo", {"importance_sampling_level": "sequence"}), ("vespo", {}),
    ("dapo", {"steps_per_generation": 3}), ("grpo", {"steps_per_generation": 3}),
    ("dapo", {"top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.01, "delta": 1.5}),
])
def test_trl_loss_options_take_trls_step(model_dir, tmp_path, loss_type, kw):
    """TRL's loss options become postrl stages that take TRL's step (two passes over each batch: ratio != 1); with
    steps_per_generation=3 and 2 micro-batches per optimizer step, an optimizer step spans two passes."""
    trl_side, ours = _both(model_dir, tmp_path, reward_funcs=eighths,
                           args=dict(loss_type=loss_type, num_iterations=2, **kw))
    _same_run(trl_side, ours)


def test_entropy_bonus_is_trls(model_dir, tmp_path):
    """entropy_coef and use_adaptive_entropy keep TRL's entropy bonus (differentiable: TRL's fused head) and its
    controller: the same steps and the same final coefficient as TRL's trainer."""
    trl_side, ours = _both(model_dir, tmp_path, reward_funcs=eighths,
                           args=dict(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=15.0))
    _same_run(trl_side, ours)
    assert ours.entropy_coef == pytest.approx(trl_side.entropy_coef) and ours.entropy_coef > 0.05


def test_off_policy_mask_equals_trls():
    """The off_policy_mask regularizer is TRL's get_off_policy_mask (DeepSeek-V3.2), NaN sampler log-probs
    included."""
    from postrl.stages import build

    g = torch.Generator().manual_seed(0)
    logp, sampler = -torch.rand(6, 5, generator=g), -torch.rand(6, 5, generator=g)
    sampler[0, 1] = float("nan")
    mask = (torch.rand(6, 5, generator=g) > 0.2).float()
    adv = torch.randn(6, generator=g)
    ours = build("regularizer", "off_policy_mask", {"threshold": 0.05})(
        {"advantages": adv, "logp": logp, "sampler_logp": sampler, "mask": mask})["pg_mask"]
    theirs = TRLGRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), logp, sampler, mask, 0.05)
    assert 0 < ours[:, 0].sum() < 6 and torch.equal(ours, theirs.expand_as(ours))


def test_trls_defaults_without_args(model_dir, tmp_path, monkeypatch):
    """No args: TRL's default GRPOConfig (output_dir '<model name>-GRPO'). (bf16, TRL's default, needs a GPU: on
    CPU the config is made with use_cpu=True, as TRL's own test suite does.)"""
    from trl.trainer.base_config import _BaseConfig

    original = _BaseConfig.__post_init__

    def on_cpu(self):
        self.use_cpu = True
        original(self)

    monkeypatch.setattr(_BaseConfig, "__post_init__", on_cpu)
    monkeypatch.chdir(tmp_path)
    t = GRPOTrainer(model=model_dir, reward_funcs=char_score, train_dataset=_dataset())
    assert t.args.output_dir == "model-GRPO"


def test_mixture_of_experts_logs_trls_aux_loss(tmp_path):
    """A mixture-of-experts policy: the router's load-balancing loss is added and logged (aux_loss) as TRL does."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from postrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                             eos_token_id=tok.eos_token_id))
    path = tmp_path / "moe"
    moe.save_pretrained(path)
    tok.save_pretrained(path)
    trl_side, ours = _both(str(path), tmp_path, reward_funcs=eighths)
    assert ours.aux_loss_enabled
    _same_run(trl_side, ours)
    a = [r["aux_loss"] for r in trl_side.state.log_history if "aux_loss" in r]
    b = [r["aux_loss"] for r in ours.state.log_history if "aux_loss" in r]
    assert len(a) == len(b) > 0 and b == pytest.approx(a, abs=1e-6)


@pytest.mark.parametrize("logprobs", ["full", "filtered"])
def test_postrl_entropy_regularizer_gets_trls_differentiable_entropy(model_dir, tmp_path, logprobs):
    """A postrl regulariser that differentiates the entropy (entropy_bonus) trains through TRL's entropy (TRL
    1.16's fused head gives it a gradient; with top-p and rollout.logprobs=filtered, the adapter's own forward
    does): with every advantage 0 the entropy term alone moves the weights."""
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    section = {"rewards": [{"name": f"{MODULE}:always_zero"}], "rollout": {"logprobs": logprobs}}
    kw = {"top_p": 0.9} if logprobs == "filtered" else {}
    flat = _run_postrl(model_dir, tmp_path / "flat", section, **kw)
    assert _max_diff(_weights(flat), start) == 0  # no signal without the regulariser
    bonus = _run_postrl(model_dir, tmp_path / "bonus",
                        {**section, "regularizers": [{"name": "entropy_bonus", "coef": 1.0}]}, **kw)
    assert bool(bonus._logprob_filter) == (logprobs == "filtered")
    assert bonus.postrl.objective.entropy_grad and _max_diff(_weights(bonus), start) > 1e-3


# ---------------------------------------------------------------------------------------------- top-p / top-k
def test_top_p_top_k_correction_equals_the_renormalised_reference(model_dir, tmp_path):
    """rollout.logprobs=filtered: TRL's log-prob function (update, old and reference log-probs) returns the
    log-probs of the renormalised filtered distribution, on the same logits TRL's forward computes; TRL's own
    (fused) function returns the full log-softmax; the difference is the kept log-mass the adapter logs."""
    # float32 logits (bf16's coarse logits tie, and the order of tied tokens decides top-p's boundary)
    args = _args(tmp_path, top_p=0.8, temperature=0.7, generation_kwargs={"top_k": 20}, bf16=False)
    t = GRPOTrainer(model=model_dir, postrl={"rewards": [{"name": f"{MODULE}:char_score"}],
                                             "rollout": {"logprobs": "filtered"}}, args=args,
                    train_dataset=_dataset())
    r = t.postrl_config.rollout
    assert (r.top_p, r.top_k, r.logprobs) == (0.8, 20, "filtered")
    gen = torch.Generator().manual_seed(0)
    P, T, V = 5, 6, t.model.config.vocab_size
    ids = torch.randint(3, V, (3, P + T), generator=gen)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # left-padded prompt
    attn[1, -2:] = 0  # a completion that ended early
    logp, ent, _ = t._get_per_token_logps_and_entropies(t.model, ids, attn, T, batch_size=2, compute_entropy=True)
    mask = attn[:, -T:].bool()
    with torch.no_grad(), t.accelerator.autocast():  # TRL's forward (its autocast)
        scaled = t.model(input_ids=ids, attention_mask=attn).logits[:, -(T + 1):-1].float() / 0.7
    ref = renormalised_reference(scaled, ids[:, -T:], 0.8, 20)
    assert torch.allclose(logp.detach()[mask], ref[mask], atol=1e-5)
    full = torch.log_softmax(scaled, -1).gather(-1, ids[:, -T:, None]).squeeze(-1)
    theirs, their_ent, _ = TRLGRPOTrainer._get_per_token_logps_and_entropies(t, t.model, ids, attn, T,
                                                                              compute_entropy=True)
    assert torch.allclose(theirs.detach()[mask], full[mask], atol=1e-5)
    assert torch.allclose(ent[mask], their_ent.detach()[mask], atol=1e-4)  # the entropy stays the unfiltered one
    kept = t._sampler_kept_logmass({"prompt_ids": ids[:, :P], "prompt_mask": attn[:, :P],
                                    "completion_ids": ids[:, P:], "completion_mask": attn[:, P:]})
    assert (kept[mask] < -0.05).all() and (kept[~mask] == 0).all()
    assert torch.allclose(logp.detach()[mask], (full - kept)[mask], atol=1e-5)  # log q = log pi - log M
    # the gradient flows through the kept logits: it is that of the renormalised log-prob
    logp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.model.parameters())


def test_trl_sampling_settings_are_read_and_min_p_is_refused(model_dir, tmp_path):
    from postrl.integrations.trl import trl_sampling

    s = trl_sampling(_args(tmp_path, top_p=0.9, generation_kwargs={"top_k": -1, "top_p": 0.95}), "filtered")
    assert (s.top_p, s.top_k, s.filters, s.logprob_filter()) == (0.95, 0, True, {"top_p": 0.95, "top_k": 0})
    assert trl_sampling(_args(tmp_path, top_k=5), "full").logprob_filter() == {}  # uncorrected: TRL's own
    assert not trl_sampling(_args(tmp_path, top_p=0.5, generation_kwargs={"do_sample": False}), "filtered").filters
    assert not trl_sampling(_args(tmp_path)).filters  # TRL's defaults: top_p 1, top_k 0
    with pytest.raises(ConfigError, match="min_p"):
        GRPOTrainer(model=model_dir, reward_funcs=char_score, postrl={"rollout": {"logprobs": "filtered"}},
                    args=_args(tmp_path, min_p=0.1), train_dataset=_dataset())


def test_top_p_kept_mass_is_logged_and_the_alarm_fires_only_uncorrected(model_dir, tmp_path):
    """top_p=0.7 on a near-uniform random model keeps ~70% of the mass per token: logged in both modes; with TRL's
    unfiltered log-probs (rollout.logprobs=full) the filtered_sampling alarm fires at the second step, with the
    correction it does not, and the two updates differ (the gradient of log q is not that of log pi)."""
    runs = {}
    for mode in ("full", "filtered"):
        runs[mode] = _run_postrl(model_dir, tmp_path / mode, {"rewards": [{"name": f"{MODULE}:char_score"}],
                                                              "rollout": {"logprobs": mode}},
                                 top_p=0.7, temperature=0.9)
    for mode, t in runs.items():
        rows = [r for r in t.state.log_history if "postrl/sampler/kept_mass_mean" in r]
        assert len(rows) == 2 and all(0.6 < r["postrl/sampler/kept_mass_mean"] < 0.8 for r in rows), mode
        assert all(r["postrl/sampler/kept_mass_min"] >= 0.7 - 1e-6 for r in rows)  # top-p keeps at least 0.7
    assert [a["step"] for a in runs["full"].alarms if a["name"] == "filtered_sampling"] == [2]
    assert not [a for a in runs["filtered"].alarms if a["name"] == "filtered_sampling"]
    assert _max_diff(_weights(runs["full"]), _weights(runs["filtered"])) > 1e-4


def test_regularizers_get_their_fields_and_observe_under_trl(model_dir, tmp_path):
    """Under TRL: chi2_occupancy's features are produced through the adapter's model context,
    its discriminator learns from TRL's reference log-probs once per generation; steer's weights reach the loss."""
    t = _run_postrl(model_dir, tmp_path, {
        "rewards": [{"name": f"{MODULE}:char_score"}], "kl": {"coef": 0.01},
        "regularizers": [{"name": "chi2_occupancy", "coef": 0.1, "max_tokens": 64}, {"name": "steer"}]})
    rows = [r for r in t.state.log_history if "postrl/reg/chi2_occupancy/chi2" in r]
    assert len(rows) == 2 and all(r["postrl/reg/chi2_occupancy/disc_loss"] > 0 for r in rows)
    assert t.postrl.objective.regularizers[0].fn.steps == 2
    assert any(0.8 <= r.get("postrl/reg/steer/kept", 0) <= 1.2 for r in t.state.log_history)
    assert _losses(t) and all(x == x for x in _losses(t))
