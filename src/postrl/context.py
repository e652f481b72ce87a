"""What a stage, a field producer or a diagnostic may use of the model: one small object, never the trainer.

:class:`ModelContext` holds the policy, its tokenizer and device, the rollout temperature, the micro-batch size, the
run's sampling parameters, and two callbacks: ``generate`` (the run's generation backend) and ``score`` (the run's
rewards and shaping). postrl's trainer builds one per run; an integration (verl, TRL) or a notebook builds its own
from its model, and every stage and producer then runs unchanged:

    ctx = ModelContext(model, tokenizer, temperature=1.0)
    logp, entropy = ctx.logprobs(batch, with_entropy=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from postrl.generation import SamplingParams, encode_prompt, left_pad
from postrl.logprobs import completion_logprobs


def chunks(n: int, size: int):
    """Index tensors of consecutive slices of ``size`` rows over ``n`` rows."""
    for i in range(0, n, size):
        yield torch.arange(i, min(i + size, n))


@dataclass
class ModelContext:
    """The model-side interface of the pipeline.

    ``model``: the policy (unwrapped; the methods run it under ``torch.no_grad``); ``temperature``: the rollout
    temperature (log-probs and entropies are of the temperature-scaled policy, 0 read as 1);
    ``generate(prompt_token_lists, n, SamplingParams, seeds) -> Generation``; ``score(batch)`` fills the batch's
    rewards with the run's rewards and shaping (a score made for a baseline: stateful stages do not learn from
    it); ``logprob_fn``: the function computing per-token log-probs (:func:`postrl.logprobs.completion_logprobs`,
    or a faster path with its signature, e.g. ``postrl.accel``'s or an engine's own forward); ``autocast``: run
    the forward under bf16 autocast (``model.dtype=bfloat16``); ``teacher``: the run's frozen teacher model
    (``model.teacher.path``; None without one), whose log-probs are ``logprobs(batch, model=ctx.teacher)``;
    ``teacher_generate(prompt_token_lists, n, SamplingParams, seeds) -> Generation``: generation with the teacher
    (None without one)."""

    model: Any
    tokenizer: Any
    device: Any = "cpu"
    temperature: float = 1.0
    micro_batch_size: int = 8
    chat_template: str = "auto"
    sampling: SamplingParams | None = None
    generate: Callable | None = None
    score: Callable | None = None
    pad_id: int = 0
    logprob_fn: Callable = completion_logprobs
    autocast: bool = False
    teacher: Any = None
    teacher_generate: Callable | None = None

    def token_logprobs(self, batch, rows: torch.Tensor, *, model: Any = None, with_entropy: bool = False,
                       entropy_grad: bool = False, with_logits: bool = False):
        """(logp [n, T], entropy [n, T] or None, temperature-scaled logits [n, T, V] or None) of the completion
        tokens of rows ``rows`` under ``model`` (default the policy), on the device, differentiable (the update's
        forward); of the filtered distribution when ``sampling.logprobs='filtered'`` (as the sampler's)."""
        dev = self.device
        with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.logprob_fn(self.model if model is None else model, batch.prompt_ids[rows].to(dev),
                                  batch.prompt_mask[rows].to(dev), batch.completion_ids[rows].to(dev),
                                  self.temperature or 1.0, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                  return_logits=with_logits,
                                  **(self.sampling.logprob_filter() if self.sampling is not None else {}))
        return out if with_logits else (*out[:2], None)

    @torch.no_grad()
    def logprobs(self, batch, with_entropy: bool = False, model: Any = None) -> tuple[torch.Tensor, Any]:
        """(log pi(o_t | q, o_<t) [N, T], entropy [N, T] or None) of every completion token of ``batch``, under
        ``model`` (default the policy), in micro-batches, on the CPU (:meth:`token_logprobs` without gradient)."""
        lps, ents = [], []
        for idx in chunks(len(batch), self.micro_batch_size):
            lp, ent, _ = self.token_logprobs(batch, idx, model=model, with_entropy=with_entropy)
            lps.append(lp.float().cpu())
            if ent is not None:
                ents.append(ent.float().cpu())
        if not lps:
            return torch.zeros(batch.completion_ids.shape), None
        return torch.cat(lps), (torch.cat(ents) if ents else None)

    @torch.no_grad()
    def sequence_logprob(self, contexts: list[list[int]], targets: list[list[int]], mean: bool) -> torch.Tensor:
        """Sum (or mean) over the target tokens of log pi(target | context) at temperature 1, per pair [n]."""
        out = []
        for idx in chunks(len(contexts), self.micro_batch_size):
            ctx_ids, ctx_mask = left_pad([contexts[i] for i in idx.tolist()], self.pad_id)
            tg = [targets[i] for i in idx.tolist()]
            width = max(max(len(t) for t in tg), 1)
            tgt = torch.full((len(tg), width), self.pad_id, dtype=torch.long)
            tmask = torch.zeros((len(tg), width))
            for j, t in enumerate(tg):
                tgt[j, :len(t)] = torch.tensor(t, dtype=torch.long)
                tmask[j, :len(t)] = 1.0
            logp = self.logprob_fn(self.model, ctx_ids.to(self.device), ctx_mask.to(self.device),
                                   tgt.to(self.device), 1.0)[0].float().cpu()
            s = (logp * tmask).sum(-1)
            out.append(s / tmask.sum(-1).clamp(min=1) if mean else s)
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def completion_hidden(self, batch, after: bool = False) -> torch.Tensor:
        """Last-layer hidden state at the position that predicts each completion token (the state before it), or
        with ``after`` at the token's own position (the state once it is read: the state-action pair): [N, T, H]
        float32."""
        out = []
        P, T = batch.prompt_ids.shape[1] + int(after), batch.completion_ids.shape[1]
        for idx in chunks(len(batch), self.micro_batch_size):
            ids = torch.cat([batch.prompt_ids[idx], batch.completion_ids[idx]], 1).to(self.device)
            attn = torch.cat([batch.prompt_mask[idx], torch.ones_like(batch.completion_ids[idx])], 1).to(self.device)
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            o = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True,
                           use_cache=False, logits_to_keep=1)
            out.append(o.hidden_states[-1][:, P - 1:P - 1 + T].float().cpu())
        return torch.cat(out)

    @torch.no_grad()
    def prompt_hidden(self, prompts: list[str]) -> torch.Tensor:
        """Last-layer hidden state at the last token of each encoded prompt: [n, H] float32."""
        ids_all = [encode_prompt(self.tokenizer, p, self.chat_template) for p in prompts]
        out = []
        for idx in chunks(len(prompts), self.micro_batch_size):
            ids, mask = left_pad([ids_all[i] for i in idx.tolist()], self.pad_id)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            o = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           position_ids=pos.to(self.device), output_hidden_states=True, use_cache=False,
                           logits_to_keep=1)
            out.append(o.hidden_states[-1][:, -1].float().cpu())
        return torch.cat(out)
