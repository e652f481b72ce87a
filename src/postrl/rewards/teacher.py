"""Token rewards induced by a model trained with teacher forcing: r_t = log p_MLE(y_t | x, y_<t).

The producer of the batch field ``mle_token_reward`` [N, T] (:mod:`postrl.fields`), which the advantage estimator
``teacher_forcing`` (:mod:`postrl.advantages.token_rewards`) reads. The MLE model is a separately trained causal LM
(a folder written by ``save_pretrained``, e.g. ``postrl sft``'s output on the task's references), not the policy;
it is loaded once per process. When its vocabulary is the policy's, it scores the policy's own tokens; otherwise it
scores its own tokenization of the decoded completion, and each of its tokens' reward goes to the policy token
whose characters hold that token's end (as :mod:`postrl.rewards.dense` maps a reward model's tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
from annotated_types import Ge

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError, PostrlError
from postrl.generation import encode_prompt, left_pad
from postrl.logprobs import completion_logits
from postrl.io import load_once
from postrl.registry import register
from postrl.rewards.dense import _char_ends, _policy_rows
from postrl.models import load_model_and_tokenizer

def load_mle(path: str, device: str = "cpu"):
    """(model, tokenizer) of the MLE model folder (once per process; reloaded when its config changes)."""
    p = Path(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"advantage.mle_model '{path}': no config.json in it (expected a causal LM folder written "
                          "by save_pretrained, e.g. postrl sft's output)")

    def build():
        try:
            model, tok = load_model_and_tokenizer(p)
        except PostrlError as e:
            raise ConfigError(f"advantage.mle_model: {e}".replace("model.path ", "")) from None
        return model.to(device).eval(), tok

    return load_once(cfg, build, "mle", device)


def _same_vocab(a, b) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()


def token_rewards_from_logits(logits: torch.Tensor, ids: torch.Tensor, lengths: list[int], form: str) -> torch.Tensor:
    """Per-token rewards [n, T] from the logits [n, T, V] that predict each of the tokens ``ids`` [n, T]:
    'logprob': log softmax(logits_t)[y_t]; 'soft_q': logits_t[y_t] - logsumexp(logits_{t+1}) (the soft Bellman
    reward of a Q-function read from the logits; 0 for the value after the last token, the terminal state).
    0 beyond each row's length."""
    lp = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if form == "soft_q":
        q = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        v = torch.logsumexp(logits, -1)
        nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
        T = ids.shape[1]
        last = torch.tensor(lengths).unsqueeze(-1) - 1
        nxt = torch.where(torch.arange(T).unsqueeze(0) >= last, torch.zeros_like(nxt), nxt)
        lp = q - nxt
    mask = torch.arange(ids.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)
    return torch.where(mask, lp, torch.zeros_like(lp))


@torch.no_grad()
def _score(model, prompt_ids: list[list[int]], comp_ids: list[list[int]], form: str, pad: int, device: str,
           batch_size: int) -> list[list[float]]:
    out = []
    for s in range(0, len(prompt_ids), batch_size):
        P, pm = left_pad(prompt_ids[s:s + batch_size], pad)
        chunk = comp_ids[s:s + batch_size]
        lens = [len(c) for c in chunk]
        T = max(max(lens), 1)
        C = torch.full((len(chunk), T), pad, dtype=torch.long)
        for j, c in enumerate(chunk):
            C[j, :len(c)] = torch.tensor(c, dtype=torch.long)
        logits = completion_logits(model, P.to(device), pm.to(device), C.to(device)).cpu()
        r = token_rewards_from_logits(logits, C, lens, form)
        out += [r[j, :lens[j]].tolist() for j in range(len(chunk))]
    return out


@register("field", "mle_token_reward", source="Teacher Forcing Recovers Reward Functions for Text Generation")
def mle_token_reward(ctx: ModelContext, batch: RolloutBatch, *, mle_model: str,
                     mle_form: Literal["logprob", "soft_q"] = "logprob", mle_device: str = "cpu",
                     mle_batch_size: Annotated[int, Ge(1)] = 8) -> torch.Tensor:
    """r_t = log p_MLE(y_t | x, y_<t) [N, T] of the ``mle_model`` folder at temperature 1 (0 on padding).

    ``mle_form='soft_q'``: r_t = f(y_t | s_t) - log sum_a exp f(a | s_{t+1}) with f the MLE model's logits (0 for
    the value after the last token): the model read as a soft Q-function, which differs from the log-prob by the
    potential-based term V(s_t) - V(s_{t+1}), so sum_t r_t = sum_t log p_t + V(s_0). The prompt is encoded as for
    generation (the run's chat template) when the MLE model has its own vocabulary; with the policy's vocabulary its
    token ids are used as they are."""
    model, tok = load_mle(mle_model, mle_device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    N, T = batch.completion_ids.shape
    out = torch.zeros((N, T), dtype=torch.float32)
    lens = batch.completion_mask.sum(-1).long().tolist()
    if _same_vocab(tok, ctx.tokenizer):
        prompts = [batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() for i in range(N)]
        comps = [batch.completion_ids[i, :lens[i]].tolist() for i in range(N)]
        for i, r in enumerate(_score(model, prompts, comps, mle_form, pad, mle_device, mle_batch_size)):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
        return out
    rows = _policy_rows(ctx.tokenizer, batch.completion_ids, batch.completion_mask)
    prompts = [encode_prompt(tok, p, ctx.chat_template) for p in batch.prompts]
    comps = [tok(text, add_special_tokens=False)["input_ids"] for _, _, text in rows]
    scores = _score(model, prompts, comps, mle_form, pad, mle_device, mle_batch_size)
    for i, ((_, pol_ends, _), mle_ids, r) in enumerate(zip(rows, comps, scores)):
        if not pol_ends or not mle_ids:
            continue
        t = torch.searchsorted(torch.tensor(pol_ends, dtype=torch.long),
                               torch.tensor(_char_ends(tok, mle_ids), dtype=torch.long)).clamp(max=len(pol_ends) - 1)
        out[i, :len(pol_ends)] = torch.zeros(len(pol_ends)).index_add_(0, t, torch.tensor(r, dtype=torch.float32))
    return out


__all__ = ["mle_token_reward", "load_mle", "token_rewards_from_logits"]
