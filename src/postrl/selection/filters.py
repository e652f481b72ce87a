"""Keep-mask filters (kind ``filter``; config ``filters: [...]``): which groups of the scored batch train.

A filter is a function ``fn(<batch fields>, *, <params>) -> bool [N]`` on the scored batch; rows with False are
dropped. A filter entry's ``max_attempts`` (a key of the config entry, read by the step's batch assembly,
``postrl.step.sampling``) asks for a *refill*: more prompts (drawn with a seed derived from (seed, step,
attempt)) are generated, scored and filtered until the batch holds as many groups as an unfiltered batch would, or
``max_attempts`` generation rounds were made. When the cap is hit, the shortfall is filled with dropped groups whose
rows are masked (``valid`` False: advantage 0, no loss), a warning is logged and ``filter/cap_hit`` = 1. So every
batch has the same number of groups, and under DDP every process ends with the same number of rows; nothing
silently shrinks. Filters judge the RAW reward column (``reward``, default ``correct``), never the shaped scalar
reward.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge

from postrl.errors import ConfigError
from postrl.groups import group_index, group_moments
from postrl.registry import register
from postrl.stages import parameters


def raw_column(rewards: torch.Tensor, reward_names: list, name: str, what: str,
               raw_rewards: torch.Tensor | None = None, raw_reward_names: tuple | None = None) -> torch.Tensor:
    """The raw reward column ``name`` [N] (NaN where that source failed): from the matrix as the sources returned
    it (the batch field ``raw_rewards``, kept by the trainer before shaping) when given, so a shaping stage that
    rewrites or appends columns changes nothing here; else from ``rewards``."""
    if raw_rewards is not None and raw_reward_names is not None:
        rewards, reward_names = raw_rewards, raw_reward_names
    names = list(reward_names)
    if name not in names:
        raise ValueError(f"{what}.reward: no reward source named '{name}' in this run; rewards: {', '.join(names)}")
    return rewards[:, names.index(name)]


# ------------------------------------------------------------------------------------------------ keep masks
@register("filter", "dynamic_sampling", source="DAPO (Yu et al. 2025) dynamic sampling; verl algorithm.filter_groups",
          needs=lambda p: () if p.get("singletons") == "keep" else ("groups",))  # (verl's convention keeps groups of one)
def dynamic_sampling(rewards: torch.Tensor, reward_names: list, group_ids: torch.Tensor,
                     raw_rewards: torch.Tensor | None = None, raw_reward_names: tuple | None = None, *,
                     reward: str = "correct", max_attempts: Annotated[int, Ge(1)] = 10,
                     singletons: Literal["drop", "keep"] = "drop") -> torch.Tensor:
    """Keep the groups whose raw verifiable reward varies (std > 0); the trainer regenerates until the batch is full.

    DAPO ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale"): a group whose completions are all
    right or all wrong has zero advantage under group normalisation; it is dropped and more prompts are sampled
    (verl ``algorithm.filter_groups.enable=True, metric=acc``, ``max_num_gen_batches`` = ``max_attempts``,
    default 10). Judged on the raw column ``reward`` (default 'correct'), never on the shaped reward (a length or
    format term must not make an all-wrong group look informative): the column as the reward source returned it
    (``raw_rewards``), untouched by shaping stages. NaN entries (failed rewards) are ignored.

    A group with one finite value (a group of one completion, or a group whose other entries failed):
    ``singletons='drop'`` (default) drops it, since it has no variance and GRPO gives it advantage 0;
    ``singletons='keep'`` keeps it, verl's convention: verl evicts a group only when it holds two or more
    trajectories whose metric has zero std (``len(values) > 1 and np.std(values) == 0``, verl 0.9.1
    ``ReplayBuffer._dapo_filtered_keys``; the older ``DAPORayTrainer`` kept ``std > 0 or len(vals) == 1``), so a
    group of one trains there (with verl's GRPO it gets A = r / (1 + eps), ``advantage.singleton: raw``).
    keep_g = (n_g >= 2 and max_g > min_g)  or  (singletons = 'keep' and n_g == 1), n_g = finite values in g;
    a group with no finite value is dropped either way (verl never sees a NaN reward: its std would be NaN and
    the group kept).
    Shapes: rewards [N, K], reward_names [K], group_ids [N] (raw_rewards [N, K']) -> keep [N] bool.
    """
    x = raw_column(rewards, reward_names, reward, "filters.dynamic_sampling", raw_rewards, raw_reward_names)
    _, lo, hi, cnt = group_moments(x, group_ids)
    keep = (cnt >= 2) & (hi > lo)
    if singletons == "keep":
        keep = keep | (cnt == 1)
    return keep


def _low_below_high(params: dict, run: Any, where: str) -> dict:
    """``range_filter``: ``low`` < ``high``."""
    p = {**{k: d for k, (_, d) in parameters(range_filter).items()}, **params}
    if not p["low"] < p["high"]:
        raise ConfigError(f"{where}.high: expected a value > low ({p['low']}), got {p['high']}")
    return params


@register("filter", "range_filter", source="OpenRLHF --dynamic_filtering --dynamic_filtering_reward_range",
          check=_low_below_high)
def range_filter(rewards: torch.Tensor, reward_names: list, group_ids: torch.Tensor,
                 raw_rewards: torch.Tensor | None = None, raw_reward_names: tuple | None = None, *,
                 reward: str = "correct", low: float = 0.0, high: float = 1.0,
                 max_attempts: Annotated[int, Ge(1)] = 10) -> torch.Tensor:
    """Keep the groups whose mean raw reward lies strictly inside (low, high); regenerate until the batch is full.

    OpenRLHF dynamic filtering: ``low + 1e-6 < mean_g r < high - 1e-6`` (``dynamic_filtering_reward_range``,
    default (0, 1): drops all-wrong and all-right groups of a 0/1 reward). Raw column ``reward`` (default
    'correct', before shaping); NaN entries ignored, a group with no finite value dropped. ``max_attempts``
    (default 10) as dynamic_sampling; 1 = filter without regenerating (the shortfall is masked).
    Shapes: rewards [N, K], reward_names [K], group_ids [N] -> keep [N] bool.
    """
    x = raw_column(rewards, reward_names, reward, "filters.range_filter", raw_rewards, raw_reward_names)
    mean, _, _, cnt = group_moments(x, group_ids)
    return (cnt >= 1) & (mean > low + 1e-6) & (mean < high - 1e-6)




_RESHAPING = "Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair"
GOVERNANCE_EXCLUDE = ("env_error", "no_tests")


def _governance_check(params: dict, run, where: str) -> dict:
    if run is not None and run.environment is None:
        raise ConfigError(f"{where}: failure_governance reads the failure causes of multi-turn episodes; set "
                          f"environment (e.g. {{name: code_repair}})")
    return params


@register("filter", "failure_governance", source=_RESHAPING, check=_governance_check,
          needs=lambda p: () if p.get("min_rows") == 1 else ("groups",))  # (min_rows 1: a completion alone is kept)
def failure_governance(group_ids: torch.Tensor, failure_cause: list | None = None, valid: torch.Tensor | None = None,
                       *, exclude: tuple[str, ...] = GOVERNANCE_EXCLUDE,
                       min_rows: Annotated[int, Ge(1)] = 2) -> torch.Tensor:
    """Keep rollouts from the same prompt comparable: drop those whose failure was not the policy's doing, and the
    groups left too small to compare.

    After "Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair" ("failure-cause-aware rollout
    governance reshapes within-group comparability"; the abstract does not give the rules). Each episode carries
    the cause of its failure (``failure_cause``, made by the episode rollout: ``env_error`` when the environment
    raised, e.g. the code sandbox failed; ``token_limit``; else the environment's own, for ``code_repair`` one of
    ``syntax``, ``compile``, ``runtime``, ``semantic``, ``timeout``, ``memory``, ``output_limit``, ``killed``,
    ``no_tests``; None when solved). GRPO compares a rollout with the others of its prompt, which is meaningful
    only when they ran under the same conditions, so:
        comparable_i = valid_i and cause_i not in ``exclude``   (default: env_error, no_tests: failures of the
                                                                  environment or the data, not of the policy)
        keep_i       = comparable_i and #{comparable rows of i's group} >= ``min_rows`` (default 2: one rollout
                                                                  alone has nothing to be compared with)
    Dropped rows leave their group (the others keep their group statistics among themselves); a group with fewer
    than ``min_rows`` comparable rollouts is dropped whole and regenerated as ``dynamic_sampling``'s (the entry's
    ``max_attempts``; ``max_attempts: 1`` masks it out instead, when episodes are costly). Failures of the policy
    (compile errors, wrong answers, limits its program hit) stay and are compared. The environment's own control
    (``code_repair``'s ``timeout_retries``) re-runs an attempt that hit the wall-clock limit before its cause is
    recorded. Assumed: the causes, the default exclusion and min_rows.
    Shapes: group_ids [N], failure_cause [N] list, valid [N] -> keep [N] bool.
    """
    if failure_cause is None:
        raise ConfigError("filters.failure_governance: the batch has no failure_cause (it comes from multi-turn "
                          "episodes: set environment)")
    bad = torch.tensor([c is not None and str(c) in set(exclude) for c in failure_cause], dtype=torch.bool)
    ok = ~bad if valid is None else (valid.bool() & ~bad)
    inv, ng = group_index(group_ids)
    n = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, ok.long())
    return ok & (n[inv] >= min_rows)
