"""Diagnostics: per-step metrics (hand-computed), the sharpness probe (vs an explicit Hessian), every monitor
firing on a run or history built to show its failure and staying silent on a healthy one, the doctor naming the
cause, the nan guard, the reward probe, the samples command, the console and the metric sinks.

Runs use a nano Llama warm-started for a few SFT steps on 1-digit arithmetic (so it answers and stops)."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.cli import main
from postrl.config import dump_yaml, load_config
from postrl.config.diagnostics import DiagnosticsConfig
from postrl.report.doctor import diagnose
from postrl.diagnostics.metrics import group_metrics, length_metrics, mismatch_metrics
from postrl.diagnostics.monitors import MONITORS, Watchdog, replay
from postrl.diagnostics.stability import stability_threshold, top_eigenvalue
from postrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ test stages
@registry.register("reward", "diag_short", source="test: one-character completion")
def diag_short(prompts, completions, **_):
    """1 for a completion of at most one character."""
    return [float(len(c.strip()) <= 1) for c in completions]


@registry.register("reward", "diag_long", source="test: two characters or more")
def diag_long(prompts, completions, **_):
    """1 for a completion of two characters or more (diag_short + diag_long = 1: a collapsing pair)."""
    return [float(len(c.strip()) >= 2) for c in completions]


class _NanLoss:
    """A PPO-style surrogate whose 3rd and 4th calls return NaN (a loss that blows up for two steps)."""

    calls = 0

    def __call__(self, logp, old_logp, advantages):
        _NanLoss.calls += 1
        a = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        loss = -a * torch.exp(logp - old_logp)
        if _NanLoss.calls in (3, 4):
            loss = loss * float("nan")
        return loss, {}


registry.register("loss", "diag_nan_loss", source="test: NaN on calls 3-4")(_NanLoss())


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A nano model SFT'd for 35 steps (answers 1-2 digits and stops), and a copy with attention dropout."""
    from postrl.data import load_source
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

    root = tmp_path_factory.mktemp("models")
    tok = build_tokenizer()
    model = build_model(tok, size="nano", seed=0)
    run_sft(model, tok, load_source({"name": "arithmetic", "digits": 1}), steps=35, batch_size=16, lr=1e-2,
            warmup_steps=5)
    sft = root / "sft"
    model.save_pretrained(sft)
    tok.save_pretrained(sft)
    drop = root / "dropout"
    shutil.copytree(sft, drop)
    cfg = json.loads((drop / "config.json").read_text())
    cfg["attention_dropout"] = 0.3  # active in the trainer's forward (train mode), off in the sampler (eval)
    (drop / "config.json").write_text(json.dumps(cfg))
    return {"sft": sft, "dropout": drop}


BASE = ["task.name=arithmetic", "task.digits=1", "task.chatty=0", "rollout.max_new_tokens=4", "rollout.group_size=8",
        "train.prompts_per_step=4", "train.save_every=0", "train.eval_size=8", "train.eval_k=1", "optim.lr=1e-3",
        "diagnostics.edge_of_stability.every=0"]

RUNS = {
    "healthy": ["train.steps=6", "train.prompts_per_step=8", "diagnostics.edge_of_stability.every=2",
                "diagnostics.edge_of_stability.iters=10", "diagnostics.edge_of_stability.batch_size=16"],
    "truncation": ["train.steps=4", "rollout.max_new_tokens=1"],
    "nan": ["train.steps=5", "loss={name: diag_nan_loss}", "train.samples_every=1"],
    "collapse": ["train.steps=4", "rewards=[{name: diag_short}, {name: diag_long}]"],
    "mismatch": ["train.steps=3"],
    "unstable": ["train.steps=4", "optim.lr=0.03", "train.epochs=2", "train.mini_batches=2", "kl.coef=0.05",
                 "diagnostics.edge_of_stability.every=1", "diagnostics.edge_of_stability.iters=10",
                 "diagnostics.edge_of_stability.batch_size=16"],
    "no_signal": ["train.steps=5", "task.digits=2", "task.min_digits=2", "rewards=[{name: correct}]"],
}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Run directories, trained on first use."""
    root = tmp_path_factory.mktemp("runs")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = root / name
            model = models["dropout" if name == "mismatch" else "sft"]
            cfg = load_config(None, [f"model.path={model}", f"output_dir={out}", *BASE, *RUNS[name]])
            Trainer(cfg, out).train()
            cache[name] = out
        return cache[name]

    return get


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def fired(run: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in rows(run):
        for a in m["alarms"]:
            out.setdefault(a["name"], []).append(m["step"])
    return out


# ------------------------------------------------------------------------------------------------ metrics
def test_group_metrics_hand_computed():
    # three groups of 3: all correct, all wrong, two of three correct
    correct = torch.tensor([1., 1, 1, 0, 0, 0, 1, 0, 1])
    fmt = torch.tensor([1., 1, 1, 1, 0, 1, 1, 1, 1])
    rewards = torch.stack([correct, fmt], 1)
    reward = correct + 0.5 * fmt
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    from postrl.advantages import grpo

    valid = torch.ones(9, dtype=torch.bool)
    adv = grpo(reward, gid, valid)
    m = group_metrics(reward, rewards, gid, valid, adv, correct)
    assert m["zero_variance_groups/frac"] == pytest.approx(1 / 3)  # group 1 has 0.5, 0, 0.5: not zero variance
    assert m["zero_variance_groups/all_correct"] == pytest.approx(1 / 3)
    assert m["zero_variance_groups/all_wrong"] == pytest.approx(0.0)
    assert m["pass@1"] == pytest.approx((1 + 0 + 2 / 3) / 3)
    assert m["pass@3"] == pytest.approx((1 + 0 + 1) / 3)
    # distinct advantages: 1, 2, 2 of 3 rows; distinct reward vectors the same -> no collapse
    assert m["advantages/distinct_frac"] == pytest.approx((1 + 2 + 2) / 9)
    assert m["advantages/collapse"] == pytest.approx(0.0)
    std = [0.0, float(torch.tensor([.5, 0, .5]).std()), float(torch.tensor([1.5, .5, 1.5]).std())]
    assert m["reward/group_std"] == pytest.approx(sum(std) / 3)
    # advantage statistics over the valid rows, with torch's conventions (std unbiased)
    a = adv.double()
    assert (m["advantages/mean"], m["advantages/std"], m["advantages/abs_mean"], m["advantages/min"],
            m["advantages/max"]) == pytest.approx((float(a.mean()), float(a.std()), float(a.abs().mean()),
                                                   float(a.min()), float(a.max())))


def test_batch_metrics_hand_computed():
    """The batch's own statistics: valid rows only for the reward, finite entries per source, failures as
    reported, accuracy from the verifier column, token counts and sampler log-prob statistics."""
    from types import SimpleNamespace

    from postrl.diagnostics.metrics import batch_metrics

    nan = float("nan")
    correct = torch.tensor([1., 0, nan, 1])
    fmt = torch.tensor([1., 1, 0, 0])
    b = SimpleNamespace(
        reward=torch.tensor([2., 1, nan, 1]), valid=torch.tensor([True, True, False, True]),
        reward_names=["correct", "format"], rewards=torch.stack([correct, fmt], 1),
        lengths=torch.tensor([2, 1, 3, 2]), truncated=torch.tensor([False, False, True, False]),
        group_ids=torch.tensor([0, 0, 1, 1]), advantages=torch.tensor([.5, -.5, 0, 0]),
        completion_mask=torch.tensor([[1., 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]),
        sampler_logprobs=torch.tensor([[-0.1, -3.0, 0], [-0.5, 0, 0], [-4.0, -0.2, -0.3], [-1.0, -2.5, 0]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]), extra={})
    m = batch_metrics(b, {"failures": {"correct": 1}}, low_prob=0.1)
    assert m["reward/mean"] == pytest.approx(4 / 3)
    assert m["reward/std"] == pytest.approx(float(torch.tensor([2., 1, 1]).std()))
    assert m["reward/correct/mean"] == pytest.approx(2 / 3)
    assert m["reward/correct/std"] == pytest.approx(float(torch.tensor([1., 0, 1]).std()))
    assert m["reward/format/mean"] == pytest.approx(0.5) and m["reward/correct/failures"] == 1.0
    assert m["reward/format/failures"] == 0.0
    assert m["accuracy"] == pytest.approx(2 / 3) and m["valid"] == pytest.approx(0.75)
    assert (m["tokens/completion"], m["tokens/prompt"]) == (8.0, 10.0)
    lp = [-0.1, -3.0, -0.5, -4.0, -0.2, -0.3, -1.0, -2.5]
    assert m["tokens/logprob_mean"] == pytest.approx(sum(lp) / 8)
    assert m["tokens/low_prob_frac"] == pytest.approx(3 / 8)  # below log(0.1) = -2.30
    assert m["length/mean"] == pytest.approx(2.0) and m["truncated/frac"] == pytest.approx(0.25)


def test_advantage_collapse_counts_merged_reward_combinations():
    # GDPO's example: (1,0) and (0,1) sum to the same total, so 4 combinations give 3 distinct advantages
    rewards = torch.tensor([[1., 0], [0, 1], [1, 1], [0, 0]])
    reward = rewards.sum(-1)
    gid = torch.zeros(4, dtype=torch.long)
    valid = torch.ones(4, dtype=torch.bool)
    from postrl.advantages import grpo

    m = group_metrics(reward, rewards, gid, valid, grpo(reward, gid, valid), None)
    assert m["rewards/distinct_frac"] == pytest.approx(1.0)
    assert m["advantages/distinct_frac"] == pytest.approx(0.75)
    assert m["advantages/collapse"] == pytest.approx(0.25)


def test_length_reward_corr_is_within_group():
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    lens = torch.tensor([1., 2, 3, 10, 11, 12])
    tr = torch.zeros(6, dtype=torch.bool)
    valid = torch.ones(6, dtype=torch.bool)
    # reward grows with length inside each group -> +1
    assert length_metrics(lens, tr, torch.tensor([0., .5, 1, 0, .5, 1]), valid, gid)["length/reward_corr"] == \
        pytest.approx(1.0)
    # longer prompts' group pays more, but within a group reward falls with length -> -1 (not fooled by groups)
    m = length_metrics(lens, tr, torch.tensor([1., .5, 0, 3, 2.5, 2]), valid, gid)
    assert m["length/reward_corr"] == pytest.approx(-1.0)
    assert math.isnan(length_metrics(lens, tr, torch.ones(6), valid, gid)["length/reward_corr"])
    m = length_metrics(lens, torch.tensor([0, 0, 1, 0, 0, 1], dtype=torch.bool), torch.tensor([1., 1, 0, 1, 1, 0]),
                       valid, gid)
    assert m["truncated/frac"] == pytest.approx(1 / 3) and m["truncated/reward_mean"] == 0.0
    assert m["finished/reward_mean"] == 1.0 and m["length/terminated_mean"] == pytest.approx(6.0)


def test_mismatch_metrics_hand_computed():
    s = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    t = torch.log(torch.tensor([[0.25, 0.25, 0.1]]))
    mask = torch.tensor([[1., 1, 0]])
    m = mismatch_metrics(t, s, mask)
    assert m["mismatch/logp_abs_mean"] == pytest.approx(math.log(2) / 2)
    assert m["mismatch/logp_abs_max"] == pytest.approx(math.log(2))
    assert m["mismatch/prob_abs_mean"] == pytest.approx(0.125)
    assert m["mismatch/is_ratio_min"] == pytest.approx(0.5) and m["mismatch/is_ratio_max"] == pytest.approx(1.0)
    assert m["mismatch/kl"] == pytest.approx((0.5 - 1 + math.log(2)) / 2)  # k3 with r = pi_t / pi_s = 0.5


# ------------------------------------------------------------------------------------------------ sharpness
def test_lanczos_converges_where_the_power_iteration_has_not():
    """20 Lanczos products find the top eigenvalue of a 200-dimensional spectrum with a small gap to 1e-3; as many
    steps of the power iteration (the estimator this replaced, with its Rayleigh quotient) are still off."""
    g = torch.Generator().manual_seed(3)
    q = torch.linalg.qr(torch.randn(200, 200, generator=g, dtype=torch.float64))[0]
    eig = torch.cat([torch.tensor([10.0, 9.0], dtype=torch.float64),
                     torch.rand(198, generator=g, dtype=torch.float64) * 8 - 4])
    A = q @ torch.diag(eig) @ q.T
    x = torch.randn(200, generator=g, dtype=torch.float64, requires_grad=True)
    assert top_eigenvalue(0.5 * x @ A @ x, [x], iters=20) == pytest.approx(10.0, rel=1e-3)
    v = torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for _ in range(20):
        w = A @ v
        lam = float(v @ w / (v @ v))
        v = w / w.norm()
    assert abs(lam - 10.0) > 1e-2  # the power iteration with as many products


def test_top_eigenvalue_matches_explicit_hessian():
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    for eig in ([5., 3, 1, .5, -.2, -1], [2., 1, .5, 0, -3, -8]):  # the second: dominant eigenvalue negative
        A = q @ torch.diag(torch.tensor(eig, dtype=torch.float64)) @ q.T
        x = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
        loss = 0.5 * x @ A @ x
        assert top_eigenvalue(loss, [x], iters=6) == pytest.approx(max(eig), rel=1e-6)  # 6 dims: exact
    # Adam-preconditioned: eigenvalues of P^-1 A = those of P^-1/2 A P^-1/2
    A = q @ torch.diag(torch.tensor([5., 3, 1, .5, .2, .1], dtype=torch.float64)) @ q.T
    p = torch.tensor([0.5, 1, 2, 1, 0.25, 4], dtype=torch.float64)
    x = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    expect = float(torch.linalg.eigvalsh(A / p.sqrt()[:, None] / p.sqrt()[None, :]).max())
    assert top_eigenvalue(0.5 * x @ A @ x, [x], iters=6, precond=[p]) == pytest.approx(expect, rel=1e-6)
    assert stability_threshold(1e-3, 0.9) == pytest.approx(38 / 1e-3)
    assert stability_threshold(0.1) == pytest.approx(20.0)


# ------------------------------------------------------------------------------------------------ monitors on histories
def _healthy_history(n: int = 30) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        out.append({"step": s, "reward/mean": 0.3 + 0.01 * s, "accuracy": 0.2 + 0.01 * s, "entropy": 1.0 - 0.005 * s,
                    "tokens/low_prob_frac": 0.2, "length/mean": 3.0 + 0.02 * s, "length/reward_corr": 0.1,
                    "truncated/frac": 0.02, "zero_variance_groups/frac": 0.3, "zero_variance_groups/all_correct": 0.1,
                    "zero_variance_groups/all_wrong": 0.2, "advantages/collapse": 0.0, "reward/group_std": 0.3,
                    "grad_norm": 1.0 + 0.1 * (s % 3), "pass@1": 0.2 + 0.01 * s, "pass@8": 0.6, "kl": 0.01,
                    "ppo_kl": 0.001, "ratio/max": 1.3, "clip_low": 0.01, "clip_high": 0.02,
                    "mismatch/logp_abs_mean": 1e-6, "nan_guard/skipped": 0.0,
                    **({"stability/sharpness": 100.0, "stability/threshold": 3.8e4, "stability/preconditioned": 1.0}
                       if s % 10 == 0 else {})})
    return out


def _broken(name: str) -> list[dict]:
    h = _healthy_history()
    n = len(h)
    for i, m in enumerate(h):
        late = i >= n - 8
        if name == "entropy_collapse":
            m["entropy"] = 1.0 * (0.7 ** i)
            m["tokens/low_prob_frac"] = 0.2 * (0.8 ** i)
        elif name == "length_drift":
            m["length/mean"] = 3.0 + 0.5 * i
        elif name == "length_reward_corr" and late:
            m["length/reward_corr"] = 0.85
        elif name == "proxy_gold_gap":
            m["reward/mean"] = 0.2 + 0.03 * i
            m["accuracy"] = 0.1
        elif name == "echo_trap":
            m["reward/group_std"] = 0.4 if i < n - 1 else 0.05
            m["grad_norm"] = 1.0 if i < n - 1 else 12.0
        elif name == "kl_blowup" and late:
            m["kl"] = 0.9
        elif name == "pass_at_k":
            m["pass@8"] = 0.0
        elif name == "zero_variance_groups":
            m.update({"zero_variance_groups/frac": 0.95, "zero_variance_groups/all_wrong": 0.9,
                      "zero_variance_groups/all_correct": 0.05, "accuracy": 0.01, "reward/mean": 0.21})
        elif name == "advantage_collapse":
            m["advantages/collapse"] = 0.5
        elif name == "truncation":
            m.update({"truncated/frac": 0.96, "truncated/reward_mean": 0.0, "finished/reward_mean": 0.41})
        elif name == "clip_fractions":
            m.update({"clip_low": 0.05, "clip_high": 0.3})
        elif name == "logprob_mismatch":
            m["mismatch/logp_abs_mean"] = 0.3
        elif name == "filtered_sampling":
            m.update({"sampler/kept_mass_mean": 0.7, "sampler/kept_logmass_seq": -4.2})
        elif name == "nan_guard" and i == n - 1:
            m.update({"nan_guard/skipped": 1.0, "nan_guard/skipped_total": 1.0, "grad_norm": float("nan")})
        elif name == "edge_of_stability" and "stability/sharpness" in m:
            m["stability/sharpness"] = 2e5
        elif name == "teacher_variance" and late:
            m["reward/group_std"] = 0.005
        elif name == "intrinsic_collapse" and late:
            m.update({"reward/mean": 0.97, "reward/group_std": 0.03})
        elif name == "env_errors" and i == n - 1:
            m.update({"turns/env_errors": 0.25, "turns/per_episode": 1.5})
        elif name == "tool_errors" and late:
            m.update({"turns/tool_success": 0.4, "turns/tool_calls": 1.2})
        elif name == "turn_truncation" and late:
            m["turns/truncated_turns"] = 0.6
        elif name == "malformed_calls" and late:
            m["turns/malformed_calls"] = 0.9
        elif name == "reward_all_failed" and i == n - 1:
            m.update({"reward/correct/failure_rate": 1.0, "reward/correct/failures": 8.0})
    return h


def _run_watchdog(history: list[dict], config: dict | None = None, evals: list[dict] | None = None):
    cfg = config or load_config(None, ["rollout.max_new_tokens=32"]).model_dump(mode="json")
    per_step, final = replay(history, evals or [], cfg)
    return per_step, final


def test_healthy_history_raises_no_alarm():
    per_step, final = _run_watchdog(_healthy_history())
    assert all(not a for a in per_step) and not final, [a.text() for al in per_step for a in al]


@pytest.mark.parametrize("name", [m.name for m in MONITORS])
def test_each_monitor_fires_on_its_failure(name):
    cfg = load_config(None, ["rollout.max_new_tokens=32"]).model_dump(mode="json")
    if name == "intrinsic_collapse":  # a label-free run
        cfg["rewards"] = [{"name": "majority_vote"}]
    per_step, final = _run_watchdog(_broken(name), cfg)
    names = {a.name for al in per_step for a in al} | {a.name for a in final}
    assert name in names, names
    alarm = next(a for al in per_step for a in al if a.name == name)
    assert re.search(r"\d", alarm.message), alarm.message  # the symptom is stated with numbers
    assert alarm.cause and alarm.fix
    also = {"nan_guard"} if name == "reward_all_failed" else set()  # (nan_guard counts failing rewards too)
    assert names <= {name, "zero_variance_groups"} | also, names  # and no other monitor is fooled by it


TURN_MONITORS = ("env_errors", "tool_errors", "turn_truncation", "malformed_calls")


def _multi_turn_history(**late: float) -> list[dict]:
    """A healthy history of a calculator run with turn metrics; ``late`` overrides them on the last 8 steps."""
    h = _healthy_history()
    for i, m in enumerate(h):
        m.update({"turns/per_episode": 1.8, "turns/tool_calls": 0.9, "turns/tool_success": 0.95,
                  "turns/malformed_calls": 0.1, "turns/env_errors": 0.0, "turns/truncated_turns": 0.05})
        if i >= len(h) - 8:
            m.update({f"turns/{k}": v for k, v in late.items()})
    return h


def test_turn_monitors_do_not_fire_on_healthy_multi_turn_metrics_and_fire_past_their_thresholds():
    cfg = load_config(None, ["rollout.max_new_tokens=32", "environment={name: calculator}",
                             "task={name: calculator}", "rewards=[{name: environment}]"]).model_dump(mode="json")

    def fired(h):
        per_step, final = _run_watchdog(h, cfg)
        return {a.name: a for al in per_step for a in al} | {a.name: a for a in final}

    assert fired(_multi_turn_history()) == {}
    # at the thresholds minus a bit: quiet; at them: the one alarm, with the numbers and the config to change
    below = {"env_errors": 0.04, "tool_success": 0.71, "truncated_turns": 0.29, "malformed_calls": 0.49}
    assert fired(_multi_turn_history(**below)) == {}
    a = fired(_multi_turn_history(env_errors=0.05))
    assert set(a) == {"env_errors"} and a["env_errors"].severity == "error"
    assert "'calculator' raised 0.05 times per episode" in a["env_errors"].message
    a = fired(_multi_turn_history(tool_success=0.7))
    assert set(a) == {"tool_errors"} and "30% of tool calls failed" in a["tool_errors"].message
    a = fired(_multi_turn_history(truncated_turns=0.3))
    assert set(a) == {"turn_truncation"} and "environment.max_total_tokens=256" in a["turn_truncation"].message
    a = fired(_multi_turn_history(malformed_calls=0.5))
    assert set(a) == {"malformed_calls"} and "0.50 malformed tool calls per episode" in a["malformed_calls"].message
    # thresholds and patience come from diagnostics.<monitor>
    quiet = load_config(None, ["environment={name: calculator}", "task={name: calculator}",
                               "rewards=[{name: environment}]", "diagnostics.malformed_calls.max_per_episode=0.8",
                               "diagnostics.tool_errors.patience=9"]).model_dump(mode="json")
    for h in (_multi_turn_history(malformed_calls=0.5), _multi_turn_history(tool_success=0.5)):
        per_step, _ = _run_watchdog(h, quiet)
        assert not any(al for al in per_step)


def _reward_down(h: list[dict], steps: range) -> list[dict]:
    """``h`` with every reward failing at ``steps`` (1-based) as the trainer logs such a step: no valid row, reward
    NaN, the update's statistics logged as 0 (nothing was measured), every group 'zero-variance'."""
    for m in h:
        if m["step"] in steps:
            m.update({"valid": 0.0, "reward/mean": float("nan"), "reward/group_std": 0.0, "entropy": 0.0,
                      "zero_variance_groups/frac": 1.0, "zero_variance_groups/all_correct": 0.0,
                      "zero_variance_groups/all_wrong": 0.0, "reward/nanr/failure_rate": 1.0,
                      "reward/nanr/failures": 64.0, "pg_loss": 0.0, "kl": 0.0, "grad_norm": 0.0})
            m.pop("accuracy", None), m.pop("pass@1", None), m.pop("pass@8", None)
        else:
            m.update({"valid": 1.0, "reward/nanr/failure_rate": 0.0, "reward/nanr/failures": 0.0})
    return h


def test_a_step_where_no_reward_is_finite_is_no_entropy_collapse_nor_zero_variance():
    # scripts/alarm_rates.py, a reward returning NaN on every completion: entropy_collapse and zero_variance_groups
    # fired at step 3 (patience 3) on the 0.0 entropy and the 100% 'identical' groups of steps where nothing trained
    per_step, _ = _run_watchdog(_reward_down(_healthy_history(), range(1, 31)))
    first = {}
    for i, al in enumerate(per_step):
        for a in al:
            first.setdefault(a.name, i + 1)
    assert first == {"reward_all_failed": 1, "nan_guard": 1}, first
    nan = per_step[0][[a.name for a in per_step[0]].index("nan_guard")]
    assert "no completion got a finite reward" in nan.message and "probe-reward" in nan.fix
    # a reward outage of 4 steps in the middle of a healthy run: no alarm but the reward's, and the entropy
    # baseline after it is still the healthy one (a 95% drop from it fires)
    h = _reward_down(_healthy_history(), range(12, 16))
    per_step, _ = _run_watchdog(h)
    names = {a.name for al in per_step for a in al}
    assert names == {"reward_all_failed", "nan_guard"}, names
    h = _reward_down(_healthy_history(), range(2, 6))
    for m in h[-4:]:
        m["entropy"] = 0.04  # < 5% of the mean of the 5 first *trained* steps (about 0.97)
    per_step, _ = _run_watchdog(h)
    assert [i + 1 for i, al in enumerate(per_step) if any(a.name == "entropy_collapse" for a in al)] == [29, 30]


def test_one_completion_per_prompt_is_no_zero_variance_group():
    # scripts/alarm_rates.py, the ppo recipe (group_size 1, a critic's baseline): every 'group' holds one reward, so
    # zero_variance_groups/frac is 1 and reward/group_std 0 at every step; zero_variance_groups fired at step 3 of
    # every healthy run
    h = _healthy_history()
    for m in h:
        m.update({"zero_variance_groups/frac": 1.0, "zero_variance_groups/all_wrong": 0.7,
                  "zero_variance_groups/all_correct": 0.3, "reward/group_std": 0.0, "reward/std": 0.45})
        for k in ("pass@8", "length/reward_corr"):
            m.pop(k)
    ppo = load_config(None, ["rollout.group_size=1", "advantage={name: gae}"]).model_dump(mode="json")
    per_step, final = _run_watchdog(h, ppo)
    assert not any(per_step) and not final, [a.text() for al in per_step for a in al]
    grpo = load_config(None, ["rollout.group_size=8"]).model_dump(mode="json")  # with groups: the same rows fire
    assert {a.name for al in _run_watchdog(h, grpo)[0] for a in al} == {"zero_variance_groups"}


def _kl_steps(kls: list[float], config: dict | None = None) -> list[int]:
    h = _healthy_history(len(kls))
    for m, kl in zip(h, kls):
        m["kl"] = kl
    per_step, _ = _run_watchdog(h, config)
    return [i + 1 for i, al in enumerate(per_step) if any(a.name == "kl_blowup" for a in al)]


def test_kl_blowup_reads_a_smoothed_kl_and_no_growth_from_the_first_step():
    # the KL of a healthy grpo run of scripts/alarm_rates.py (nano model, 64 completions a step; steps 24-25 from
    # another seed's single-step spike): kl_blowup fired at step 12 (0.128 = 16 x step 2's 0.008, the growth from a
    # KL that starts at 0) and at step 25 (one step at 0.513 between 0.32 and 0.18)
    healthy = [0.0, 0.008, 0.028, 0.046, 0.067, 0.067, 0.021, 0.084, 0.127, 0.048, 0.158, 0.128, 0.049, 0.11, 0.15,
               0.082, 0.235, 0.237, 0.161, 0.171, 0.144, 0.166, 0.115, 0.323, 0.513, 0.175, 0.24, 0.24, 0.19, 0.2]
    assert _kl_steps(healthy) == []
    one = load_config(None, ["diagnostics.kl_blowup.smooth=1"]).model_dump(mode="json")
    assert _kl_steps(healthy, one) == [12, 17, 25]  # smooth=1: each step's own KL, as before
    # learning rate 100x too high (the lr_100x runs): at the first step after the first update
    assert _kl_steps([0.0, 5.18, 8.66, 9.02] + [9.0] * 6)[:1] == [2]
    # a sudden growth from an established KL: 0.03 then 0.4 from step 16; the means of 3 steps pass 10x at step 18
    assert _kl_steps([0.0] + [0.03] * 14 + [0.4] * 10)[:1] == [18]


def test_alarm_texts_name_the_config_to_change():
    per_step, _ = _run_watchdog(_broken("truncation"))
    a = next(a for al in per_step for a in al if a.name == "truncation")
    assert "96% of completions truncated at rollout.max_new_tokens=32" in a.message
    assert "0.00 vs 0.41" in a.message and "raise rollout.max_new_tokens (now 32)" in a.fix
    h = _broken("zero_variance_groups")
    for m in h:
        m.update({"zero_variance_groups/all_wrong": 0.05, "zero_variance_groups/all_correct": 0.9})
    per_step, _ = _run_watchdog(h)
    a = next(a for al in per_step for a in al if a.name == "zero_variance_groups")
    assert a.severity == "info" and "solved" in a.cause


def test_patience_and_thresholds_come_from_config():
    h = _broken("truncation")
    cfg = load_config(None, ["diagnostics.truncation.max_frac=0.99"]).model_dump(mode="json")
    per_step, _ = _run_watchdog(h, cfg)
    assert not any(a.name == "truncation" for al in per_step for a in al)
    cfg = load_config(None, ["diagnostics.truncation.patience=5"]).model_dump(mode="json")
    per_step, _ = _run_watchdog(h, cfg)
    assert [i for i, al in enumerate(per_step) if any(a.name == "truncation" for a in al)][0] == 4
    cfg = load_config(None, ["diagnostics.enabled=false"]).model_dump(mode="json")
    assert not any(_run_watchdog(h, cfg)[0])


def test_proxy_gold_gap_against_held_out_evaluations():
    h = _healthy_history(12)
    for i, m in enumerate(h):
        m["reward/mean"] = 0.2 + 0.05 * i
        m.pop("accuracy")
    evals = [{"step": 0, "tag": "before", "accuracy": 0.30, "pass@1": 0.3, "pass@4": 0.6},
             {"step": 12, "tag": "after", "accuracy": 0.28, "pass@1": 0.32, "pass@4": 0.45}]
    _, final = _run_watchdog(h, evals=evals)
    names = {a.name: a for a in final}
    assert "proxy_gold_gap" in names and "held-out accuracy went 0.30 -> 0.28" in names["proxy_gold_gap"].message
    assert "pass_at_k" in names and "pass@4 fell 0.60 -> 0.45" in names["pass_at_k"].message


def test_proxy_gold_gap_is_quiet_when_the_environment_reward_is_the_gold():
    """A multi-turn run trained on the environment's reward is evaluated by the same reward (episode success):
    held-out accuracy at its ceiling (greedy 1.0 -> 0.94) while the sampled success rises is no reward hacking."""
    h = _healthy_history(12)
    for i, m in enumerate(h):
        m["reward/mean"] = 0.4 + 0.05 * i
        m.pop("accuracy")
    evals = [{"step": 0, "tag": "before", "accuracy": 1.0, "scored_by": "environment"},
             {"step": 12, "tag": "after", "accuracy": 0.94, "scored_by": "environment"}]
    base = ["environment={name: calculator}", "task={name: calculator}"]
    cfg = load_config(None, base + ["rewards=[{name: environment}]"]).model_dump(mode="json")
    assert not any(a.name == "proxy_gold_gap" for a in _run_watchdog(h, cfg, evals)[1])
    cfg = load_config(None, base + ["rewards=[{name: environment}, {name: format}]"]).model_dump(mode="json")
    assert any(a.name == "proxy_gold_gap" for a in _run_watchdog(h, cfg, evals)[1])


def test_proxy_gold_gap_is_quiet_when_the_gold_is_at_its_ceiling_and_stays():
    """A proxy reward (tool_call) rising while greedy held-out accuracy stays at 1.0 -> 1.0 (no room to rise) is
    not hacking; the same rise with the gold falling 1.0 -> 0.9 is flagged."""
    h = _healthy_history(12)
    for i, m in enumerate(h):
        m["reward/mean"] = 2.0 + 0.1 * i
        m.pop("accuracy")
    cfg = load_config(None, ["rewards=[{name: tool_call}, {name: correct, weight: 0.0}]"]).model_dump(mode="json")
    flat = [{"step": 0, "tag": "before", "accuracy": 1.0}, {"step": 12, "tag": "after", "accuracy": 1.0}]
    assert not any(a.name == "proxy_gold_gap" for a in _run_watchdog(h, cfg, flat)[1])
    fell = [{"step": 0, "tag": "before", "accuracy": 1.0}, {"step": 12, "tag": "after", "accuracy": 0.9}]
    assert any(a.name == "proxy_gold_gap" for a in _run_watchdog(h, cfg, fell)[1])


def test_stale_config_keys_fall_back_to_defaults():
    w = Watchdog({"diagnostics": {"truncation": {"max_frac": 0.5, "old_key": 1}, "gone_monitor": {}}})
    assert w.cfg.truncation.max_frac == 0.5 and w.cfg.zero_variance_groups == DiagnosticsConfig().zero_variance_groups


# ------------------------------------------------------------------------------------------------ real runs
DOCUMENTED = re.compile(r"`([A-Za-z_@0-9]+(?:/[A-Za-z_@0-9<>]+)*)`")


def test_healthy_run_logs_every_metric_and_raises_no_alarm(runs):
    run = runs("healthy")
    ms = rows(run)
    assert len(ms) == 6
    assert fired(run) == {}, [a["message"] for m in ms for a in m["alarms"]]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["alarms"] == {}
    last = ms[-1]
    for key in ("reward/correct/std", "zero_variance_groups/all_wrong", "advantages/distinct_frac",
                "advantages/collapse", "length/terminated_mean", "truncated/frac", "entropy", "tokens/low_prob_frac",
                "ratio/mean", "ratio/min", "ppo_kl", "grad_norm_max", "mismatch/logp_abs_mean", "mismatch/kl",
                "throughput/generation", "throughput/reward", "throughput/update", "memory/rss_peak_gb", "pass@8"):
        assert key in last, key
    assert last["throughput/generation"] > 0 and last["memory/rss_peak_gb"] > 0.05
    assert last["mismatch/logp_abs_mean"] < 1e-4  # the HF sampler and the trainer are the same program
    assert any("stability/sharpness" in m for m in ms) and all(m.get("stability/ratio", 0) < 1 for m in ms)
    assert all((m.get("time/sharpness", 0) > 0) == ("stability/sharpness" in m) for m in ms)  # its cost, logged
    # every logged key is documented in docs/metrics.md
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(DOCUMENTED.findall(doc))
    generic = {re.sub(r"reward/[a-z_]+/", "reward/<name>/", k) for k in last}
    generic = {"pass@G" if re.fullmatch(r"pass@\d+", k) and k != "pass@1" else k for k in generic}
    missing = sorted(k for k in generic if k not in documented and k not in ("step", "alarms")
                     and not k.startswith(("reg/", "tis/")))
    assert not missing, f"undocumented metrics: {missing}"
    assert diagnose(run).alarms == []


def test_truncation_run(runs):
    run = runs("truncation")
    assert "truncation" in fired(run)
    a = next(a for m in rows(run) for a in m["alarms"] if a["name"] == "truncation")
    assert "truncated at rollout.max_new_tokens=1" in a["message"]
    d = diagnose(run)
    assert d.primary["name"] == "truncation" and d.status == "finished"


def test_nan_guard_skips_counts_and_saves(runs):
    run = runs("nan")
    ms = rows(run)
    assert len(ms) == 5  # the run went on
    assert [m["nan_guard/skipped"] for m in ms] == [0, 0, 1, 1, 0]
    assert ms[-1]["nan_guard/skipped_total"] == 2
    assert fired(run)["nan_guard"] == [3, 4]
    saved = torch.load(run / "bad_batches" / "step-3.pt", weights_only=False)
    assert saved["step"] == 3 and not math.isfinite(saved["grad_norm"]) and saved["completion_ids"].shape[0] == 32
    from postrl.train.checkpoint import latest_checkpoint
    from safetensors.torch import load_file

    weights = load_file(next(latest_checkpoint(run).rglob("*.safetensors")))
    assert all(torch.isfinite(w).all() for w in weights.values())  # the NaN never reached the weights
    d = diagnose(run)
    assert d.primary["name"] == "nan_guard" and d.primary["severity"] == "error"
    assert "bad_batches/step-3.pt" in d.primary["message"] or "bad_batches" in " ".join(d.notes)


def test_advantage_collapse_run(runs):
    run = runs("collapse")
    ms = rows(run)
    assert all(m["advantages/collapse"] >= 0.25 for m in ms)
    assert "advantage_collapse" in fired(run)
    assert diagnose(run).primary["name"] == "advantage_collapse"
    assert "advantage: {name: gdpo}" in diagnose(run).primary["fix"]


def test_logprob_mismatch_run(runs):
    run = runs("mismatch")
    assert all(m["mismatch/logp_abs_mean"] > 0.05 for m in rows(run))
    assert "logprob_mismatch" in fired(run)
    d = diagnose(run)
    assert d.primary["name"] == "logprob_mismatch" and "dropout" in d.primary["fix"]


def test_unstable_run(runs):
    run = runs("unstable")
    f = fired(run)
    assert {"edge_of_stability", "kl_blowup"} <= set(f), f
    ms = rows(run)
    assert any(m["stability/ratio"] >= 1 for m in ms) and all(m["stability/threshold"] == pytest.approx(38 / 0.03)
                                                              for m in ms)
    assert diagnose(run).primary["name"] == "edge_of_stability"


def test_no_signal_run(runs):
    run = runs("no_signal")
    f = fired(run)
    assert "zero_variance_groups" in f and "pass_at_k" in f, f
    d = diagnose(run)
    assert d.primary["name"] == "zero_variance_groups" and "too hard" in d.primary["cause"]


def test_doctor_reads_crashed_and_running_runs(runs, tmp_path):
    src = runs("truncation")
    crashed = tmp_path / "crashed"
    shutil.copytree(src, crashed)
    (crashed / "summary.json").unlink()
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # a line cut by the crash
    old = time.time() - 3600
    import os

    os.utime(crashed / "metrics.jsonl", (old, old))
    d = diagnose(crashed)
    assert d.status == "stopped" and d.run.steps_done == 3 and d.primary["name"] == "truncation"
    os.utime(crashed / "metrics.jsonl")
    assert diagnose(crashed).status == "running"
    assert main(["doctor", str(crashed), "--json"]) == 0


# ------------------------------------------------------------------------------------------------ commands
def test_samples_command(runs, capsys):
    run = runs("truncation")
    assert main(["samples", str(run), "--alarm", "truncation", "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out and sum(r["truncated"] for r in out) > len(out) / 2
    assert main(["samples", str(run), "--step", "1", "--min-reward", "0.5", "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(r["reward"] >= 0.5 and r["step"] == 1 for r in out)
    assert main(["samples", str(run), "--step", "3"]) == 2
    assert "no samples logged at that step" in capsys.readouterr().err
    assert main(["samples", str(run), "--alarm", "kl_blowup"]) == 2
    assert main(["samples", str(run)]) == 0
    assert "truncated" in capsys.readouterr().out


def test_reward_probe(capsys):
    from postrl.config import RewardSpec
    from postrl.data import load_source
    from postrl.diagnostics.probe import run_probe

    rows_ = load_source({"name": "arithmetic", "digits": 2}).eval_rows(6, 0)
    specs = [RewardSpec(name="correct"), RewardSpec(name="format", weight=0.2), RewardSpec(name="numeric")]
    res = run_probe(rows_, specs)
    pay = res.mean
    assert pay["answer_only"]["correct"] == 1.0 and pay["gold"]["numeric"] == 1.0
    for probe in ("empty", "tag_spam", "repeated_answer", "hedged", "prompt_echo", "very_long", "format_only"):
        assert pay[probe]["correct"] == 0.0, probe  # the arithmetic verifier pays for none of them
    assert pay["format_only"]["format"] == 1.0  # a format reward pays for a wrong answer in the right format
    # the probe found numeric paying for hedges ("8 or 9 or 7") and repeated answers; the hedge guard closed that
    for probe in ("hedged", "hedged_first", "hedged_in_tags", "repeated_answer"):
        assert pay[probe]["numeric"] == 0.0, probe
    # a correct answer after filler is right, not hedged: length is the length shaping's business, not the verifier's
    assert pay["padded_answer"]["numeric"] == 1.0
    assert main(["probe-reward", "--task", "arithmetic", "--fail-on-pay", "0.5"]) == 0  # correct + 0.2 format
    assert main(["probe-reward", "--task", "arithmetic", "--reward", "numeric", "--fail-on-pay", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "padded_answer (1.00)" in err and "hedged" not in err
    assert main(["probe-reward", "--task", "arithmetic", "--reward", "nope"]) == 2


def test_console_prints_new_alarms_once():
    from rich.console import Console

    from postrl.report.console import ConsoleReporter

    con = Console(record=True, width=200, force_terminal=False)
    rep = ConsoleReporter(["correct"], console=con)
    rep.start(3, 0, None)
    alarm = {"name": "truncation", "message": "96% of completions truncated", "cause": "c", "fix": "raise it",
             "severity": "warn", "step": 2}
    for s, al in ((1, []), (2, [alarm]), (3, [alarm])):
        rep.step({"step": s, "reward/mean": 0.1, "alarms": al})
    rep.finish({"after": {"accuracy": 0.5, "n": 4}, "before": None, "run_dir": "x", "alarms": {}})
    text = con.export_text()
    assert text.count("ALARM step 2 truncation: 96% of completions truncated") == 1
    assert "alarms=truncation" in text and "alarms raised: truncation (steps 2-3)" in text


# ------------------------------------------------------------------------------------------------ sinks
def _sink_roundtrip(name: str, tmp_path: Path):
    from postrl.diagnostics.sinks import make_sinks

    cfg = load_config(None, []).model_dump(mode="json")
    (sink,) = make_sinks([name], tmp_path, cfg, run_name="t", project="postrl-test")
    for s in (1, 2):
        sink.log({"reward/mean": 0.1 * s, "pass@4": 0.5, "length/reward_corr": float("nan"), "step": s}, s)
    sink.log_alarms([{"name": "truncation", "message": "m"}], 2)
    sink.close()


def test_tensorboard_sink(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _sink_roundtrip("tensorboard", tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx([0.1, 0.2])
    assert [e.step for e in acc.Scalars("alarm/truncation")] == [2]
    assert "length/reward_corr" not in acc.Tags()["scalars"]  # NaN is not logged


def test_mlflow_sink(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    _sink_roundtrip("mlflow", tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("postrl-test")
    (run,) = client.search_runs([exp.experiment_id])
    hist = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == pytest.approx([0.1, 0.2])
    assert client.get_metric_history(run.info.run_id, "pass_at_4")
    from postrl.config import Config

    assert run.data.params["optim.lr"] == str(Config().optim.lr) and run.info.status == "FINISHED"


def test_wandb_sink_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _sink_roundtrip("wandb", tmp_path)
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1  # an offline run, synced later with `wandb sync`
    data = files[0].read_bytes()  # the run's protobuf records: history keys and the config
    for key in (b"reward/mean", b"pass@4", b"alarm/truncation", b"max_new_tokens"):
        assert key in data, key


def test_sinks_from_config_in_a_run(models, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "tb"
    cfg = load_config(None, [f"model.path={models['sft']}", f"output_dir={out}", *BASE, "train.steps=2",
                             "logging.sinks=[tensorboard]"])
    Trainer(cfg, out).train()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert "eval/accuracy" in acc.Tags()["scalars"]
    with pytest.raises(Exception, match="logging.sinks"):
        load_config(None, ["logging.sinks=[comet]"])


def _prefix_clashes(keys) -> list[tuple[str, str]]:
    """Pairs (a, b) where key a is also the '/'-prefix of key b (a file and a folder of the same name for MLflow's
    file store and TensorBoard's tag folders)."""
    ks = sorted(keys)
    return [(a, b) for a in ks for b in ks if b.startswith(a + "/")]


def test_no_metric_key_is_a_prefix_of_another(runs):
    run = runs("healthy")  # every batch metric, the update's, the stability probe's, throughput and memory
    keys = {k for m in rows(run) for k in m} - {"step", "alarms"}
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    keys |= {f"eval/{k}" for e in evals for k in e if k not in ("step", "tag", "n")}  # what the sinks get
    assert {"truncated/frac", "truncated/reward_mean", "zero_variance_groups/frac", "grad_norm_max",
            "stability/sharpness", "eval/accuracy"} <= keys
    assert _prefix_clashes(keys) == []


def test_mlflow_sink_in_a_real_run(models, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "ml"
    cfg = load_config(None, [f"model.path={models['sft']}", f"output_dir={out}", *BASE, "train.steps=2",
                             "logging.sinks=[mlflow]"])
    Trainer(cfg, out).train()
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("postrl").experiment_id])
    assert run.info.status == "FINISHED"
    logged = rows(out)
    for key in ("truncated/frac", "zero_variance_groups/frac", "zero_variance_groups/all_wrong", "reward/mean",
                "grad_norm", "grad_norm_max"):
        hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in hist] == [1, 2], key
        assert [m.value for m in hist] == pytest.approx([r[key] for r in logged]), key
    finite = [r["step"] for r in logged if math.isfinite(r["truncated/reward_mean"])]  # NaN is not logged
    assert [m.step for m in client.get_metric_history(run.info.run_id, "truncated/reward_mean")] == finite
    assert client.get_metric_history(run.info.run_id, "eval/accuracy")


def test_config_yaml_records_diagnostics(runs):
    text = (runs("truncation") / "config.yaml").read_text()
    assert "diagnostics:" in text and "max_frac" in text
    assert dump_yaml(load_config(None, []))  # round-trips
