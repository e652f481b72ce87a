"""Per-step metrics of a rollout batch: pure functions over the batch's tensors, vectorised over groups.

Every key is documented, with its TRL / verl counterpart, in docs/metrics.md. Groups are the completions of one
prompt (``group_ids``); only ``valid`` rows (finite reward) enter reward and advantage statistics.

The functions take torch tensors (or numpy arrays) and compute in numpy (float64) on host copies: a step's
metrics are a hundred operations on vectors of a few dozen entries, where a numpy operation costs about a
microsecond and a torch operator several (8 rows: 0.25 vs 0.39 ms a step, the same values).
"""

from __future__ import annotations

import math
import resource
import sys

import numpy as np
import torch

from postrl.groups import group_index

from postrl.evaluate import pass_at_k
from postrl.losses.icr import length_accuracy_corr

_NAN = float("nan")


def _np(x: torch.Tensor | np.ndarray, dtype=np.float64) -> np.ndarray:
    """A host numpy copy (or view) of ``x`` in ``dtype`` (None: its own)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy() if x.dtype != torch.bfloat16 and x.dtype != torch.float16 else x.float().numpy()
    return np.asarray(x) if dtype is None else np.asarray(x, dtype=dtype)


def _group_index(group_ids) -> tuple[np.ndarray, int]:
    """``postrl.groups.group_index`` as numpy (the metrics are computed in numpy)."""
    inv, ng = group_index(torch.as_tensor(_np(group_ids, None)))
    return inv.numpy(), ng


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else _NAN


def _std(x: np.ndarray) -> float:
    """Unbiased standard deviation (torch's ``std``); 0 below two values."""
    return float(x.std(ddof=1)) if x.size > 1 else 0.0


def _distinct_per_group(inv: np.ndarray, ng: int, cols: np.ndarray) -> np.ndarray:
    """Number of distinct rows of ``cols`` [n, c] (already quantised, int64) within each group -> [ng]."""
    if not inv.size:
        return np.zeros(ng)
    keys = np.unique(np.concatenate([inv[:, None], cols], axis=1), axis=0)
    return np.bincount(keys[:, 0], minlength=ng).astype(np.float64)


def _quantise(x: np.ndarray, scale: float = 1e5) -> np.ndarray:
    """Round to 1e-5 so float noise does not count as a distinct value; NaN -> a sentinel."""
    with np.errstate(over="ignore", invalid="ignore"):
        q = np.round(np.nan_to_num(x, nan=1e12) * scale)
    return np.clip(q, -9e15, 9e15).astype(np.int64)


def _group_sum(inv: np.ndarray, ng: int, x: np.ndarray) -> np.ndarray:
    return np.bincount(inv, weights=x, minlength=ng) if inv.size else np.zeros(ng)


def group_metrics(reward: torch.Tensor, rewards: torch.Tensor | None, group_ids: torch.Tensor, valid: torch.Tensor,
                  advantages: torch.Tensor | None, correct: torch.Tensor | None,
                  completion_mask: torch.Tensor | None = None) -> dict[str, float]:
    """Learning-signal statistics per group.

    - ``zero_variance_groups/frac``: fraction of groups whose valid rewards are all equal (or with < 2 valid rows);
      split into ``zero_variance_groups/all_correct`` and ``/all_wrong`` when a verifier column ``correct`` [N] (1 = correct) exists.
    - ``advantages/distinct_frac``: mean over groups of (distinct advantage values) / (valid rows).
    - ``rewards/distinct_frac``: same for distinct reward vectors (rows of the [N, K] matrix).
    - ``advantages/collapse``: mean over groups with >= 2 distinct reward vectors of
      1 - distinct advantages / distinct reward vectors: the share of reward combinations the advantage no longer
      tells apart (GDPO's "reward combination collapse" under a summed reward).
    - ``reward/group_std``: mean unbiased within-group std of the scalar reward.
    - ``pass@1``, ``pass@k`` (k = largest group): unbiased pass@k of the verifier per group (Chen et al. 2021).
    """
    m: dict[str, float] = {}
    inv, ng = _group_index(group_ids)
    if ng == 0:
        return m
    r = _np(reward)
    v = _np(valid, bool) & np.isfinite(r)
    rv = np.where(v, r, 0.0)
    big = np.full(ng, -math.inf)
    np.maximum.at(big, inv[v], r[v])
    small = np.full(ng, math.inf)
    np.minimum.at(small, inv[v], r[v])
    cnt = _group_sum(inv, ng, v.astype(np.float64))
    with np.errstate(invalid="ignore"):
        zero = (cnt < 2) | ((big - small) <= 1e-12)
    m["zero_variance_groups/frac"] = float(zero.mean())
    # within-group std
    mean = _group_sum(inv, ng, rv) / np.maximum(cnt, 1)
    dev = np.where(v, rv - mean[inv], 0.0)
    ss = _group_sum(inv, ng, dev * dev)
    std = np.where(cnt > 1, np.sqrt(ss / np.maximum(cnt - 1, 1)), 0.0)
    m["reward/group_std"] = float(std.mean())
    if correct is not None:
        c = np.clip(np.nan_to_num(_np(correct), nan=0.0), 0, 1)
        nc = _group_sum(inv, ng, np.where(v, (c >= 1.0).astype(np.float64), 0.0))
        m["zero_variance_groups/all_correct"] = float((zero & (cnt > 0) & (nc == cnt)).mean())
        m["zero_variance_groups/all_wrong"] = float((zero & (nc == 0)).mean())
        # k = the group size (rows per group id, the same on every process: keys must match for the reduction)
        k = int(np.bincount(inv, minlength=ng).max())
        has = cnt >= 1
        p1 = [pass_at_k(int(n), int(cc), 1) for n, cc in zip(cnt[has].tolist(), nc[has].tolist())]
        m["pass@1"] = sum(p1) / len(p1) if p1 else _NAN
        if k > 1:
            full = cnt >= k  # groups with a failed reward have fewer than k samples: left out
            pk = [pass_at_k(int(n), int(cc), k) for n, cc in zip(cnt[full].tolist(), nc[full].tolist())]
            m[f"pass@{k}"] = sum(pk) / len(pk) if pk else _NAN
    if advantages is not None:
        a = _np(advantages)
        if a.ndim == 2:  # per-token advantages: one value per completion (masked mean)
            msk = _np(completion_mask) if completion_mask is not None else np.ones_like(a)
            a = (a * msk).sum(-1) / np.maximum(msk.sum(-1), 1)
        av = a[v]
        m["advantages/mean"] = _mean(av)
        m["advantages/std"] = _std(av)
        m["advantages/abs_mean"] = _mean(np.abs(av))
        m["advantages/min"] = float(av.min()) if av.size else _NAN
        m["advantages/max"] = float(av.max()) if av.size else _NAN
        vi = np.flatnonzero(v)
        dadv = _distinct_per_group(inv[vi], ng, _quantise(a[vi])[:, None])
        has = cnt > 0
        m["advantages/distinct_frac"] = float((dadv[has] / cnt[has]).mean()) if has.any() else _NAN
        if rewards is not None:
            rmat = _np(rewards)
            rmat = rmat if rmat.ndim == 2 else rmat[:, None]
            dcomb = _distinct_per_group(inv[vi], ng, _quantise(rmat[vi]))
            m["rewards/distinct_frac"] = float((dcomb[has] / cnt[has]).mean()) if has.any() else _NAN
            multi = dcomb >= 2
            m["advantages/collapse"] = float(np.maximum(1.0 - dadv[multi] / dcomb[multi], 0).mean()) \
                if multi.any() else 0.0
    return m


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor, reward: torch.Tensor, valid: torch.Tensor,
                   group_ids: torch.Tensor) -> dict[str, float]:
    """Completion lengths, truncation, and the within-group correlation of reward with length.

    ``length/reward_corr`` = Pearson correlation of (length - group mean length) with (reward - group mean reward)
    over valid rows: centring by group removes prompt difficulty, so it measures whether, for the same prompt,
    longer completions earn more ("A Long Way to Go"'s length-reward correlation). NaN when lengths or rewards
    do not vary within any group.
    """
    lens = _np(lengths)
    tr = _np(truncated, bool)
    r = _np(reward)
    v = _np(valid, bool) & np.isfinite(r)
    m = {"length/mean": _mean(lens), "length/min": float(lens.min()) if lens.size else _NAN,
         "length/max": float(lens.max()) if lens.size else _NAN,
         "length/terminated_mean": _mean(lens[~tr]), "truncated/frac": _mean(tr.astype(np.float64)),
         "truncated/reward_mean": _mean(r[v & tr]),
         "finished/reward_mean": _mean(r[v & ~tr])}
    inv, ng = _group_index(group_ids)
    if ng and v.sum() > 2:
        vd = v.astype(np.float64)
        cnt = np.maximum(_group_sum(inv, ng, vd), 1)
        rz = np.where(v, r, 0.0)
        lm = _group_sum(inv, ng, lens * vd) / cnt
        rm = _group_sum(inv, ng, rz) / cnt
        dl, dr = (lens - lm[inv]) * vd, (rz - rm[inv]) * vd
        den = math.sqrt(float((dl * dl).sum()) * float((dr * dr).sum()))
        m["length/reward_corr"] = float((dl * dr).sum()) / den if den > 1e-12 else _NAN
    else:
        m["length/reward_corr"] = _NAN
    return m


def token_metrics(sampler_logprobs: torch.Tensor, completion_mask: torch.Tensor, low_prob: float) -> dict[str, float]:
    """``tokens/low_prob_frac``: fraction of sampled tokens whose sampler probability is below ``low_prob``
    (falls as the policy sharpens: the low-probability-token side of entropy collapse);
    ``tokens/logprob_mean``: mean sampler log-prob per token (-log perplexity of the samples)."""
    lp = _np(sampler_logprobs)[_np(completion_mask, bool)]
    return {"tokens/low_prob_frac": _mean((lp < math.log(low_prob)).astype(np.float64)),
            "tokens/logprob_mean": _mean(lp)}


def kept_mass_metrics(kept_logmass: torch.Tensor, completion_mask: torch.Tensor) -> dict[str, float]:
    """Top-p / top-k: the unfiltered probability mass M_t the filter kept at each sampled position.

    - ``sampler/kept_mass_mean``, ``sampler/kept_mass_min``: mean / min of M_t over the completion tokens;
    - ``sampler/kept_logmass_seq``: mean over completions of sum_t log M_t, the amount by which a sequence-level
      log-ratio (GSPO, sequence TIS) is off when the log-probs are of the unfiltered distribution
      (``rollout.logprobs=full``; per token the log-ratio is off by log M_t).
    """
    msk = _np(completion_mask, bool)
    lm = _np(kept_logmass)
    if not msk.any():
        return dict.fromkeys(("sampler/kept_mass_mean", "sampler/kept_mass_min", "sampler/kept_logmass_seq"), _NAN)
    km = np.exp(lm[msk])
    rows = msk.any(-1)
    return {"sampler/kept_mass_mean": _mean(km), "sampler/kept_mass_min": float(km.min()),
            "sampler/kept_logmass_seq": _mean(np.where(msk, lm, 0.0).sum(-1)[rows])}


def mismatch_metrics(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Sampler vs trainer log-probs of the sampled tokens, before any update (the same policy, two programs).

    - ``mismatch/logp_abs_mean``, ``mismatch/logp_abs_max``: |log pi_sampler - log pi_trainer| (TRL
      ``sampling/sampling_logp_difference/mean``/``max``).
    - ``mismatch/prob_abs_mean``: |pi_sampler - pi_trainer| per token (verl ``training/rollout_probs_diff_mean``).
    - ``mismatch/kl``: k3 estimate of KL(sampler || trainer) per token from the sampler's tokens.
    - ``mismatch/is_ratio_min`` / ``_max``: extremes of the token ratio pi_trainer / pi_sampler (TRL
      ``sampling/importance_sampling_ratio/min``/``max``).
    """
    msk = _np(mask, bool)
    if not msk.any():
        return dict.fromkeys(("mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/prob_abs_mean",
                              "mismatch/kl", "mismatch/is_ratio_min", "mismatch/is_ratio_max"), _NAN)
    t, s = _np(trainer_logprobs)[msk], _np(sampler_logprobs)[msk]
    d = t - s
    ad = np.abs(d)
    lr = np.clip(-d, -20, 20)  # log(pi_s / pi_t)
    k3 = np.exp(-lr) - 1 + lr  # KL(s||t) k3 with ratio pi_t / pi_s
    ratio = np.exp(np.clip(d, -20, 20))
    return {"mismatch/logp_abs_mean": float(ad.mean()), "mismatch/logp_abs_max": float(ad.max()),
            "mismatch/prob_abs_mean": float(np.abs(np.exp(t) - np.exp(s)).mean()),
            "mismatch/kl": float(k3.mean()), "mismatch/is_ratio_min": float(ratio.min()),
            "mismatch/is_ratio_max": float(ratio.max())}


_PROC: list = []  # [psutil.Process of this process] (a new one per call cost 23 vs 9 us)


def _process():
    import os

    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency of accelerate
        return None
    if not _PROC or _PROC[0].pid != os.getpid():  # (a forked child gets its own)
        _PROC[:] = [psutil.Process()]
    return _PROC[0]


def memory_metrics(device: torch.device | None = None) -> dict[str, float]:
    """Peak resident memory of this process (``resource``; psutil's current RSS when installed) and, on CUDA,
    the peak allocated / reserved memory since the previous call (verl ``perf/max_memory_allocated_gb``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    m = {"memory/rss_peak_gb": peak_bytes / 2**30}
    proc = _process()
    if proc is not None:
        m["memory/rss_gb"] = proc.memory_info().rss / 2**30
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        m["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        m["memory/cuda_max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return m


def turn_metrics(extra: dict, completion_mask: torch.Tensor) -> dict[str, float]:
    """Multi-turn episodes (``postrl.environments.episodes``): ``turns/per_episode`` (mean model turns),
    ``turns/tool_calls`` (mean per episode), ``turns/tool_success`` (executed calls that returned / executed calls;
    NaN without calls), ``turns/malformed_calls`` and ``turns/env_errors`` (mean per episode),
    ``turns/truncated_turns`` (fraction of model turns that hit the token limit), ``turns/truncated_turn_<k>``
    (that fraction at turn k), ``turns/env_token_fraction`` (environment tokens / completion tokens),
    ``turns/user_errors`` (simulated-user failures per episode), ``turns/judge_errors`` (episodes whose StepTool
    contribution judge failed) and ``turns/purified`` (fraction of episodes that CLEANER rewrote) when the batch has
    them."""
    n_turns = _np(extra["num_turns"])
    calls, errors = _np(extra["tool_calls"]).sum(), _np(extra["tool_errors"]).sum()
    has = _np(extra["turn_ends"]) >= 0
    trunc = _np(extra["turn_truncated"], bool) & has
    env_tokens = float((_np(extra["turn_ends"]).max(-1) + 1).sum()) - float(_np(completion_mask).sum())
    total = float((_np(extra["turn_ends"]).max(-1) + 1).sum())
    m = {"turns/per_episode": _mean(n_turns), "turns/tool_calls": _mean(_np(extra["tool_calls"])),
         "turns/tool_success": float((calls - errors) / calls) if calls else float("nan"),
         "turns/malformed_calls": _mean(_np(extra["malformed_calls"])),
         "turns/env_errors": _mean(_np(extra["env_errors"])),
         "turns/truncated_turns": float(trunc.sum() / has.sum()) if has.any() else float("nan"),
         "turns/env_token_fraction": env_tokens / total if total else float("nan")}
    if "user_errors" in extra:
        m["turns/user_errors"] = _mean(_np(extra["user_errors"]))
    if "turn_judge_errors" in extra:
        m["turns/judge_errors"] = _mean(_np(extra["turn_judge_errors"]).astype(np.float64))
    if "purified" in extra:
        m["turns/purified"] = _mean(_np(extra["purified"]).astype(np.float64))
    for k in range(has.shape[1]):
        if has[:, k].any():
            m[f"turns/truncated_turn_{k}"] = float(trunc[:, k].sum() / has[:, k].sum())
    return m


def batch_metrics(batch, reward_info: dict, *, low_prob: float = 0.1) -> dict[str, float]:
    """All per-step metrics that depend only on the rollout batch (after rewards, shaping, filters, advantages)."""
    m: dict[str, float] = {}
    reward = _np(batch.reward)
    valid = _np(batch.valid, bool) if batch.valid is not None else np.isfinite(reward)
    r = reward[valid]
    m["reward/mean"] = _mean(r)
    m["reward/std"] = _std(r)
    correct = None
    rewards = _np(batch.rewards)
    for k, name in enumerate(batch.reward_names):
        col = rewards[:, k]
        col = col[np.isfinite(col)]
        m[f"reward/{name}/mean"] = _mean(col)
        m[f"reward/{name}/std"] = _std(col)
        m[f"reward/{name}/failures"] = float(reward_info.get("failures", {}).get(name, 0))
        if name in reward_info.get("skipped_rate", {}):  # the fraction of rows it returned None for (TRL: n/a)
            m[f"reward/{name}/skipped"] = float(reward_info["skipped_rate"][name])
    if "correct" in batch.reward_names:
        correct = rewards[:, batch.reward_names.index("correct")]
        m["accuracy"] = _mean((correct[np.isfinite(correct)] >= 1.0).astype(np.float64))
        known = torch.as_tensor(np.isfinite(correct) & valid)
        corr = length_accuracy_corr(batch.lengths, torch.as_tensor(correct >= 1.0), batch.group_ids, known)[0]
        if math.isfinite(corr):  # (undefined in a step where no group has a right and a wrong completion)
            m["length/accuracy_corr"] = corr
    m["valid"] = _mean(valid.astype(np.float64))
    m.update(length_metrics(batch.lengths, batch.truncated, reward, valid, batch.group_ids))
    m.update(group_metrics(reward, rewards, batch.group_ids, valid, batch.advantages, correct,
                           batch.completion_mask))
    m.update(token_metrics(batch.sampler_logprobs, batch.completion_mask, low_prob))
    if batch.extra.get("sampler_kept_logmass") is not None:
        m.update(kept_mass_metrics(batch.extra["sampler_kept_logmass"], batch.completion_mask))
    m["tokens/completion"] = float(_np(batch.completion_mask).sum())
    m["tokens/prompt"] = float(_np(batch.prompt_mask).sum())
    for name, value in (reward_info.get("metrics") or {}).items():  # a reward's TRL log_metric: postrl's win
        m.setdefault(name, float(value))
    extra = getattr(batch, "extra", None) or {}  # a RolloutBatch has it; tests' stand-in batches may not
    if "num_turns" in extra:
        m.update(turn_metrics(extra, batch.completion_mask))
    return m
