"""Loss aggregations: ``agg(mask, *, max_len, rows) -> [N, T] weights w``, scalar loss = ``sum_{i,t} w_it L_it``.

Weights are computed over the whole mini-batch (the rows of one optimizer step) before it is split into
micro-batches, so gradient accumulation changes nothing. |o_i| = sum_t m_it, L_max = ``max_len``
(rollout.max_new_tokens). B = the number of rows the sequence averages divide by: ``rows.sum()`` when ``rows``
(bool [N]) is given, else every row of ``mask`` (N). One convention for every aggregation that averages over
rows (``seq_mean_token_mean``, ``sequence``, ``seq_mean_token_sum``, ``dr_grpo``).

Rows with an all-zero loss mask (a completion whose reward failed, an empty completion): the trainer picks B with
``loss.agg_rows`` (:meth:`postrl.losses.objective.Objective.rows`):
- ``all`` (default): every row of the mini-batch counts, an empty one contributing 0 to the sum, so a failed reward
  does not rescale the other rows' weights. This is every anchor's convention: verl's trainer passes
  ``global_batch_size`` = the rows of the global mini-batch to ``agg_loss``; verl ``geo_mean`` averages over all
  rows; TRL ``grpo`` / ``sapo`` take ``.mean()`` over the rows of the micro-batch (an empty row's token mean is
  0 through ``clamp(min=1)``) and ``dr_grpo`` divides by ``size(0) * max_completion_length``. Rows postrl adds only
  to keep shapes (masked copies that pad a filtered batch or even out DDP processes: ``valid`` False with a finite
  reward) do not count.
- ``nonempty``: B = rows with at least one loss token: each failed reward scales the other rows' weights by
  N / B (verl ``agg_loss`` called without ``global_batch_size``, as its unit tests do; postrl before this option).

| postrl              | formula                              | verl loss_agg_mode         | TRL loss_type             |
|---------------------|--------------------------------------|----------------------------|---------------------------|
| token_mean          | sum m L / sum m                      | token-mean                 | dapo; bnpo (micro-batch)  |
| seq_mean_token_mean | (1/B) sum_i (1/|o_i|) sum_t m L      | seq-mean-token-mean        | grpo, sapo                |
| sequence            | (1/B) sum_i l_i (sequence-level loss;| seq-mean-token-mean, which | grpo with importance_     |
|                     | the weights of seq_mean_token_mean)  | verl forces for geo_mean   | sampling_level='sequence' |
|                     |                                      | and sapo (not for gspo)    |                           |
| seq_mean_token_sum  | (1/B) sum_i sum_t m L                | seq-mean-token-sum         | -                         |
| dr_grpo             | sum m L / (B L_max)                  | seq-mean-token-sum-norm    | dr_grpo                   |

Notes: TRL ``bnpo`` normalises by the tokens of each micro-batch, ``dapo`` (and ``cispo``) by the tokens of the
whole generation batch: postrl ``token_mean`` equals ``dapo`` when one generation batch is one optimizer step,
and ``bnpo`` when a mini-batch is one micro-batch. TRL ``grpo``/``dr_grpo`` average per micro-batch then divide
by the accumulation steps: equal to postrl when micro-batches have equal sizes. verl's
``seq-mean-token-sum-norm`` divides by ``loss_scale_factor`` (default: the padded response length) and the
global batch size; older verl releases omitted the batch size. verl 0.9.1's ``gspo`` passes ``loss_agg_mode``
through (set ``seq-mean-token-mean`` there, ``loss.agg=sequence`` here, for the paper's objective).
"""

from __future__ import annotations

import torch

from postrl.registry import register

AGG_ROWS = ("all", "nonempty")


def _num_rows(mask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """B (at least 1): ``rows.sum()``, or N when ``rows`` is None."""
    n = rows.sum() if rows is not None else torch.tensor(mask.shape[0])
    return n.to(mask.dtype).clamp(min=1.0)


@register("aggregation", "token_mean", source="DAPO; verl token-mean; TRL loss_type='dapo'/'bnpo'")
def token_mean(mask: torch.Tensor, *, max_len: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """loss = sum_{i,t} m_it L_it / sum_{i,t} m_it (every token of the mini-batch weighs the same; ``rows``
    unused: an empty row has no token)."""
    return mask / mask.sum().clamp(min=1.0)


@register("aggregation", "seq_mean_token_mean", source="GRPO paper; verl seq-mean-token-mean; TRL loss_type='grpo'")
def seq_mean_token_mean(mask: torch.Tensor, *, max_len: int | None = None,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """loss = (1/B) sum_i (1/|o_i|) sum_t m_it L_it; B = ``rows.sum()``, or all N rows (module docstring)."""
    lens = mask.sum(-1, keepdim=True)
    return mask / lens.clamp(min=1.0) / _num_rows(mask, rows)


register("aggregation", "sequence", source="GSPO / GMPO sequence-level objective; verl seq-mean-token-mean (forced "
         "for geo_mean and sapo); TRL importance_sampling_level='sequence' with loss_type='grpo'",
         description="loss = (1/B) sum_i l_i for sequence-level losses (same weights as seq_mean_token_mean)")(
    seq_mean_token_mean)


@register("aggregation", "seq_mean_token_sum", source="verl seq-mean-token-sum")
def seq_mean_token_sum(mask: torch.Tensor, *, max_len: int | None = None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """loss = (1/B) sum_i sum_t m_it L_it; B = ``rows.sum()``, or all N rows."""
    return mask / _num_rows(mask, rows)


@register("aggregation", "dr_grpo", source="Understanding R1-Zero-Like Training (Dr. GRPO); TRL loss_type='dr_grpo'; "
          "verl seq-mean-token-sum-norm")
def dr_grpo(mask: torch.Tensor, *, max_len: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """loss = sum_{i,t} m_it L_it / (B * L_max); B = ``rows.sum()``, or all N rows; L_max = ``max_len``
    (rollout.max_new_tokens; TRL ``max_completion_length``), or the padded width of the batch when not given."""
    L = max_len if max_len is not None else mask.shape[-1]
    return mask / (_num_rows(mask, rows) * L)


SEQUENCE_AGGREGATIONS = ("sequence", "seq_mean_token_mean")
