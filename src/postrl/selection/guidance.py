"""Expansions that bring knowledge from outside the policy into its groups (kind ``expansion``, ``joins``).

* ``demonstrations`` (RL-PLUS): an external demonstration, a column of the prompt rows, joins its prompt's group
  as one more completion; the loss ``rl_plus`` (:mod:`postrl.losses.hybrid`) weighs it with the
  multiple-importance-sampling ratio against the mixture behaviour policy.
* ``teacher_hint`` (KEPO): for a group where every completion failed, the teacher (``model.teacher``) writes a
  hint, the policy regenerates the group's completions with the hint in its context, and the reward-positive ones
  join the failed group (rejection sampling), trained as completions of the prompt without the hint.

Both return rows whose ``group_ids`` are the batch's own (:attr:`Expansion.joins`): the rows join the groups they
were made for, so the group's advantage baseline counts them. They carry ``extra['branch']`` True (selectors do
not count them as fresh attempts of the prompt; other expansions do not branch from them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge

from postrl.batch import RolloutBatch
from postrl.errors import ConfigError, DataError
from postrl.generation import left_pad
from postrl.groups import group_index
from postrl.registry import register
from postrl.selection.expansions import ExpandContext, Expansion, _first_per_group, _prompt_tokens, branch_batch
from postrl.selection.filters import raw_column

RL_PLUS = ("RL-PLUS: Countering Capability Boundary Collapse of LLMs in Reinforcement Learning with Hybrid-policy "
           "Optimization")
KEPO = "KEPO: Knowledge-Enhanced Preference Optimization for Reinforcement Learning with Reasoning"


def _own_rows(batch: RolloutBatch) -> torch.Tensor:
    """bool [N]: the batch's valid rollouts that no expansion made (``branch``)."""
    ok = batch.valid.bool() if batch.valid is not None else torch.ones(len(batch), dtype=torch.bool)
    if "branch" in batch.extra:
        ok = ok & ~batch.extra["branch"].bool()
    return ok


# ------------------------------------------------------------------------------------------------ RL-PLUS
def _demonstrations_check(params: dict, run: Any, where: str) -> dict:
    """``max_tokens`` defaults to the run's ``rollout.max_new_tokens``."""
    if run is not None and params.get("max_tokens") is None:
        params = {**params, "max_tokens": int(run.rollout.max_new_tokens)}
    return params


@register("expansion", "demonstrations", source=RL_PLUS, check=_demonstrations_check)
class Demonstrations(Expansion):
    """Mix external demonstrations (a column of the prompt rows) into their groups, as RL-PLUS's external data.

    For each group of the batch's own rollouts whose prompt row has a non-empty ``column`` value (default
    ``demonstration``: a text, or a list of texts), each demonstration becomes one more completion of that group:
    its text tokenized with the policy's tokenizer (no special tokens) followed by EOS, cut to ``max_tokens`` (default
    the run's ``rollout.max_new_tokens``; a cut one is ``truncated`` and loses its EOS); its completion text is
    the kept tokens decoded, scored with the run's rewards and shaping like any expansion's rows (a shaping stage
    that compares a group's rows sees the demonstrations apart); it joins the group (same group id), so the
    advantage stage normalises it with the group's rollouts (RL-PLUS: "mixed into" the group).

    The demonstrations were not sampled by the policy and their source's probabilities pi_omega are unknown. Their
    ``sampler_logprobs`` are set to the behaviour policy's log-probs at rollout time: log pi_theta_old(e_t | q,
    e_<t), the policy's log-prob of each demonstration token at the rollout temperature (one no-grad forward when
    the rows are made) -- the policy component of the mixture behaviour policy that ``rl_plus``'s importance ratio
    divides by; so the sampler-mismatch diagnostics and ``loss.tis`` see no mismatch on them. Token-in/token-out
    holds for the sampled rows only: a demonstration is text, tokenized here.

    Rows: ``extra['demonstration']`` True (False on the rollouts: the field ``rl_plus`` reads), ``extra['branch']``
    True. A batch whose rows have no column ``column`` is a :class:`DataError` naming it; a row whose value is
    None or empty gets no demonstration. Pair with the loss ``rl_plus``; with another loss the demonstrations are
    trained as if the policy had sampled them (plain importance ratio to pi_theta_old).
    """

    joins = True

    def __init__(self, *, column: str = "demonstration", max_tokens: Annotated[int, Ge(1)] | None = None):
        self.column, self.max_tokens = column, max_tokens

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch | None:
        if self.column not in batch.columns:
            raise DataError(f"filters.demonstrations.column: the prompt rows have no column '{self.column}' (columns: "
                            f"{', '.join(sorted(batch.columns)) or '(none)'}); give each prompt its demonstration text")
        if ctx.encode is None or ctx.logprobs is None:
            raise ConfigError("filters.demonstrations: this driver cannot tokenize demonstrations or compute their "
                              "log-probs under the policy (use postrl train)")
        rows, texts = [], []
        for i in _first_per_group(_own_rows(batch), batch.group_ids, 1):
            value = batch.columns[self.column][i]
            for text in (value if isinstance(value, (list, tuple)) else [value]):
                if text is not None and str(text) != "":
                    rows.append(i)
                    texts.append(str(text))
        if not rows:
            return None
        limit = self.max_tokens or max(batch.completion_ids.shape[1], 1)
        toks, truncated = [], []
        for text in texts:
            ids = list(ctx.encode(text)) + ([] if ctx.eos_id is None else [int(ctx.eos_id)])
            truncated.append(len(ids) > limit)
            toks.append(ids[:limit])
        n, T = len(rows), max(max(len(t) for t in toks), 1)
        comp = torch.full((n, T), ctx.pad_id, dtype=torch.long)
        mask = torch.zeros((n, T))
        for j, t in enumerate(toks):
            comp[j, :len(t)] = torch.tensor(t, dtype=torch.long)
            mask[j, :len(t)] = 1.0
        pids, pmask = left_pad([_prompt_tokens(batch, i) for i in rows], ctx.pad_id)
        out = RolloutBatch(
            prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask,
            group_ids=batch.group_ids[rows].clone(), sampler_logprobs=torch.zeros((n, T)),
            truncated=torch.tensor(truncated, dtype=torch.bool), prompts=[batch.prompts[i] for i in rows],
            completions=[ctx.decode(t) for t in toks],
            columns={k: [v[i] for i in rows] for k, v in batch.columns.items()},
            extra={"demonstration": torch.ones(n, dtype=torch.bool), "branch": torch.ones(n, dtype=torch.bool),
                   "completion_prefix": [""] * n})
        out.sampler_logprobs = ctx.logprobs(out).float() * mask  # log pi_theta_old(e_t): the behaviour policy's
        return out


# ------------------------------------------------------------------------------------------------ KEPO
HINT_TEMPLATE = "\n\nGive a short hint for the problem above that helps to solve it, without its final answer.\nHint:"
HINT_GUIDANCE = "\n(Hint: {hint})\n"


def _teacher_hint_check(params: dict, run: Any, where: str) -> dict:
    """A run needs a teacher; ``answer_column`` needs ``{answer}`` in the template."""
    if run is not None and run.model.teacher.path is None:
        raise ConfigError(f"{where}: teacher_hint needs a teacher to write the hints: set model.teacher.path (a "
                          f"model folder with the policy's vocabulary)")
    if params.get("answer_column") is not None and "{answer}" not in params.get("hint_template", HINT_TEMPLATE):
        raise ConfigError(f"{where}.hint_template: answer_column is set but the template has no {{answer}} to show "
                          f"it to the teacher")
    return params


@register("expansion", "teacher_hint", source=KEPO, needs=("teacher",), check=_teacher_hint_check)
class TeacherHint(Expansion):
    """Resample the groups where every completion failed with a hint the teacher writes (KEPO's hint exploration).

    After "KEPO" (knowledge-enhanced exploration: "hints learned from a teacher model ... rejectively sample
    reward-positive on-policy trajectories for RL, thereby mitigating exploration collapse"). A group qualifies
    when each of its own scored rollouts (valid, finite raw ``reward`` column, default ``correct``) is below
    ``threshold`` (default 1.0). For each, from its prompt tokens:
        1. the teacher (``model.teacher.path``) generates a hint from prompt + ``hint_template`` (raw text, no chat
           turn; ``{answer}`` is the row's ``answer_column`` value when set), at most ``hint_tokens`` (64) tokens,
           with the run's sampling parameters;
        2. the policy generates ``retries`` (default the run's G) completions from prompt + ``guidance_template``
           (``{hint}``: the hint's text);
        3. ``keep: positive`` (default, KEPO's rejection sampling): only the completions whose raw reward is >=
           ``threshold`` are kept (scored once here with the run's rewards, then with the batch's other
           expansion rows); ``keep: all`` keeps every one.
    The kept completions join the failed group (same group id), so its advantage contrasts them with the failures;
    they are trained as completions of the prompt without the hint (off-policy samples of the hint-conditioned
    policy, like ``retry_from_failure``'s guided retries: ``extra['guided']`` True, their ``sampler_logprobs``
    those of the hint-conditioned policy, so ``loss.tis`` corrects the mismatch). ``extra['hint']`` holds the hint
    text of each new row. Assumed where the abstract is silent: which groups get hints (all failed), the hint
    prompt, the rejection criterion (the verifiable reward reaching the threshold) and training without the hint.
    """

    joins = True

    def __init__(self, *, reward: str = "correct", threshold: float = 1.0, retries: Annotated[int, Ge(1)] | None = None,
                 keep: Literal["positive", "all"] = "positive", hint_tokens: Annotated[int, Ge(1)] = 64,
                 hint_template: str = HINT_TEMPLATE, guidance_template: str = HINT_GUIDANCE,
                 answer_column: str | None = None):
        self.reward, self.threshold, self.retries, self.keep = reward, threshold, retries, keep
        self.hint_tokens, self.hint_template, self.guidance_template = hint_tokens, hint_template, guidance_template
        self.answer_column = answer_column

    def _column(self, batch: RolloutBatch) -> torch.Tensor:
        return raw_column(batch.rewards, batch.reward_names, self.reward, "filters.teacher_hint",
                          getattr(batch, "raw_rewards", None), batch.extra.get("raw_reward_names"))

    def failed_groups(self, batch: RolloutBatch) -> list[int]:
        """The first own row of every group whose own scored rollouts all failed (at least one)."""
        x = self._column(batch)
        own = _own_rows(batch) & torch.isfinite(x)
        inv, ng = group_index(batch.group_ids)
        n_own = torch.zeros(ng).index_add_(0, inv, own.float())
        n_fail = torch.zeros(ng).index_add_(0, inv, (own & (x < self.threshold)).float())
        all_failed = (n_own > 0) & (n_fail == n_own)
        return _first_per_group(own & all_failed[inv], batch.group_ids, 1)

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch | None:
        rows = self.failed_groups(batch)
        if not rows:
            return None
        if ctx.teacher_generate is None or ctx.encode is None:
            raise ConfigError("filters.teacher_hint: this run has no teacher to write hints (set model.teacher.path; "
                              "the TRL adapter and the verl plug-in cannot run it)")
        if self.keep == "positive" and ctx.score is None:
            raise ConfigError("filters.teacher_hint.keep: positive needs the run's rewards inside the expansion, "
                              "which this driver cannot give; use keep: all")
        if self.answer_column is not None and self.answer_column not in batch.columns:
            raise DataError(f"filters.teacher_hint.answer_column: the prompt rows have no column "
                            f"'{self.answer_column}' (columns: {', '.join(sorted(batch.columns)) or '(none)'})")
        asks = []
        for i in rows:
            answer = "" if self.answer_column is None else str(batch.columns[self.answer_column][i])
            asks.append(_prompt_tokens(batch, i) + list(ctx.encode(self.hint_template.format(answer=answer))))
        seeds = [(ctx.seed + 15485863 * (j + 1)) % (2**62) for j in range(len(rows))]
        hints = [t.strip() for t in ctx.teacher_generate(asks, 1, seeds, self.hint_tokens).texts]
        guides = [list(ctx.encode(self.guidance_template.format(hint=h))) for h in hints]
        n = self.retries or ctx.group_size
        out = branch_batch(batch, rows, [0] * len(rows), n, ctx, guides=guides)
        out.group_ids = batch.group_ids[rows].repeat_interleave(n)
        out.extra["guided"] = torch.ones(len(out), dtype=torch.bool)  # (an empty hint is still the teacher's)
        out.extra["hint"] = [h for h in hints for _ in range(n)]
        if self.keep == "all":
            return out
        ctx.score(out)
        y = self._column(out)
        accept = torch.nonzero(torch.isfinite(y) & (y >= self.threshold)).flatten()
        return out.select(accept) if len(accept) else None


__all__ = ["Demonstrations", "TeacherHint", "HINT_TEMPLATE", "HINT_GUIDANCE"]
