"""Trainer-side support for the filter, rollout-option and advantage stages.

* producers: inputs an advantage estimator (or an expanding filter) names as a positional parameter that the
  rollout batch does not hold; each is computed here from the policy with a no-grad forward (or a greedy
  generation) and stored in ``batch.extra``:
    greedy_reward   [N]  reward (same rewards and shaping) of the greedy completion of the row's prompt (remax)
    token_entropy   [N, T] the policy's token entropy at the rollout temperature (rl_zvp, cure_branching)
    prompt_logprob  [N]  mean log-prob of the prompt tokens under the policy, -log perplexity (confidence_scaled)
    info_gain       [N]  log pi(answer | q, o) - log pi(answer | q), answer tokens summed (information_gain)
  and ``completion_hidden`` gives the last hidden state at each completion position (GAE's value head).
* batch helpers: masking groups out (valid False), padding, group bookkeeping for the refill loop.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch

from postrl.batch import RolloutBatch
from postrl.models import completion_logprobs
from postrl.pipeline import signature
from postrl.rollout.base import SamplingParams
from postrl.rollout.hf import left_pad


def positional_fields(fn: Any) -> list[str]:
    """Names of the batch fields a stage (function or instance) reads: its positional parameters."""
    return [p.name for p in signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _chunks(n: int, size: int):
    for i in range(0, n, size):
        yield torch.arange(i, min(i + size, n))


def _group_first_rows(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each group [ng], group number of each row [N])."""
    _, inv = torch.unique(batch.group_ids, return_inverse=True)
    ng = int(inv.max()) + 1 if len(batch) else 0
    first = torch.full((ng,), len(batch), dtype=torch.long).scatter_reduce(0, inv, torch.arange(len(batch)), "amin")
    return first, inv


# ------------------------------------------------------------------------------------------------ producers
@torch.no_grad()
def token_entropy(tr, batch: RolloutBatch, params: dict) -> torch.Tensor:
    dev, out = tr.acc.device, []
    for idx in _chunks(len(batch), tr.cfg.train.micro_batch_size):
        _, ent = completion_logprobs(tr.policy, batch.prompt_ids[idx].to(dev), batch.prompt_mask[idx].to(dev),
                                     batch.completion_ids[idx].to(dev), tr.cfg.rollout.temperature or 1.0,
                                     with_entropy=True)[:2]
        out.append(ent.float().cpu())
    return torch.cat(out) * batch.completion_mask


@torch.no_grad()
def _sequence_logprob(model, contexts: list[list[int]], targets: list[list[int]], pad_id: int, device,
                      mbs: int, mean: bool) -> torch.Tensor:
    """sum (or mean) over target tokens of log pi(target | context), per pair; temperature 1."""
    out = []
    for idx in _chunks(len(contexts), mbs):
        ctx_ids, ctx_mask = left_pad([contexts[i] for i in idx.tolist()], pad_id)
        tg = [targets[i] for i in idx.tolist()]
        width = max(max(len(t) for t in tg), 1)
        tgt = torch.full((len(tg), width), pad_id, dtype=torch.long)
        tmask = torch.zeros((len(tg), width))
        for j, t in enumerate(tg):
            tgt[j, :len(t)] = torch.tensor(t, dtype=torch.long)
            tmask[j, :len(t)] = 1.0
        logp = completion_logprobs(model, ctx_ids.to(device), ctx_mask.to(device), tgt.to(device), 1.0)[0].cpu()
        s = (logp * tmask).sum(-1)
        out.append(s / tmask.sum(-1).clamp(min=1) if mean else s)
    return torch.cat(out) if out else torch.zeros(0)


def _pad(tr) -> int:
    pad = getattr(tr.backend, "pad_id", None)
    return int(pad if pad is not None else (tr.tokenizer.pad_token_id or 0))


def _prompt_tokens(batch: RolloutBatch, i: int) -> list[int]:
    return batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()


@torch.no_grad()
def prompt_logprob(tr, batch: RolloutBatch, params: dict) -> torch.Tensor:
    first, inv = _group_first_rows(batch)
    prompts = [_prompt_tokens(batch, int(i)) for i in first]
    # log pi(q_t | q_<t) for t >= 1: context = the first token, target = the rest
    ctx = [p[:1] for p in prompts]
    tgt = [p[1:] for p in prompts]
    lp = _sequence_logprob(tr.policy, ctx, tgt, _pad(tr), tr.acc.device, tr.cfg.train.micro_batch_size,
                           mean=True)
    lp = torch.where(torch.tensor([len(t) > 0 for t in tgt]), lp, torch.zeros_like(lp))
    return lp[inv]


@torch.no_grad()
def info_gain(tr, batch: RolloutBatch, params: dict) -> torch.Tensor:
    column = params.get("answer_column", "answer")
    if column not in batch.columns:
        raise ValueError(f"advantage.answer_column: the batch has no column '{column}'; columns: "
                         f"{', '.join(sorted(batch.columns)) or '(none)'}")
    answers = batch.columns[column]
    tok = tr.tokenizer
    ans = [tok(str(a), add_special_tokens=False)["input_ids"] if a is not None else [] for a in answers]
    lens = batch.completion_mask.sum(-1).long().tolist()
    with_o = [_prompt_tokens(batch, i) + batch.completion_ids[i, :lens[i]].tolist() for i in range(len(batch))]
    first, inv = _group_first_rows(batch)
    without = [_prompt_tokens(batch, int(i)) for i in first]
    mbs, dev = tr.cfg.train.micro_batch_size, tr.acc.device
    lp1 = _sequence_logprob(tr.policy, with_o, ans, _pad(tr), dev, mbs, mean=False)
    lp0 = _sequence_logprob(tr.policy, without, [ans[int(i)] for i in first], _pad(tr), dev, mbs, mean=False)
    ig = lp1 - lp0[inv]
    return torch.where(torch.tensor([len(a) > 0 for a in ans]), ig, torch.full_like(ig, math.nan))


@torch.no_grad()
def greedy_reward(tr, batch: RolloutBatch, params: dict) -> torch.Tensor:
    """Greedy completion of each group's context, scored with the run's rewards and shaping (one row per group)."""
    cfg = tr.cfg
    first, inv = _group_first_rows(batch)
    rows = first.tolist()
    sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                        stop=list(cfg.rollout.stop))
    gen = tr.backend.generate([_prompt_tokens(batch, i) for i in rows], 1, sp, [0] * len(rows))
    prefix = batch.extra.get("completion_prefix")
    g = RolloutBatch(prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
                     completion_mask=gen.completion_mask.float(), group_ids=torch.arange(len(rows)),
                     sampler_logprobs=gen.logprobs, truncated=gen.truncated, prompts=[batch.prompts[i] for i in rows],
                     completions=[(prefix[i] if prefix else "") + t for i, t in zip(rows, gen.texts)],
                     columns={k: [v[i] for i in rows] for k, v in batch.columns.items()})
    tr.score(g)
    return g.reward.float()[inv]


PRODUCERS: dict[str, Callable] = {
    "token_entropy": token_entropy,
    "prompt_logprob": prompt_logprob,
    "info_gain": info_gain,
    "greedy_reward": greedy_reward,
}


def produce(tr, batch: RolloutBatch, fields: list[str], params: dict) -> None:
    """Fill ``batch.extra`` with every field in ``fields`` that a producer makes and the batch lacks."""
    for name in fields:
        if name in PRODUCERS and name not in batch.extra:
            batch.extra[name] = PRODUCERS[name](tr, batch, params)


@torch.no_grad()
def completion_hidden(tr, batch: RolloutBatch) -> torch.Tensor:
    """Last-layer hidden state at the position that predicts each completion token: [N, T, H] float32 (CPU)."""
    dev, out = tr.acc.device, []
    T = batch.completion_ids.shape[1]
    for idx in _chunks(len(batch), tr.cfg.train.micro_batch_size):
        ids = torch.cat([batch.prompt_ids[idx], batch.completion_ids[idx]], 1).to(dev)
        attn = torch.cat([batch.prompt_mask[idx], torch.ones_like(batch.completion_ids[idx])], 1).to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        o = tr.policy(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True,
                      use_cache=False, logits_to_keep=1)
        P = batch.prompt_ids.shape[1]
        out.append(o.hidden_states[-1][:, P - 1:P - 1 + T].float().cpu())
    return torch.cat(out)


@torch.no_grad()
def prompt_features(tr, rows: list[dict]) -> torch.Tensor:
    """Last-layer hidden state at the last prompt token of each row's encoded prompt: [n, H] float32 (CPU)."""
    from postrl.models import encode_prompt

    dev, out = tr.acc.device, []
    ids_all = [encode_prompt(tr.tokenizer, r["prompt"], tr.cfg.model.chat_template) for r in rows]
    for idx in _chunks(len(rows), tr.cfg.train.micro_batch_size):
        ids, mask = left_pad([ids_all[i] for i in idx.tolist()], _pad(tr))
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        o = tr.policy(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                      output_hidden_states=True, use_cache=False, logits_to_keep=1)
        out.append(o.hidden_states[-1][:, -1].float().cpu())
    return torch.cat(out)


# ------------------------------------------------------------------------------------------------ batch helpers
def mask_rows(batch: RolloutBatch) -> RolloutBatch:
    """The same rows with ``valid`` False: no statistic, advantage 0, no loss (padding that keeps shapes)."""
    batch.valid = torch.zeros(len(batch), dtype=torch.bool)
    return batch


def groups_in_order(batch: RolloutBatch) -> list[int]:
    """Distinct group ids in order of first appearance."""
    return list(dict.fromkeys(batch.group_ids.tolist()))


def take_groups(batch: RolloutBatch, gids: list[int]) -> RolloutBatch:
    keep = torch.isin(batch.group_ids, torch.tensor(gids, dtype=batch.group_ids.dtype))
    return batch.select(torch.nonzero(keep).flatten())


def pad_rows(batch: RolloutBatch, n: int) -> RolloutBatch:
    """Append masked copies of the last rows (each its own new group) until the batch has ``n`` rows."""
    extra = n - len(batch)
    if extra <= 0:
        return batch
    idx = torch.arange(len(batch) - 1, len(batch) - 1 - extra, -1).remainder(len(batch))
    pad = mask_rows(batch.select(idx))
    pad.group_ids = torch.arange(extra) + int(batch.group_ids.max()) + 1
    out = RolloutBatch.concat([batch, pad])
    out.group_ids = torch.cat([batch.group_ids, pad.group_ids])
    return out


# ------------------------------------------------------------------------------------------------ set-up checks
# estimators whose baseline is the group: with one completion per prompt every advantage is 0
GROUP_BASELINE = {"grpo", "dr_grpo", "rloo", "opo", "gpg", "pass_at_k", "reinforce_pp_baseline", "gdpo", "role_aware",
                  "rl_zvp", "confidence_scaled", "riskpo", "aem", "information_gain", "rank_tournament"}


def check_stages(cfg, filters: list) -> list[str]:
    """Reject meaningless combinations (ConfigError) and return warnings for dubious ones."""
    from postrl.errors import ConfigError

    selectors = [name for fn, _, name in filters if hasattr(fn, "select")]
    if len(selectors) > 1:
        raise ConfigError(f"filters: at most one prompt selector per run, got {', '.join(selectors)}")
    for fn, params, name in filters:
        if hasattr(fn, "validate"):
            fn.validate(cfg)
        if name == "dynamic_sampling" and cfg.rollout.group_size < 2:
            raise ConfigError("filters.dynamic_sampling: rollout.group_size must be >= 2 (a group of one completion "
                              "has no reward variance, so every group would be dropped)")
    warn = []
    if cfg.rollout.group_size == 1 and cfg.advantage.name in GROUP_BASELINE:
        warn.append(f"advantage '{cfg.advantage.name}' uses the group as its baseline and rollout.group_size=1: every "
                    f"advantage is 0 (use reinforce_pp, remax or gae for one completion per prompt)")
    return warn


def max_attempts(filters: list) -> int:
    """Generation rounds allowed per step: the largest ``max_attempts`` of the keep-mask filters (1 if none)."""
    best = 1
    for fn, params, _ in filters:
        if callable(fn) and not inspect.isclass(fn) and not hasattr(fn, "select") and not hasattr(fn, "expand"):
            p = inspect.signature(fn).parameters.get("max_attempts")
            if p is not None:
                best = max(best, int(params.get("max_attempts", p.default)))
    return best


def is_keep_mask(fn: Any) -> bool:
    """A filter that returns a keep mask (a function, or a class instance with ``__call__`` and no other hook)."""
    hooks = ("select", "expand", "plan")
    return callable(fn) and not any(hasattr(fn, h) for h in hooks)


def generate_multi_temperature(backend, prompt_ids: list[list[int]], params: SamplingParams, temps: list[float],
                               seeds: list[int]):
    """Generate G = len(temps) completions per prompt, completion j at temps[j]; returns (Generation, [N] temps)."""
    from dataclasses import replace

    from postrl.rollout.base import Generation

    G, n_prompts = len(temps), len(prompt_ids)
    by_t: dict[float, list[int]] = {}
    for j, t in enumerate(temps):
        by_t.setdefault(t, []).append(j)
    parts = {}
    for t, js in by_t.items():
        s = [(x + int(round(t * 1000)) * 104729) % (2**62) for x in seeds]
        parts[t] = (js, backend.generate(prompt_ids, len(js), replace(params, temperature=t), s))
    width = max(g.completion_ids.shape[1] for _, g in parts.values())
    P = max(g.prompt_ids.shape[1] for _, g in parts.values())
    N = n_prompts * G
    pad = int(getattr(backend, "pad_id", 0) or 0)
    comp = torch.full((N, width), pad, dtype=torch.long)
    lp, mask = torch.zeros((N, width)), torch.zeros((N, width))
    pids = torch.full((N, P), pad, dtype=torch.long)
    pmask = torch.zeros((N, P), dtype=torch.long)
    trunc = torch.zeros(N, dtype=torch.bool)
    texts: list[str] = [""] * N
    row_t = torch.zeros(N)
    for t, (js, g) in parts.items():
        k = len(js)
        for c, j in enumerate(js):
            src = torch.arange(n_prompts) * k + c
            dst = torch.arange(n_prompts) * G + j
            w = g.completion_ids.shape[1]
            comp[dst, :w], lp[dst, :w], mask[dst, :w] = g.completion_ids[src], g.logprobs[src], g.completion_mask[src]
            pids[dst, P - g.prompt_ids.shape[1]:] = g.prompt_ids[src]
            pmask[dst, P - g.prompt_ids.shape[1]:] = g.prompt_mask[src]
            trunc[dst] = g.truncated[src]
            row_t[dst] = t
            for a, b in zip(src.tolist(), dst.tolist()):
                texts[b] = g.texts[a]
    return Generation(prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask, logprobs=lp,
                      truncated=trunc, texts=texts), row_t
