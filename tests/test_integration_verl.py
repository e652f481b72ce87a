"""The verl plug-in (postrl.integrations.verl) against verl's own registries, call paths and config schema, on CPU."""

import math
import re
import os
import shlex
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")  # postrl[verl]; the entry point loads the plug-in during this import

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos, metric_utils  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

from postrl import registry  # noqa: E402
from postrl.advantages import grpo  # noqa: E402
from postrl.advantages.outcome import rloo  # noqa: E402
from postrl.cli import main as cli_main  # noqa: E402
from postrl.errors import ConfigError, PostrlError  # noqa: E402
from postrl.integrations import verl as plugin  # noqa: E402
from postrl.losses import aggregation, policy  # noqa: E402

VERL_CONFIG = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


@pytest.fixture
def postrl_config(tmp_path, monkeypatch):
    """Write a postrl YAML and point $POSTRL_CONFIG at it (the plug-in's caches are per path)."""

    def write(text: str, name: str = "run.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        monkeypatch.setenv(plugin.ENV_CONFIG, str(path))
        return str(path)

    return write


def _registered_in_subprocesses(*envs: dict) -> list[str]:
    """What a fresh process that imports verl under each environment finds at two postrl names (run at once)."""
    code = ("from verl.trainer.ppo import core_algos as c\n"
            "a = c.ADV_ESTIMATOR_REGISTRY.get('postrl_gdpo'); l = c.POLICY_LOSS_REGISTRY.get('postrl_dispo')\n"
            "print(getattr(a, 'postrl_stage', None), getattr(l, 'postrl_stage', None))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", plugin.ENV_CONFIG)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**base, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        out.append(stdout.strip().splitlines()[-1])
    return out


# ------------------------------------------------------------------------------------------------ loading


def test_entry_point_loads_the_plugin_in_this_process():
    """This process imported verl with VERL_USE_EXTERNAL_PLUGINS unset: the verl.plugins entry point loaded postrl."""
    assert "VERL_USE_EXTERNAL_MODULES" not in os.environ
    for kind, names in plugin.expected_names().items():
        assert len(names) == len(registry.names(kind)) > 5
        get = core_algos.get_adv_estimator_fn if kind == "advantage" else core_algos.get_policy_loss_fn
        for vname in names:
            assert get(vname).postrl_stage == (kind, vname[len(plugin.PREFIX):])
    # verl's own names still map to verl's functions
    assert core_algos.get_adv_estimator_fn("grpo") is core_algos.compute_grpo_outcome_advantage
    assert core_algos.get_policy_loss_fn("vanilla") is core_algos.compute_policy_loss_vanilla
    assert core_algos.get_policy_loss_fn("gspo") is core_algos.compute_policy_loss_gspo


def test_both_loading_routes_and_neither():
    found = "('advantage', 'gdpo') ('loss', 'dispo')"
    assert _registered_in_subprocesses(
        {"VERL_USE_EXTERNAL_PLUGINS": "none"},  # neither route: verl alone
        {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "postrl.integrations.verl"},
        {"VERL_USE_EXTERNAL_PLUGINS": "postrl"},  # the entry point, by its name
    ) == ["None None", found, found]


def test_register_is_idempotent_and_never_overwrites_a_foreign_name():
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    plugin.register()
    assert core_algos.POLICY_LOSS_REGISTRY == before
    own = core_algos.POLICY_LOSS_REGISTRY["postrl_ppo_clip"]

    def foreign(*a, **k):
        return None

    core_algos.POLICY_LOSS_REGISTRY["postrl_ppo_clip"] = foreign
    try:
        with pytest.raises(PostrlError, match="verl already registers loss 'postrl_ppo_clip'"):
            plugin.register()
        assert core_algos.POLICY_LOSS_REGISTRY["postrl_ppo_clip"] is foreign
        with pytest.raises(PostrlError, match="postrl_ppo_clip"):
            plugin.check_registered()
    finally:
        core_algos.POLICY_LOSS_REGISTRY["postrl_ppo_clip"] = own
    plugin.check_registered()


def test_a_failing_load_is_loud(capsys, monkeypatch):
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "postrl_rloo", lambda **k: None)
    with pytest.raises(PostrlError):
        plugin.load()
    assert "postrl verl plug-in failed to load: PostrlError: verl already registers advantage 'postrl_rloo'" \
        in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ advantages


def _adv_batch():
    torch.manual_seed(0)
    n, t = 8, 5
    mask = torch.ones(n, t)
    mask[1, 3:] = 0
    mask[6, 1:] = 0
    scores = torch.zeros(n, t)
    reward = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 2.0])
    last = mask.sum(-1).long() - 1
    scores[torch.arange(n), last] = reward
    uid = np.array(["a", "a", "a", "b", "b", "b", "b", "c"], dtype=object)
    data = DataProto.from_dict(tensors={"token_level_rewards": scores, "response_mask": mask},
                               non_tensors={"uid": uid})
    return data, reward, torch.tensor([0, 0, 0, 1, 1, 1, 1, 2]), mask


def test_grpo_through_verl_compute_advantage_equals_postrl():
    data, reward, gids, mask = _adv_batch()
    out = compute_advantage(data, adv_estimator="postrl_grpo", config=AlgoConfig())
    want = grpo(reward, gids).unsqueeze(-1) * mask
    torch.testing.assert_close(out.batch["advantages"], want, rtol=0, atol=0)
    torch.testing.assert_close(out.batch["returns"], want, rtol=0, atol=0)
    # by hand: group a = (1, 0, 1): mean 2/3, std sqrt(1/3); a singleton group (c) has advantage 0 in postrl
    s = (1 / 3) ** 0.5
    assert out.batch["advantages"][0, 0].item() == pytest.approx((1 - 2 / 3) / (s + 1e-6), rel=1e-6)
    assert out.batch["advantages"][1, 0].item() == pytest.approx((0 - 2 / 3) / (s + 1e-6), rel=1e-6)
    assert out.batch["advantages"][1, 3:].abs().sum() == 0
    assert out.batch["advantages"][7].abs().sum() == 0


def test_estimator_parameters_come_from_the_postrl_config(postrl_config):
    data, reward, gids, mask = _adv_batch()
    postrl_config("advantage: {name: grpo, scale: none}\n")
    out = compute_advantage(data, adv_estimator="postrl_grpo", config=AlgoConfig())
    torch.testing.assert_close(out.batch["advantages"], grpo(reward, gids, scale="none").unsqueeze(-1) * mask)
    assert out.batch["advantages"][0, 0].item() == pytest.approx(1 / 3, rel=1e-6)
    # another estimator, called by keyword as verl's trainer calls any non-GAE estimator
    fn = core_algos.get_adv_estimator_fn("postrl_rloo")
    adv, ret = fn(token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
                  config=AlgoConfig(), index=data.non_tensor_batch["uid"])
    torch.testing.assert_close(adv, rloo(reward, gids).unsqueeze(-1) * mask)


def test_a_wrong_parameter_or_an_unavailable_field_is_one_line(postrl_config):
    postrl_config("advantage: {name: grpo, scael: none}\n", "bad.yaml")
    with pytest.raises(ConfigError, match="unknown parameter 'scael' for advantage 'grpo'"):
        plugin.run_config()
    postrl_config("advantage: {name: rl_zvp}\n", "zvp.yaml")
    data, *_ = _adv_batch()
    with pytest.raises(ConfigError, match="reads batch field 'token_entropy', which verl's trainer does not pass"):
        compute_advantage(data, adv_estimator="postrl_rl_zvp", config=AlgoConfig())


# ------------------------------------------------------------------------------------------------ policy losses


def _actor_config(**global_batch_info):
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_dir(config_dir=VERL_CONFIG, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.global_batch_info.update(global_batch_info)
    return actor


@pytest.fixture(scope="module")
def loss_inputs():
    torch.manual_seed(1)
    n, t = 6, 7
    old = torch.randn(n, t) * 0.3 - 1.0
    logp = (old + torch.randn(n, t) * 0.2).requires_grad_(True)
    adv = torch.randn(n, 1).expand(n, t).contiguous()
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[0, 4:] = False
    mask[3, 2:] = False
    mask[5, 6:] = False
    return old, logp, adv, mask


@pytest.mark.parametrize("agg,mode", [("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean"),
                                      ("seq_mean_token_sum", "seq-mean-token-sum")])
def test_policy_loss_equals_postrl_and_does_not_change_with_parallelism(loss_inputs, agg, mode, postrl_config):
    old, logp, adv, mask = loss_inputs
    postrl_config(f"loss: {{name: dispo, agg: {agg}}}\n", f"{agg}.yaml")
    fn = core_algos.get_policy_loss_fn("postrl_dispo")
    # postrl: sum(w * L), w the aggregation's weights over the whole batch
    L, _ = policy.dispo(logp, old, adv)
    want = (registry.get("aggregation", agg)(mask.float()) * L).sum()
    got, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=mode,
                      config=_actor_config(), rollout_is_weights=None)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert set(metrics) >= {"actor/postrl/ratio_max"}
    (g_full,) = torch.autograd.grad(got, logp)
    # two data-parallel ranks with verl's global batch info: the mean of their losses (what DDP/FSDP averages)
    # is the whole batch's loss, and so is the gradient
    info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()), "global_batch_size": int(mask.any(-1).sum()),
            "loss_scale_factor": None}
    cfg = _actor_config(**info)
    parts = [fn(old_log_prob=old[s], log_prob=logp[s], advantages=adv[s], response_mask=mask[s],
                loss_agg_mode=mode, config=cfg, rollout_is_weights=None)[0] for s in (slice(0, 2), slice(2, 6))]
    total = (parts[0] + parts[1]) / 2
    torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-7)
    (g_dp,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g_dp, g_full, rtol=1e-6, atol=1e-8)


def test_policy_loss_applies_rollout_is_weights_and_checks_the_aggregation(loss_inputs, postrl_config):
    old, logp, adv, mask = loss_inputs
    postrl_config("loss: {name: ppo_clip, eps_high: 0.28, agg: token_mean}\n", "clip.yaml")
    fn = core_algos.get_policy_loss_fn("postrl_ppo_clip")
    w = torch.rand_like(old) + 0.5
    L, _ = policy.ppo_clip(logp, old, adv, eps_high=0.28)
    want = (aggregation.token_mean(mask.float()) * L * w).sum()
    got, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
                config=_actor_config(), rollout_is_weights=w)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="loss_agg_mode is 'seq-mean-token-mean' but postrl loss.agg=token_mean"):
        fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
           loss_agg_mode="seq-mean-token-mean", config=_actor_config(), rollout_is_weights=None)


# ------------------------------------------------------------------------------------------------ rewards


def test_compute_score_runs_postrl_rewards_with_fault_isolation(tmp_path, monkeypatch, postrl_config):
    mod = tmp_path / "verl_test_rewards.py"
    mod.write_text("def picky(prompts, completions, **kw):\n"
                   "    return [1.0 if c.strip() == '7' else float('nan') for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    postrl_config("""
        rewards:
          - {name: exact, weight: 2.0}
          - {name: 'verl_test_rewards:picky', weight: 0.5}
        """, "rewards.yaml")
    out = plugin.compute_score("openai/gsm8k", "7", "7", extra_info={"index": 3})
    assert out == {"score": 2.0 * 1.0 + 0.5 * 1.0, "exact": 1.0, "verl_test_rewards:picky": 1.0,
                   "postrl_failed": 0.0}
    out = plugin.compute_score("openai/gsm8k", "8", "7", extra_info={})
    assert out["exact"] == 0.0 and np.isnan(out["verl_test_rewards:picky"]) and np.isnan(out["score"])
    assert out["postrl_failed"] == 1.0
    # verl's own loader finds it by the path the export writes
    from verl.utils.import_utils import load_extern_object

    assert load_extern_object("pkg://postrl.integrations.verl", "compute_score") is plugin.compute_score


@pytest.mark.parametrize("overrides,message", [
    (["model.teacher.path=/t", "regularizers=[{name: distill}]"],
     "regularizer 'distill' reads teacher_logp, a teacher model's log-probs, which the verl plug-in cannot give; use "
     "verl's own on-policy distillation"),
    (["loss.name=rl_plus", "filters=[{name: demonstrations}]"], "loss 'rl_plus' reads batch field 'demonstration'"),
])
def test_teacher_and_demonstrations_are_refused_for_verl(overrides, message):
    from postrl.config import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        plugin.check_config(load_config(None, ["rewards=[{name: correct}]", *overrides]))


def test_group_shaping_is_refused_for_verl(postrl_config):
    postrl_config("shaping: [{name: weighted_sum}]\n", "rowwise.yaml")
    plugin.check_config(plugin.run_config())  # row-wise shaping: accepted
    postrl_config("shaping: [{name: weighted_sum}, {name: kimi_length}]\n", "kimi.yaml")
    with pytest.raises(ConfigError, match="shaping 'kimi_length' needs a group of completions"):
        plugin.check_config(plugin.run_config())


# ------------------------------------------------------------------------------------------------ diagnostics


def _metrics_batch(reward_row):
    n, t = 4, 6
    mask = torch.ones(n, t)
    mask[0, 3:] = 0
    scores = torch.zeros(n, t)
    scores[:, 0] = torch.tensor(reward_row)
    lp = torch.full((n, t), -0.5)
    return DataProto.from_dict(
        tensors={"token_level_scores": scores, "token_level_rewards": scores, "advantages": scores * 0,
                 "returns": scores * 0, "response_mask": mask, "old_log_probs": lp,
                 "rollout_log_probs": lp - 0.1, "ref_log_prob": lp - 1.0,
                 "prompts": torch.ones(n, 3, dtype=torch.long), "responses": torch.ones(n, t, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(n, 3), mask], -1).long()},
        non_tensors={"uid": np.array(["p", "p", "q", "q"], dtype=object)})


def test_batch_metrics_from_verl_batch():
    m = plugin.batch_metrics(_metrics_batch([1.0, 1.0, 0.0, 0.0]))
    assert m["zero_variance_groups/frac"] == 1.0
    assert m["entropy"] == pytest.approx(0.6)  # mean -log p of the sampled (rollout) tokens
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.1)
    assert m["kl"] == pytest.approx(np.exp(-1.0) - 1 + 1.0, rel=1e-5)  # k3 with log(ref/pi) = -1
    assert m["truncated/frac"] == pytest.approx(0.75)  # rows that fill the response width


def test_batch_metrics_without_prompt_ids_reports_no_group_statistic():
    data = _metrics_batch([1.0, 1.0, 0.0, 0.0])
    uid = data.non_tensor_batch.pop("uid")
    m = plugin.batch_metrics(data)
    assert "zero_variance_groups/frac" not in m and "length/reward_corr" not in m and m["reward/mean"] == 0.5
    data.batch["uid"] = torch.tensor([0, 0, 1, 1])  # verl's v1 trainer: a tensor column
    assert plugin.batch_metrics(data)["zero_variance_groups/frac"] == 1.0
    data.batch["uid"] = torch.tensor([0, 1, 1, 0])
    assert plugin.batch_metrics(data)["zero_variance_groups/frac"] == 0.0
    assert len(uid) == 4


def test_metrics_hook_adds_postrl_metrics_and_alarms(postrl_config):
    postrl_config("diagnostics: {zero_variance_groups: {patience: 2}}\n", "diag.yaml")
    assert metric_utils.compute_data_metrics.postrl_hook
    seen = {}
    for _ in range(4):
        seen = metric_utils.compute_data_metrics(batch=_metrics_batch([1.0, 1.0, 0.0, 0.0]), use_critic=False)
    assert "critic/score/mean" in seen  # verl's own metrics are still there
    assert seen["postrl/zero_variance_groups/frac"] == 1.0
    assert seen["postrl/alarm/zero_variance_groups"] == 1.0
    ok = metric_utils.compute_data_metrics(batch=_metrics_batch([1.0, 0.0, 0.0, 1.0]), use_critic=False)
    assert ok["postrl/zero_variance_groups/frac"] == 0.0
    assert "postrl/alarm/zero_variance_groups" not in ok


# ------------------------------------------------------------------------------------------------ export


RUN = """\
model: {path: Qwen/Qwen2.5-0.5B-Instruct}
rewards: [{name: numeric}]
rollout: {group_size: 8, max_new_tokens: 512}
advantage: {name: grpo}
loss: {name: ppo_clip, eps_high: 0.28, agg: dr_grpo, tis: {level: token, cap: 2.0}}
kl: {coef: 0.001, estimator: k3}
regularizers: [{name: entropy_bonus, coef: 0.001}]
train: {prompts_per_step: 64, mini_batches: 4, micro_batch_size: 4, steps: 100}
"""
README_EXPORT = ("postrl export verl run.yaml optim.lr=1e-6 --gpus 8 --train-files $HOME/data/gsm8k/train.parquet "
                 "--val-files $HOME/data/gsm8k/test.parquet")


def test_readme_shows_this_config_and_command():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    section = readme[readme.index("### Many GPUs: verl"):]
    assert RUN in section and README_EXPORT in section


def test_export_is_accepted_by_verl_config_schema(tmp_path, capsys):
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    run = tmp_path / "run.yaml"
    run.write_text(RUN)
    out = tmp_path / "verl_run"
    args = README_EXPORT.replace("$HOME", "/home/u").split()[1:]
    args[args.index("run.yaml")] = str(run)
    assert cli_main([*args, "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert (out / "run_verl.sh").read_text().endswith(line)
    toks = shlex.split(line.replace("\\\n", " "))
    assert toks[:5] == [f"POSTRL_CONFIG={out.resolve() / 'postrl.yaml'}",
                        "VERL_USE_EXTERNAL_MODULES=postrl.integrations.verl", "python3", "-m",
                        "verl.trainer.main_ppo"]
    with initialize_config_dir(config_dir=VERL_CONFIG, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=toks[5:])
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    algo = omega_conf_to_dataclass(cfg.algorithm)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert algo.adv_estimator == "postrl_grpo" and actor.policy_loss.loss_mode == "postrl_ppo_clip"
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm" and actor.loss_scale_factor == 512
    assert actor.optim.lr == 1e-6 and actor.use_kl_loss and actor.kl_loss_type == "k3"
    assert actor.entropy_coeff == 0.001 and actor.ppo_mini_batch_size == 16
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.data.max_response_length == 512
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.data.train_files == "/home/u/data/gsm8k/train.parquet"
    assert OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars) == {
        "POSTRL_CONFIG": str(out.resolve() / "postrl.yaml"), "VERL_USE_EXTERNAL_MODULES": "postrl.integrations.verl"}
    # the written postrl config is the resolved one the plug-in reads
    from postrl.config import load_config

    assert load_config(out / "postrl.yaml").optim.lr == 1e-6


@pytest.mark.parametrize("override,message", [
    ("model.path=builtin", "model.path: verl needs a Hugging Face model folder or hub id"),
    ("regularizers=[{name: adaptive_entropy}]", "regularizers: 'adaptive_entropy' has no verl counterpart"),
    ("advantage.name=rl_zvp", "reads batch field 'token_entropy'"),
])
def test_export_refuses_what_verl_cannot_run(tmp_path, capsys, override, message):
    run = tmp_path / "run.yaml"
    run.write_text(RUN)
    assert cli_main(["export", "verl", str(run), override, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("postrl: error: ") and message in err and err.count("\n") == 1


def test_a_diagnostics_failure_is_reported_and_does_not_stop_the_step(monkeypatch, capsys):
    def broken(data):
        raise RuntimeError("no such column")

    monkeypatch.setattr(plugin, "batch_metrics", broken)
    out = metric_utils.compute_data_metrics(batch=_metrics_batch([1.0, 0.0, 0.0, 1.0]), use_critic=False)
    assert out["postrl/alarm/diagnostics_failed"] == 1.0 and "critic/score/mean" in out
    assert "postrl diagnostics failed on verl's batch: RuntimeError: no such column" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ top-p / top-k

FILTERED = "rollout: {top_p: 0.8, top_k: 20, temperature: 0.7, logprobs: filtered}\n"
UNCORRECTED = "rollout: {top_p: 0.8, top_k: 20, temperature: 0.7}\n"


def test_verl_trainer_logprobs_are_renormalised_through_verls_own_function(postrl_config):
    """The plug-in's logprobs_from_logits is verl's function everywhere verl looks it up (its module, and the
    engines that import it by name, loaded before or after the plug-in); it is verl's own result without the
    correction and the renormalised reference with it, also through verl's own callers (log-probs of a response
    from a whole sequence's logits)."""
    from verl.utils import torch_functional as tf
    from verl.workers.engine.fsdp import transformer_impl

    from logprob_reference import renormalised_reference

    assert tf.logprobs_from_logits.postrl_hook and transformer_impl.logprobs_from_logits is tf.logprobs_from_logits
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=gen) * 2  # temperature-scaled, as the engines pass them
    labels = torch.randint(0, 50, (2, 7), generator=gen)
    verls = tf.logprobs_from_logits.original(logits, labels)
    postrl_config(UNCORRECTED, "uncorrected.yaml")
    assert torch.equal(tf.logprobs_from_logits(logits, labels), verls)
    postrl_config(FILTERED, "filtered.yaml")
    ref = renormalised_reference(logits, labels, 0.8, 20)
    assert torch.allclose(tf.logprobs_from_logits(logits, labels), ref, atol=1e-5)
    assert not torch.allclose(verls, ref, atol=1e-2)  # the filter drops mass here
    assert torch.allclose(plugin.filtered_logprobs_from_logits(logits, labels, 0.8, 20, chunk=3), ref, atol=1e-5)
    # verl's own helper (response log-probs from the logits of [prompt; response]) goes through it
    ids = torch.randint(0, 50, (2, 8), generator=gen)
    resp = tf.log_probs_from_logits_response(ids, logits.new_zeros(2, 8, 50) + logits[:, :1], 4)
    want = renormalised_reference((logits.new_zeros(2, 8, 50) + logits[:, :1])[:, 3:7], ids[:, 4:], 0.8, 20)
    assert torch.allclose(resp, want, atol=1e-5)
    z = logits.clone().requires_grad_(True)
    tf.logprobs_from_logits(z, labels).sum().backward()
    assert z.grad.abs().sum() > 0  # differentiable: the update's log-probs


def test_worker_check_refuses_what_cannot_be_corrected(postrl_config):
    from omegaconf import OmegaConf

    def worker(**rollout):
        base = {"rollout": {"top_p": 0.8, "top_k": 20, "do_sample": True, "calculate_log_probs": False,
                            "logprobs_mode": "processed_logprobs"},
                "actor": {"strategy": "fsdp"}, "model": {"use_fused_kernels": False}}
        for k, v in rollout.items():
            section, key = k.split("__")
            base[section][key] = v
        return OmegaConf.create(base)

    postrl_config(UNCORRECTED, "uncorrected.yaml")
    plugin.check_worker_config(worker(rollout__top_p=1.0, actor__strategy="megatron"))  # uncorrected: no check
    postrl_config(FILTERED, "filtered.yaml")
    plugin.check_worker_config(worker())
    for bad, match in ((dict(rollout__top_p=0.9), "rollout.top_p=0.9.*postrl config has rollout.top_p=0.8"),
                       (dict(rollout__top_k=-1), "top_k=-1.*top_k=20"),
                       (dict(actor__strategy="megatron"), "strategy=megatron.*vocab_parallel"),
                       (dict(model__use_fused_kernels=True), "use_fused_kernels"),
                       (dict(rollout__calculate_log_probs=True, rollout__logprobs_mode="raw_logprobs"),
                        "processed_logprobs")):
        with pytest.raises(ConfigError, match=match):
            plugin.check_worker_config(worker(**bad))


def _filtered_batch(kept_mass: float, rollout: bool = True):
    """verl's batch after a top-p rollout: vLLM's processed log-probs are log pi - log M."""
    data = _metrics_batch([1.0, 0.0, 1.0, 0.0])
    old = data.batch["old_log_probs"]
    if rollout:
        data.batch["rollout_log_probs"] = old - math.log(kept_mass)
    else:
        data.batch.pop("rollout_log_probs")
    return data


def test_kept_mass_and_the_filtered_sampling_alarm_on_verls_batch(postrl_config, caplog):
    postrl_config(UNCORRECTED, "uncorrected.yaml")
    m = plugin.batch_metrics(_filtered_batch(0.7))
    assert m["sampler/kept_mass_mean"] == pytest.approx(0.7) and m["sampler/kept_mass_min"] == pytest.approx(0.7)
    assert m["sampler/kept_logmass_seq"] == pytest.approx((3 + 6 * 3) / 4 * math.log(0.7))  # rows of 3, 6, 6, 6
    seen = [plugin.diagnose(_filtered_batch(0.7)) for _ in range(2)]
    assert "postrl/alarm/filtered_sampling" not in seen[0] and seen[1]["postrl/alarm/filtered_sampling"] == 1.0
    # measured kept mass above the threshold: no alarm
    postrl_config(UNCORRECTED, "uncorrected2.yaml")
    assert not any("postrl/alarm/filtered_sampling" in plugin.diagnose(_filtered_batch(0.99)) for _ in range(3))
    # no rollout log-probs: the mass is unmeasured, the alarm is raised at every step and said once
    postrl_config(UNCORRECTED, "uncorrected3.yaml")
    with caplog.at_level("WARNING", logger="postrl.integrations.verl"):
        seen = [plugin.diagnose(_filtered_batch(0.7, rollout=False)) for _ in range(3)]
    assert all(s["postrl/alarm/filtered_sampling"] == 1.0 and "postrl/sampler/kept_mass_mean" not in s for s in seen)
    assert sum("calculate_log_probs" in r.message for r in caplog.records) == 1
    # corrected: old and rollout log-probs agree, no kept mass from their difference and no alarm
    postrl_config(FILTERED, "filtered.yaml")
    for rollout in (True, False):
        seen = [plugin.diagnose(_filtered_batch(1.0, rollout)) for _ in range(3)]
        assert not any(k.startswith(("postrl/alarm/filtered", "postrl/sampler/kept")) for s in seen for k in s)
    # a verl that returns the kept log-mass (the documented patch point): logged as is
    data = _filtered_batch(1.0)
    data.batch["kept_logmass"] = torch.full_like(data.batch["old_log_probs"], math.log(0.5))
    assert plugin.batch_metrics(data)["sampler/kept_mass_mean"] == pytest.approx(0.5)


def test_a_fresh_verl_process_checks_its_workers_when_corrected(tmp_path):
    """What a Ray worker does: importing verl loads the plug-in, which (correction on) wraps the worker class, so
    a worker whose sampling is not the postrl config's fails at construction, in one line."""
    cfg = tmp_path / "filtered.yaml"
    cfg.write_text(FILTERED)
    code = ("import verl\nfrom omegaconf import OmegaConf\n"
            "from verl.workers.engine_workers import ActorRolloutRefWorker as W\n"
            "from verl.utils import torch_functional as tf\nassert tf.logprobs_from_logits.postrl_hook\n"
            "c = OmegaConf.create({'rollout': {'top_p': 1.0, 'top_k': -1}, 'actor': {}, 'model': {}})\n"
            "try:\n    W(c, 'actor')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, plugin.ENV_CONFIG: str(cfg)}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("ConfigError actor_rollout_ref.rollout.top_p=1.0")


def test_export_of_a_corrected_top_p_run_passes_the_worker_check(tmp_path, capsys, monkeypatch):
    """postrl export verl with top_p and rollout.logprobs=filtered: verl's config (composed by verl's Hydra schema)
    samples with the postrl config's filter and returns the rollout log-probs, and its worker config passes the
    plug-in's worker check under the written postrl config."""
    from hydra import compose, initialize_config_dir

    run = tmp_path / "run.yaml"
    run.write_text(RUN)
    out = tmp_path / "o"
    assert cli_main(["export", "verl", str(run), "rollout.top_p=0.9", "rollout.logprobs=filtered", "--out",
                     str(out)]) == 0
    toks = shlex.split(capsys.readouterr().out.replace("\\\n", " "))
    with initialize_config_dir(config_dir=VERL_CONFIG, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=toks[5:])
    r = cfg.actor_rollout_ref.rollout
    assert (r.top_p, r.top_k, r.calculate_log_probs, r.logprobs_mode) == (0.9, -1, True, "processed_logprobs")
    monkeypatch.setenv(plugin.ENV_CONFIG, str(out / "postrl.yaml"))
    assert plugin.logprob_filter() == {"top_p": 0.9, "top_k": 0}
    plugin.check_worker_config(cfg.actor_rollout_ref)
