"""``postrl export verl RUN.yaml [KEY=VALUE ...]``: the verl launch that runs the same postrl config on verl.

Writes ``OUT/postrl.yaml`` (the resolved postrl config, which the plug-in reads through ``$POSTRL_CONFIG``) and
``OUT/run_verl.sh`` (the launch), and prints the launch. The config must be one verl can run
(:func:`postrl.integrations.verl.check_config`); what has no verl counterpart is a one-line error.

postrl -> verl Hydra overrides (:func:`verl_overrides`):

=====================================  ==========================================================================
postrl                                 verl
=====================================  ==========================================================================
advantage.name                         algorithm.adv_estimator=postrl_<name> (parameters: from $POSTRL_CONFIG)
loss.name                              actor_rollout_ref.actor.policy_loss.loss_mode=postrl_<name>
loss.agg                               actor_rollout_ref.actor.loss_agg_mode (dr_grpo: + loss_scale_factor)
loss.tis (truncate)                    algorithm.rollout_correction.rollout_is=<level>, rollout_is_threshold=cap
kl (placement loss)                    actor.use_kl_loss, kl_loss_coef, kl_loss_type=<estimator>
kl (placement reward)                  algorithm.use_kl_in_reward, kl_penalty, kl_ctrl.{type,kl_coef,target_kl,
                                       horizon}
regularizers: entropy_bonus            actor.entropy_coeff=coef
rewards, shaping                       reward.custom_reward_function.path=pkg://postrl.integrations.verl
rollout.group_size / max_new_tokens    actor_rollout_ref.rollout.n / data.max_response_length
rollout.temperature, top_p, top_k      actor_rollout_ref.rollout.temperature, top_p, top_k (0 -> -1); with a
                                       top-p / top-k filter also rollout.calculate_log_probs=true (the plug-in
                                       measures the kept mass) and logprobs_mode=processed_logprobs
rollout.logprobs=filtered              (the plug-in renormalises verl's trainer log-probs; its workers check
                                       verl's sampling and engine)
train.prompts_per_step / mini_batches  data.train_batch_size / actor.ppo_mini_batch_size (prompts per update)
train.micro_batch_size / epochs        actor.ppo_micro_batch_size_per_gpu / actor.ppo_epochs
train.steps, seed                      trainer.total_training_steps, data.seed
optim.lr, weight_decay, max_grad_norm  actor.optim.lr, actor.optim.weight_decay, actor.grad_clip
model.path                             actor_rollout_ref.model.path (a Hugging Face folder or hub id)
=====================================  ==========================================================================
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from postrl.cli.common import add_import_paths, split_args
from postrl.errors import ConfigError, PostrlError

MAIN = "python3 -m verl.trainer.main_ppo"
PLUGIN = "postrl.integrations.verl"


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def verl_overrides(cfg: Any, config_path: str, *, train_files: str, val_files: str, gpus: int,
                   nodes: int) -> list[str]:
    """The Hydra overrides of verl's ``ppo_trainer`` config that run postrl config ``cfg`` (see the module table);
    ``config_path``: the file the plug-in reads on every Ray worker."""
    from postrl.integrations.verl import AGG_MODES, PREFIX

    if cfg.model.path == "builtin":
        raise ConfigError("model.path: verl needs a Hugging Face model folder or hub id, not 'builtin'")
    if cfg.train.prompts_per_step % cfg.train.mini_batches:
        raise ConfigError(f"train.mini_batches={cfg.train.mini_batches} must divide train.prompts_per_step="
                          f"{cfg.train.prompts_per_step} (verl's ppo_mini_batch_size counts prompts)")
    actor = "actor_rollout_ref.actor"
    o = {
        "algorithm.adv_estimator": PREFIX + cfg.advantage.name,
        f"{actor}.policy_loss.loss_mode": PREFIX + cfg.loss.name,
        f"{actor}.loss_agg_mode": AGG_MODES[cfg.loss.agg],
        "actor_rollout_ref.model.path": cfg.model.path,
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": cfg.rollout.group_size,
        "actor_rollout_ref.rollout.temperature": cfg.rollout.temperature,
        "actor_rollout_ref.rollout.top_p": cfg.rollout.top_p,
        "actor_rollout_ref.rollout.top_k": cfg.rollout.top_k or -1,
        "data.train_files": train_files,
        "data.val_files": val_files,
        "data.max_response_length": cfg.rollout.max_new_tokens,
        "data.train_batch_size": cfg.train.prompts_per_step,
        "data.seed": cfg.seed,
        f"{actor}.ppo_mini_batch_size": cfg.train.prompts_per_step // cfg.train.mini_batches,
        f"{actor}.ppo_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        f"{actor}.ppo_epochs": cfg.train.epochs,
        f"{actor}.optim.lr": cfg.optim.lr,
        f"{actor}.optim.weight_decay": cfg.optim.weight_decay,
        f"{actor}.use_kl_loss": False,
        f"{actor}.entropy_coeff": 0.0,
        "algorithm.use_kl_in_reward": False,
        "reward.custom_reward_function.path": f"pkg://{PLUGIN}",
        "reward.custom_reward_function.name": "compute_score",
        "trainer.total_training_steps": cfg.train.steps,
        "trainer.n_gpus_per_node": gpus,
        "trainer.nnodes": nodes,
        "+ray_kwargs.ray_init.runtime_env.env_vars.POSTRL_CONFIG": config_path,
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES": PLUGIN,
    }
    if cfg.rollout.temperature > 0 and (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0):
        o["actor_rollout_ref.rollout.calculate_log_probs"] = True  # the kept mass, measured on the driver
        o["actor_rollout_ref.rollout.logprobs_mode"] = "processed_logprobs"
    if cfg.optim.max_grad_norm is not None:
        o[f"{actor}.grad_clip"] = cfg.optim.max_grad_norm
    if cfg.loss.agg == "dr_grpo":
        o[f"{actor}.loss_scale_factor"] = cfg.rollout.max_new_tokens
    if cfg.loss.tis.level != "none":
        if cfg.loss.tis.mode != "truncate":
            raise ConfigError("loss.tis.mode=mask has no verl counterpart here; use mode truncate "
                              "(verl rollout_is with rollout_is_threshold)")
        o["algorithm.rollout_correction.rollout_is"] = cfg.loss.tis.level
        o["algorithm.rollout_correction.rollout_is_threshold"] = cfg.loss.tis.cap
    if cfg.kl.coef > 0 and cfg.kl.placement == "loss":
        if cfg.kl.controller != "fixed":
            raise ConfigError(f"kl.controller={cfg.kl.controller} with kl.placement=loss has no verl counterpart (verl adapts "
                              "only the in-reward KL); use kl.placement=reward or controller fixed")
        o.update({f"{actor}.use_kl_loss": True, f"{actor}.kl_loss_coef": cfg.kl.coef,
                  f"{actor}.kl_loss_type": cfg.kl.estimator})
    elif cfg.kl.coef > 0:
        if cfg.kl.controller == "pid":
            raise ConfigError("kl.controller=pid has no verl counterpart (verl's kl_ctrl.type is fixed or adaptive); "
                              "use it with postrl train")
        o.update({"algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": cfg.kl.estimator,
                  "algorithm.kl_ctrl.type": cfg.kl.controller, "algorithm.kl_ctrl.kl_coef": cfg.kl.coef,
                  "algorithm.kl_ctrl.target_kl": cfg.kl.target, "algorithm.kl_ctrl.horizon": cfg.kl.horizon})
    for spec in cfg.regularizers:
        if spec.name != "entropy_bonus":
            raise ConfigError(f"regularizers: '{spec.name}' has no verl counterpart (only entropy_bonus maps, to "
                              "actor.entropy_coeff); use it with postrl train")
        o[f"{actor}.entropy_coeff"] = spec.coef
    if cfg.filters:
        raise ConfigError(f"filters: '{cfg.filters[0].name}' has no verl counterpart here (verl's dynamic sampling "
                          "is algorithm.filter_groups); remove it to run on verl")
    return [f"{k}={_fmt(v)}" for k, v in o.items()]


def launch_line(overrides: list[str], config_path: str) -> str:
    """The shell command: the plug-in by both routes for the driver, then verl's trainer with the overrides."""
    env = f"{shlex.quote('POSTRL_CONFIG=' + config_path)} VERL_USE_EXTERNAL_MODULES={PLUGIN}"
    return " \\\n  ".join([f"{env} {MAIN}", *(shlex.quote(o) for o in overrides)])


def run_verl(args) -> int:
    from postrl.config import dump_yaml, load_config

    path, overrides = split_args(args.items)
    if path is None:
        raise PostrlError("postrl export verl: give the run's YAML config (postrl export verl RUN.yaml)")
    add_import_paths(path)
    cfg = load_config(path, overrides)
    try:
        from postrl.integrations import verl as plugin
    except ImportError as e:
        raise PostrlError(f"postrl export verl needs verl ({e}); install it with pip install 'postrl[verl]'") from None
    plugin.check_config(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = (out / "postrl.yaml").resolve()
    cfg_file.write_text(dump_yaml(cfg))
    line = launch_line(verl_overrides(cfg, str(cfg_file), train_files=args.train_files, val_files=args.val_files,
                                      gpus=args.gpus, nodes=args.nodes), str(cfg_file))
    (out / "run_verl.sh").write_text(f"#!/bin/sh\nset -e\n{line}\n")
    print(line)
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("export", help="write the command line that runs a postrl config on another engine")
    esub = e.add_subparsers(dest="export_target", metavar="TARGET")
    v = esub.add_parser("verl", help="the verl launch (Hydra overrides) for RUN.yaml; writes OUT/postrl.yaml and "
                        "OUT/run_verl.sh")
    v.add_argument("items", nargs="*", metavar="RUN.yaml [KEY=VALUE]")
    v.add_argument("--out", default="verl_run", help="folder for postrl.yaml and run_verl.sh (default: verl_run)")
    v.add_argument("--train-files", default="train.parquet",
                   help="verl data.train_files (verl's parquet format, e.g. examples/data_preprocess/gsm8k.py)")
    v.add_argument("--val-files", default="test.parquet", help="verl data.val_files")
    v.add_argument("--gpus", type=int, default=8, help="trainer.n_gpus_per_node (default 8)")
    v.add_argument("--nodes", type=int, default=1, help="trainer.nnodes (default 1)")
    v.set_defaults(fn=run_verl)
