"""The rollout batch: the one object that travels through the stages of a training step.

Shapes (N = number of completions = prompts x group size, T = longest completion, K = reward sources):

==================  =============  ===========================================================
field               shape / type   meaning
==================  =============  ===========================================================
prompt_ids          [N, P] long    left-padded prompt tokens (pad where ``prompt_mask`` is 0)
prompt_mask         [N, P] long    1 on real prompt tokens
completion_ids      [N, T] long    right-padded completion tokens (EOS included when emitted)
completion_mask     [N, T] float   1 on tokens that take part in the loss
group_ids           [N] long       completions of the same prompt share a group id
sampler_logprobs    [N, T] float   log-prob of each sampled token under the sampler (temperature applied)
truncated           [N] bool       completion hit ``max_new_tokens`` without EOS / stop string
prompts             list[str]      prompt text per completion
completions         list[str]      decoded completion text (stop string cut off)
columns             dict[str, list] per-completion data columns (answer, task label ...) passed to rewards
reward_names        list[str]      names of the K reward sources
rewards             [N, K] float   named reward matrix; NaN marks an entry whose reward failed. Raw after
                                   scoring; shaping stages may transform columns or append named ones (the
                                   raw matrix stays in ``raw_rewards``)
raw_rewards         [N, K0] float  the reward matrix as scored, before shaping (columns:
                                   ``extra['raw_reward_names']``); for metrics and filters on raw rewards
reward_weights      [K] float      weight of each source
reward              [N] float      scalar reward after shaping (NaN where excluded)
valid               [N] bool       False for completions excluded from the advantage (failed reward)
step_ends           [N, S] long    token index of the last token of each reasoning step (-1 padded); steps
                                   split at ``reward.step_delimiter`` (``postrl.reasoning_steps``)
step_rewards        [N, S] float   per-step scores of the process reward source (NaN padded); process
                                   shaping stages rewrite them (clip_prm, delta_prm, min_form, gated, potential)
advantages          [N] or [N, T]  set by the advantage stage
old_logprobs        [N, T]         policy log-probs before the update (None when one epoch: ratio uses detach)
ref_logprobs        [N, T]         reference model log-probs (None without a reference)
teacher_logprobs    [N, T]         teacher model log-probs (``model.teacher``; None without a teacher)
extra               dict           anything a stage adds for later stages or the logs; per-row entries
                                   (a tensor with N rows, a list of N) follow the rows in select/concat
==================  =============  ===========================================================

A stage reads what it needs and adds its own fields; it never reaches into the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    group_ids: torch.Tensor
    sampler_logprobs: torch.Tensor
    truncated: torch.Tensor
    prompts: list[str]
    completions: list[str]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    reward_names: list[str] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    reward_weights: torch.Tensor | None = None
    raw_rewards: torch.Tensor | None = None
    reward: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    step_ends: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        """Number of completion tokens per row (the mask's row sums)."""
        return self.completion_mask.sum(-1)

    @property
    def num_groups(self) -> int:
        return int(torch.unique(self.group_ids).numel())

    def select(self, index: torch.Tensor | list[int]) -> "RolloutBatch":
        """A new batch with only the rows in ``index`` (tensors, lists and columns alike)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = idx.tolist()
        out = {}
        n = len(self)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n and f.name != "reward_weights":
                out[f.name] = v[idx]
            elif isinstance(v, list) and f.name != "reward_names" and len(v) == n:
                out[f.name] = [v[i] for i in ids]
            elif f.name == "columns":
                out[f.name] = {k: [c[i] for i in ids] for k, c in v.items()}
            elif f.name == "extra":  # per-row entries (tensor with N rows, list of N) follow the rows
                out[f.name] = {k: (e[idx] if isinstance(e, torch.Tensor) and e.dim() > 0 and e.shape[0] == n
                                   else [e[i] for i in ids] if isinstance(e, list) and len(e) == n else e)
                               for k, e in v.items()}
            else:
                out[f.name] = v
        return RolloutBatch(**out)

    def masked(self) -> "RolloutBatch":
        """The same rows with ``valid`` False: no statistic, advantage 0, no loss (padding that keeps shapes)."""
        self.valid = torch.zeros(len(self), dtype=torch.bool)
        return self

    def group_order(self) -> list[int]:
        """Distinct group ids in order of first appearance."""
        return list(dict.fromkeys(self.group_ids.tolist()))

    def take_groups(self, gids: list[int]) -> "RolloutBatch":
        """The rows of the groups ``gids``."""
        keep = torch.isin(self.group_ids, torch.tensor(gids, dtype=self.group_ids.dtype))
        return self.select(torch.nonzero(keep).flatten())

    def pad_rows(self, n: int) -> "RolloutBatch":
        """Append masked copies of the last rows (each its own new group) until the batch has ``n`` rows."""
        extra = n - len(self)
        if extra <= 0:
            return self
        pad = self.select(torch.arange(len(self) - 1, len(self) - 1 - extra, -1).remainder(len(self))).masked()
        pad.group_ids = torch.arange(extra) + int(self.group_ids.max()) + 1
        out = RolloutBatch.concat([self, pad])
        out.group_ids = torch.cat([self.group_ids, pad.group_ids])
        return out

    @staticmethod
    def concat(batches: list["RolloutBatch"], pad_id: int = 0) -> "RolloutBatch":
        """Concatenate batches row-wise, re-padding prompts (left) and completions (right); group ids are kept
        distinct by offsetting each batch's ids past the previous ones."""
        if len(batches) == 1:
            return batches[0]
        P = max(b.prompt_ids.shape[1] for b in batches)
        T = max(b.completion_ids.shape[1] for b in batches)

        def lpad(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def rpad(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        offset, gids = 0, []
        for b in batches:
            gids.append(b.group_ids + offset)
            offset = int(gids[-1].max()) + 1 if len(b) else offset
        cols: dict[str, list] = {k: [] for k in batches[0].columns}
        for b in batches:
            for k in cols:
                cols[k].extend(b.columns[k])

        def cat_opt(name: str, pad_to: int | None = None) -> torch.Tensor | None:
            vals = [getattr(b, name) for b in batches]
            if any(v is None for v in vals):
                return None
            if pad_to is not None and vals[0].dim() == 2:
                vals = [rpad(v, pad_to, 0.0) for v in vals]
            return torch.cat(vals)

        def cat_steps(name: str, value: float) -> torch.Tensor | None:
            vals = [getattr(b, name) for b in batches]
            if any(v is None for v in vals):
                return None
            S = max(v.shape[1] for v in vals)
            return torch.cat([rpad(v, S, value) for v in vals])

        extra = dict(batches[0].extra)  # per-row entries present in every batch are concatenated (2-D: padded)
        for k in batches[0].extra:
            vals = [b.extra.get(k) for b in batches]
            if all(isinstance(e, list) and len(e) == len(b) for e, b in zip(vals, batches)):
                extra[k] = [x for e in vals for x in e]
            elif all(isinstance(e, torch.Tensor) and e.dim() > 0 and e.shape[0] == len(b)
                     for e, b in zip(vals, batches)):
                W = max(e.shape[1] for e in vals) if vals[0].dim() == 2 else 0
                extra[k] = torch.cat([rpad(e, W, 0.0) if e.dim() == 2 else e for e in vals])
            elif any((isinstance(e, list) or isinstance(e, torch.Tensor) and e.dim() > 0) and len(e) == len(b)
                     for e, b in zip(vals, batches)):
                extra.pop(k)  # per-row in some batches only: cannot be aligned with the rows

        return RolloutBatch(
            prompt_ids=torch.cat([lpad(b.prompt_ids, P, pad_id) for b in batches]),
            prompt_mask=torch.cat([lpad(b.prompt_mask, P, 0) for b in batches]),
            completion_ids=torch.cat([rpad(b.completion_ids, T, pad_id) for b in batches]),
            completion_mask=torch.cat([rpad(b.completion_mask, T, 0) for b in batches]),
            group_ids=torch.cat(gids),
            sampler_logprobs=torch.cat([rpad(b.sampler_logprobs, T, 0.0) for b in batches]),
            truncated=torch.cat([b.truncated for b in batches]),
            prompts=[p for b in batches for p in b.prompts],
            completions=[c for b in batches for c in b.completions],
            columns=cols,
            reward_names=batches[0].reward_names,
            rewards=cat_opt("rewards"),
            reward_weights=batches[0].reward_weights,
            raw_rewards=cat_opt("raw_rewards"),
            reward=cat_opt("reward"),
            valid=cat_opt("valid"),
            advantages=cat_opt("advantages", T),
            old_logprobs=cat_opt("old_logprobs", T),
            ref_logprobs=cat_opt("ref_logprobs", T),
            teacher_logprobs=cat_opt("teacher_logprobs", T),
            step_ends=cat_steps("step_ends", -1),
            step_rewards=cat_steps("step_rewards", float("nan")),
            extra=extra,
        )
