"""Loss aggregations: ``agg(mask, *, max_len) -> [N, T] weights w``, scalar loss = ``sum_{i,t} w_it L_it``.

Weights are computed over the whole mini-batch (the rows of one optimizer step) before it is split into
micro-batches, so gradient accumulation changes nothing. B = rows of the mini-batch with at least one token
(``dr_grpo``: all rows), |o_i| = sum_t m_it, L_max = ``max_len`` (rollout.max_new_tokens).

| postrl              | formula                              | verl loss_agg_mode         | TRL loss_type             |
|---------------------|--------------------------------------|----------------------------|---------------------------|
| token_mean          | sum m L / sum m                      | token-mean                 | dapo; bnpo (micro-batch)  |
| seq_mean_token_mean | (1/B) sum_i (1/|o_i|) sum_t m L      | seq-mean-token-mean        | grpo (also sapo)          |
| sequence            | (1/B) sum_i l_i (sequence-level loss;| forced for gspo, geo_mean, | grpo with importance_     |
|                     | the weights of seq_mean_token_mean)  | sapo                       | sampling_level='sequence' |
| seq_mean_token_sum  | (1/B) sum_i sum_t m L                | seq-mean-token-sum         | -                         |
| dr_grpo             | sum m L / (N L_max)                  | seq-mean-token-sum-norm    | dr_grpo                   |

Notes: TRL ``bnpo`` normalises by the tokens of each micro-batch, ``dapo`` (and ``cispo``) by the tokens of the
whole generation batch: postrl ``token_mean`` equals ``dapo`` when one generation batch is one optimizer step,
and ``bnpo`` when a mini-batch is one micro-batch. TRL ``grpo``/``dr_grpo`` average per micro-batch then divide
by the accumulation steps: equal to postrl when micro-batches have equal sizes. verl's
``seq-mean-token-sum-norm`` divides by ``loss_scale_factor`` (default: the padded response length) and the
global batch size; older verl releases omitted the batch size.
"""

from __future__ import annotations

import torch

from postrl.registry import register


@register("aggregation", "token_mean", source="DAPO; verl token-mean; TRL loss_type='dapo'/'bnpo'")
def token_mean(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = sum_{i,t} m_it L_it / sum_{i,t} m_it (every token of the mini-batch weighs the same)."""
    return mask / mask.sum().clamp(min=1.0)


@register("aggregation", "seq_mean_token_mean", source="GRPO paper; verl seq-mean-token-mean; TRL loss_type='grpo'")
def seq_mean_token_mean(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = (1/B) sum_i (1/|o_i|) sum_t m_it L_it, B = sequences with at least one token."""
    lens = mask.sum(-1, keepdim=True)
    nseq = (lens > 0).sum().clamp(min=1)
    return mask / lens.clamp(min=1.0) / nseq


register("aggregation", "sequence", source="GSPO / GMPO sequence-level objective; verl (forced for gspo, geo_mean, "
         "sapo); TRL importance_sampling_level='sequence' with loss_type='grpo'",
         description="loss = (1/B) sum_i l_i for sequence-level losses (same weights as seq_mean_token_mean)")(
    seq_mean_token_mean)


@register("aggregation", "seq_mean_token_sum", source="verl seq-mean-token-sum")
def seq_mean_token_sum(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = (1/B) sum_i sum_t m_it L_it."""
    nseq = (mask.sum(-1) > 0).sum().clamp(min=1)
    return mask / nseq


@register("aggregation", "dr_grpo", source="Understanding R1-Zero-Like Training (Dr. GRPO); TRL loss_type='dr_grpo'; "
          "verl seq-mean-token-sum-norm")
def dr_grpo(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = sum_{i,t} m_it L_it / (B * L_max), B = all rows, L_max = ``max_len`` (rollout.max_new_tokens;
    TRL ``max_completion_length``), or the padded width of the batch when not given."""
    L = max_len if max_len is not None else mask.shape[-1]
    return mask / (mask.shape[0] * L)


SEQUENCE_AGGREGATIONS = ("sequence", "seq_mean_token_mean")
