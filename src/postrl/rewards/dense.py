"""Token rewards [N, T] from a trained sequence reward model: RED (prefix-score differences) and attention credit.

Both read the reward model written by ``postrl rm train`` (``reward_model: <folder>``, loaded once per process by
:func:`postrl.rewards.model.load_cached`) and return one reward per policy completion token. They are the
producers of the batch fields ``red_token_reward`` and ``attention_token_reward`` (:mod:`postrl.fields`), which
the advantage estimators ``red`` and ``attention_credit`` (:mod:`postrl.advantages.token_rewards`) read.

The reward model scores ``prompt + completion`` with its own tokenizer. The completion's text is the decoded
policy tokens (special tokens skipped); the reward model's completion tokens are mapped onto the policy's by
character offsets: policy token t covers the characters (c_{t-1}, c_t] of the text (c_t = length of the decoded
first t + 1 tokens), reward-model token j ends at character e_j. With the same tokenizer (the usual case) the map
is the identity. Sequences longer than the reward model's ``max_length`` lose tokens from the left (as when it
scores); a prefix that lost its prompt is scored as it is.
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge, Le

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError
from postrl.registry import register
from postrl.rewards.model import load_cached


def _model(path: str, device: str, what: str):
    # lazy: postrl.reward_models.model loads transformers, which the rewards package does not need
    from postrl.reward_models.model import RewardModel

    rm = load_cached(path, device)
    if not isinstance(rm, RewardModel) or rm.kind == "prm":
        raise ConfigError(f"advantage.reward_model: {what} needs one outcome reward model (postrl rm train); "
                          f"'{path}' is {'a PRM' if isinstance(rm, RewardModel) else 'an ensemble of seeds'}")
    return rm


def _char_ends(tok, ids: list[int]) -> list[int]:
    """c_t = number of characters of the decoded first t + 1 tokens (special tokens skipped)."""
    if not ids:
        return []
    return [len(s) for s in tok.batch_decode([ids[:t + 1] for t in range(len(ids))], skip_special_tokens=True)]


def _encode(rm, prompt: str, text: str) -> tuple[list[int], int, list[int], int]:
    """(reward-model ids, index of the last prompt token (-1: none), char ends of its completion tokens, cut)."""
    p = list(rm._prompt_ids(prompt))
    c = rm._text_ids(text)
    ids = (p + c) or [rm._fallback_id()]
    cut = max(0, len(ids) - rm.max_length)
    return ids[cut:], len(p) - 1 - cut, _char_ends(rm.tokenizer, c), cut


def _policy_rows(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor):
    """Per row: (policy token ids, their char ends, the decoded text)."""
    out = []
    for i in range(completion_ids.shape[0]):
        n = int(completion_mask[i].sum())
        ids = completion_ids[i, :n].tolist()
        ends = _char_ends(tokenizer, ids)
        out.append((ids, ends, tokenizer.decode(ids, skip_special_tokens=True)))
    return out


def _head(rm, h: torch.Tensor) -> torch.Tensor:
    """The reward model's scalar at every position: mean of its heads (an ensemble of heads), ODIN's quality head."""
    out = rm.heads(h)
    return out[..., 1] if rm.kind == "odin" else out.mean(-1)


def _rm_batches(rm, prompts: list[str], rows: list, batch_size: int):
    """(row indices, their encodings, ids, mask) of the reward model's inputs, ``batch_size`` rows at a time."""
    for s in range(0, len(rows), batch_size):
        idx = list(range(s, min(s + batch_size, len(rows))))
        enc = [_encode(rm, prompts[i], rows[i][2]) for i in idx]
        ids, mask = rm.collate([e[0] for e in enc])
        yield idx, enc, ids, mask


@torch.no_grad()
def red_token_rewards(path: str, prompts: list[str], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                      tokenizer, *, device: str = "cpu", batch_size: int = 8) -> torch.Tensor:
    """r_t = RM(q, o_<=t) - RM(q, o_<t), one forward per completion: [N, T] (0 on padding).

    RED ("Unleashing Token-Level Rewards from Holistic Feedback via Reward Redistribution"): the reward model's
    score of every prefix, read from its causal backbone at the prefix's last token (a decoder's hidden state at
    position j depends on tokens <= j only, so one forward scores every prefix). RM(q, o_<0) is the score at the
    last prompt token. A policy token whose characters end no reward-model token (e.g. a special token) gets 0.
    The rewards telescope: sum_t r_t = RM(q, o) - RM(q).
    """
    rm = _model(path, device, "RED")
    rows = _policy_rows(tokenizer, completion_ids, completion_mask)
    out = torch.zeros(completion_ids.shape, dtype=torch.float32)
    was = rm.training
    rm.eval()
    try:
        for idx, enc, ids, mask in _rm_batches(rm, prompts, rows, batch_size):
            S = _head(rm, rm.hidden(ids, mask)).float().cpu()  # [B, L]
            for b, i in enumerate(idx):
                _, last_prompt, rm_ends, _ = enc[b]
                pol_ends = rows[i][1]
                if not pol_ends:
                    continue
                # RM position of each policy prefix: last prompt token + RM completion tokens ending within it
                k = torch.searchsorted(torch.tensor(rm_ends, dtype=torch.long),
                                       torch.tensor(pol_ends, dtype=torch.long), right=True)
                pos = last_prompt + k
                base = S[b, last_prompt] if last_prompt >= 0 else torch.zeros(())
                v = torch.where(pos >= 0, S[b, pos.clamp(min=0)], base)
                prev = torch.cat([base.reshape(1), v[:-1]])
                out[i, :len(pol_ends)] = v - prev
    finally:
        rm.train(was)
    return out


@torch.no_grad()
def attention_token_rewards(path: str, prompts: list[str], completion_ids: torch.Tensor,
                            completion_mask: torch.Tensor, tokenizer, *, beta: float = 1.0, device: str = "cpu",
                            batch_size: int = 8) -> torch.Tensor:
    """r_t = beta * R * a_t + (1 - beta) * R * 1[t = last]: [N, T] (0 on padding); sum_t r_t = R.

    "Dense Reward for Free in Reinforcement Learning from Human Feedback" (attention-based credit): R is the
    reward model's score of the whole completion; a_t is the attention that the scoring position (the last token)
    pays to the completion's tokens in the backbone's last layer, averaged over heads and renormalised over the
    completion tokens (a reward-model token's weight goes to the policy token whose characters hold its end).
    The paper shows the redistribution is potential-based shaping (the optimal policy is unchanged). Assumed: the
    last layer, the mean over heads, the renormalisation over completion tokens, and beta 1.0 (all of R spread by
    attention; beta < 1 keeps a share at the last token). The backbone must expose attention weights (a
    transformer; postrl switches it to eager attention).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"advantage.beta: expected a value in [0, 1], got {beta}")
    rm = _model(path, device, "attention credit")
    bb = rm.backbone
    if getattr(bb.config, "_attn_implementation", "eager") not in ("eager", None):
        bb.set_attn_implementation("eager")  # sdpa / flash kernels return no attention weights
    rows = _policy_rows(tokenizer, completion_ids, completion_mask)
    out = torch.zeros(completion_ids.shape, dtype=torch.float32)
    was = rm.training
    rm.eval()
    try:
        for idx, enc, ids, mask in _rm_batches(rm, prompts, rows, batch_size):
            o = bb(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
            h = (o.last_hidden_state if hasattr(o, "last_hidden_state") else o[0]).float()
            if not getattr(o, "attentions", None):
                raise ConfigError(f"advantage.reward_model: the backbone of '{path}' ({type(bb).__name__}) returns "
                                  "no attention weights; attention credit needs a transformer backbone")
            att = o.attentions[-1].float().mean(1)  # [B, L, L]
            last = (mask.sum(-1) - 1).clamp(min=0)
            R = _head(rm, h[torch.arange(h.shape[0]), last]).cpu()
            a_all = att[torch.arange(att.shape[0]), last].cpu()  # [B, L]: attention of the scoring position
            for b, i in enumerate(idx):
                _, last_prompt, rm_ends, _ = enc[b]
                pol_ends = rows[i][1]
                n_c = len(rm_ends)
                if not pol_ends or n_c == 0:
                    continue
                first = last_prompt + 1  # first RM completion token (after the left cut)
                j = torch.arange(n_c)
                keep = (j + first >= 0) & (j + first <= int(last[b]))
                a = torch.where(keep, a_all[b, (j + first).clamp(min=0)], torch.zeros(n_c))
                a = a / a.sum().clamp(min=1e-12)
                # the policy token holding each RM token's end: first t with c_t >= e_j
                t = torch.searchsorted(torch.tensor(pol_ends, dtype=torch.long),
                                       torch.tensor(rm_ends, dtype=torch.long)).clamp(max=len(pol_ends) - 1)
                w = torch.zeros(len(pol_ends)).index_add_(0, t, a)
                r = beta * R[b] * w
                r[-1] += (1.0 - beta) * R[b]
                out[i, :len(pol_ends)] = r
    finally:
        rm.train(was)
    return out


# ------------------------------------------------------------------------------------------------ field producers
@register("field", "red_token_reward", source="RED: Unleashing Token-Level Rewards from Holistic Feedback via Reward "
          "Redistribution")
def red_token_reward(ctx: ModelContext, batch: RolloutBatch, *, reward_model: str, device: str = "cpu",
                     rm_batch_size: Annotated[int, Ge(1)] = 8) -> torch.Tensor:
    """RM(q, o_<=t) - RM(q, o_<t) [N, T] of the ``reward_model`` folder (``postrl rm train``); the policy's
    tokenizer decodes the completion tokens (:func:`red_token_rewards`)."""
    return red_token_rewards(reward_model, list(batch.prompts), batch.completion_ids, batch.completion_mask,
                             ctx.tokenizer, device=device, batch_size=rm_batch_size)


@register("field", "attention_token_reward", source="Dense Reward for Free in Reinforcement Learning from Human "
          "Feedback")
def attention_token_reward(ctx: ModelContext, batch: RolloutBatch, *, reward_model: str,
                           beta: Annotated[float, Ge(0), Le(1)] = 1.0, device: str = "cpu",
                           rm_batch_size: Annotated[int, Ge(1)] = 8) -> torch.Tensor:
    """The ``reward_model`` folder's score spread over the tokens by its last-layer attention [N, T]
    (:func:`attention_token_rewards`)."""
    return attention_token_rewards(reward_model, list(batch.prompts), batch.completion_ids, batch.completion_mask,
                                   ctx.tokenizer, beta=beta, device=device, batch_size=rm_batch_size)
