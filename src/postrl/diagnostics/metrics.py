"""Per-step metrics of a rollout batch: pure functions over the batch's tensors, vectorised over groups.

Every key is documented, with its TRL / verl counterpart, in docs/metrics.md. Groups are the completions of one
prompt (``group_ids``); only ``valid`` rows (finite reward) enter reward and advantage statistics.
"""

from __future__ import annotations

import math
import resource
import sys

import torch

from postrl.evaluate import pass_at_k

_NAN = float("nan")


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else _NAN


def _distinct_per_group(inv: torch.Tensor, ng: int, cols: torch.Tensor) -> torch.Tensor:
    """Number of distinct rows of ``cols`` [n, c] (already quantised, long) within each group -> [ng]."""
    if not inv.numel():
        return torch.zeros(ng)
    keys = torch.unique(torch.cat([inv[:, None], cols], dim=1), dim=0)
    return torch.bincount(keys[:, 0], minlength=ng).double()


def _quantise(x: torch.Tensor, scale: float = 1e5) -> torch.Tensor:
    """Round to 1e-5 so float noise does not count as a distinct value; NaN -> a sentinel."""
    q = torch.round(torch.nan_to_num(x.double(), nan=1e12) * scale)
    return q.clamp(-9e15, 9e15).long()


def group_metrics(reward: torch.Tensor, rewards: torch.Tensor | None, group_ids: torch.Tensor, valid: torch.Tensor,
                  advantages: torch.Tensor | None, correct: torch.Tensor | None,
                  completion_mask: torch.Tensor | None = None) -> dict[str, float]:
    """Learning-signal statistics per group.

    - ``zero_variance_groups``: fraction of groups whose valid rewards are all equal (or with < 2 valid rows);
      split into ``/all_correct`` and ``/all_wrong`` when a verifier column ``correct`` [N] (1 = correct) exists.
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
    v = valid.bool() & torch.isfinite(reward)
    r = reward.double()
    big = torch.full((ng,), -math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(v, r, torch.full_like(r, -math.inf)), "amax")
    small = torch.full((ng,), math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(v, r, torch.full_like(r, math.inf)), "amin")
    cnt = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, v.double())
    zero = (cnt < 2) | ((big - small) <= 1e-12)
    m["zero_variance_groups"] = float(zero.double().mean())
    # within-group std
    s = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, torch.where(v, r, torch.zeros_like(r)))
    mean = s / cnt.clamp(min=1)
    dev = torch.where(v, r - mean[inv], torch.zeros_like(r))
    ss = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, dev * dev)
    std = torch.where(cnt > 1, (ss / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss))
    m["reward/group_std"] = float(std.mean())
    if correct is not None:
        c = torch.nan_to_num(correct.double(), nan=0.0).clamp(0, 1)
        cv = torch.where(v, (c >= 1.0).double(), torch.zeros_like(c))
        nc = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, cv)
        m["zero_variance_groups/all_correct"] = float((zero & (cnt > 0) & (nc == cnt)).double().mean())
        m["zero_variance_groups/all_wrong"] = float((zero & (nc == 0)).double().mean())
        # k = the group size (rows per group id, the same on every process: keys must match for the reduction)
        k = int(torch.bincount(inv, minlength=ng).max())
        has = cnt >= 1
        p1 = [pass_at_k(int(n), int(cc), 1) for n, cc in zip(cnt[has].tolist(), nc[has].tolist())]
        m["pass@1"] = sum(p1) / len(p1) if p1 else _NAN
        if k > 1:
            full = cnt >= k  # groups with a failed reward have fewer than k samples: left out
            pk = [pass_at_k(int(n), int(cc), k) for n, cc in zip(cnt[full].tolist(), nc[full].tolist())]
            m[f"pass@{k}"] = sum(pk) / len(pk) if pk else _NAN
    if advantages is not None:
        a = advantages
        if a.dim() == 2:  # per-token advantages: one value per completion (masked mean)
            msk = completion_mask if completion_mask is not None else torch.ones_like(a)
            a = (a * msk).sum(-1) / msk.sum(-1).clamp(min=1)
        a = a.detach().double()
        av = a[v]
        m["advantages/mean"] = _mean(av)
        m["advantages/std"] = float(av.std()) if av.numel() > 1 else 0.0
        m["advantages/abs_mean"] = _mean(av.abs())
        m["advantages/min"] = float(av.min()) if av.numel() else _NAN
        m["advantages/max"] = float(av.max()) if av.numel() else _NAN
        vi = v.nonzero().flatten()
        dadv = _distinct_per_group(inv[vi], ng, _quantise(a[vi])[:, None])
        has = cnt > 0
        m["advantages/distinct_frac"] = float((dadv[has] / cnt[has]).mean()) if has.any() else _NAN
        if rewards is not None:
            rmat = rewards if rewards.dim() == 2 else rewards[:, None]
            dcomb = _distinct_per_group(inv[vi], ng, _quantise(rmat[vi]))
            m["rewards/distinct_frac"] = float((dcomb[has] / cnt[has]).mean()) if has.any() else _NAN
            multi = dcomb >= 2
            m["advantages/collapse"] = float((1.0 - dadv[multi] / dcomb[multi]).clamp(min=0).mean()) \
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
    lens = lengths.double()
    tr = truncated.bool()
    v = valid.bool() & torch.isfinite(reward)
    m = {"length/mean": _mean(lens), "length/min": float(lens.min()) if lens.numel() else _NAN,
         "length/max": float(lens.max()) if lens.numel() else _NAN,
         "length/terminated_mean": _mean(lens[~tr]), "truncated": _mean(tr.double()),
         "truncated/reward_mean": _mean(reward[v & tr].double()),
         "finished/reward_mean": _mean(reward[v & ~tr].double())}
    inv, ng = _group_index(group_ids)
    if ng and v.sum() > 2:
        vd = v.double()
        cnt = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, vd).clamp(min=1)
        r = torch.where(v, reward.double(), torch.zeros_like(lens))
        lm = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, lens * vd) / cnt
        rm = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, r) / cnt
        dl, dr = (lens - lm[inv]) * vd, (r - rm[inv]) * vd
        den = math.sqrt(float((dl * dl).sum()) * float((dr * dr).sum()))
        m["length/reward_corr"] = float((dl * dr).sum()) / den if den > 1e-12 else _NAN
    else:
        m["length/reward_corr"] = _NAN
    return m


def token_metrics(sampler_logprobs: torch.Tensor, completion_mask: torch.Tensor, low_prob: float) -> dict[str, float]:
    """``tokens/low_prob_frac``: fraction of sampled tokens whose sampler probability is below ``low_prob``
    (falls as the policy sharpens: the low-probability-token side of entropy collapse);
    ``tokens/logprob_mean``: mean sampler log-prob per token (-log perplexity of the samples)."""
    msk = completion_mask.bool()
    lp = sampler_logprobs[msk].double()
    return {"tokens/low_prob_frac": _mean((lp < math.log(low_prob)).double()),
            "tokens/logprob_mean": _mean(lp)}


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
    msk = mask.bool()
    if not msk.any():
        return dict.fromkeys(("mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/prob_abs_mean",
                              "mismatch/kl", "mismatch/is_ratio_min", "mismatch/is_ratio_max"), _NAN)
    d = (trainer_logprobs.double() - sampler_logprobs.double())[msk]
    ad = d.abs()
    lr = (-d).clamp(-20, 20)  # log(pi_s / pi_t)
    k3 = torch.exp(-lr) - 1 + lr  # KL(s||t) k3 with ratio pi_t / pi_s
    ratio = torch.exp(d.clamp(-20, 20))
    return {"mismatch/logp_abs_mean": float(ad.mean()), "mismatch/logp_abs_max": float(ad.max()),
            "mismatch/prob_abs_mean": float((trainer_logprobs.double().exp() - sampler_logprobs.double().exp())[msk]
                                            .abs().mean()),
            "mismatch/kl": float(k3.mean()), "mismatch/is_ratio_min": float(ratio.min()),
            "mismatch/is_ratio_max": float(ratio.max())}


def memory_metrics(device: torch.device | None = None) -> dict[str, float]:
    """Peak resident memory of this process (``resource``; psutil's current RSS when installed) and, on CUDA,
    the peak allocated / reserved memory since the previous call (verl ``perf/max_memory_allocated_gb``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024
    m = {"memory/rss_peak_gb": peak_bytes / 2**30}
    try:
        import psutil

        m["memory/rss_gb"] = psutil.Process().memory_info().rss / 2**30
    except ImportError:  # pragma: no cover - psutil is a dependency of accelerate
        pass
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        m["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        m["memory/cuda_max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return m


def batch_metrics(batch, reward_info: dict, *, low_prob: float = 0.1) -> dict[str, float]:
    """All per-step metrics that depend only on the rollout batch (after rewards, shaping, filters, advantages)."""
    m: dict[str, float] = {}
    valid = batch.valid if batch.valid is not None else torch.isfinite(batch.reward)
    r = batch.reward[valid]
    m["reward/mean"] = _mean(r)
    m["reward/std"] = float(r.std()) if r.numel() > 1 else 0.0
    correct = None
    for k, name in enumerate(batch.reward_names):
        col = batch.rewards[:, k]
        ok = torch.isfinite(col)
        m[f"reward/{name}/mean"] = _mean(col[ok])
        m[f"reward/{name}/std"] = float(col[ok].std()) if int(ok.sum()) > 1 else 0.0
        m[f"reward/{name}/failures"] = float(reward_info.get("failures", {}).get(name, 0))
    if "correct" in batch.reward_names:
        correct = batch.rewards[:, batch.reward_names.index("correct")]
        ok = torch.isfinite(correct)
        m["accuracy"] = _mean((correct[ok] >= 1.0).double())
    m["valid"] = _mean(valid.double())
    m.update(length_metrics(batch.lengths, batch.truncated, batch.reward, valid, batch.group_ids))
    m.update(group_metrics(batch.reward, batch.rewards, batch.group_ids, valid, batch.advantages, correct,
                           batch.completion_mask))
    m.update(token_metrics(batch.sampler_logprobs, batch.completion_mask, low_prob))
    m["tokens/completion"] = float(batch.completion_mask.sum())
    m["tokens/prompt"] = float(batch.prompt_mask.sum())
    return m
