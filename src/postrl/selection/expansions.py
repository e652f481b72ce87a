"""Expansions (kind ``expansion``; config ``filters: [...]``): new groups made from the scored batch.

* ``rehearsal``: completions pre-sampled once from the initial policy, with their initial-policy log-probs,
  appended unscored after the keep filters for the ``f_divergence_rehearsal`` regulariser (DPH-RL).
* ``avatar_replay`` (:mod:`postrl.selection.replay`): stored past groups with reward variance replace the groups
  without (AVATAR), after the keep filters.
* ``cure_branching`` / ``retry_from_failure`` (protocol :class:`Expansion`): after
  scoring, ``expand(batch, ctx)`` returns new groups that are
  generated from a prefix of existing completions (the prefix becomes part of the prompt, so only the continuation
  is trained on); the trainer scores them and appends them to the batch. ``ctx`` (:class:`ExpandContext`) gives
  the stage a generation callback with the run's sampling parameters; the stage never touches the trainer.

The completion text given to the rewards is prefix + continuation, so verifiers judge the whole answer. The
continuation has the run's full ``max_new_tokens`` budget (prefix + continuation can be longer than an ordinary
completion). Rows made this way carry ``extra['branch'] = True`` (selectors do not count them as fresh attempts
of the prompt) and ``extra['completion_prefix']`` (the prefix text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable

import torch
from annotated_types import Ge

from postrl.batch import RolloutBatch
from postrl.errors import ConfigError, DataError
from postrl.generation import left_pad
from postrl.groups import group_index
from postrl.io import read_jsonl
from postrl.registry import register
from postrl.selection.filters import raw_column


class Expansion:
    """Protocol of kind ``expansion``: ``expand(batch, ctx)`` returns new groups made from the scored batch
     or None; ``reads`` names the batch fields it reads beyond the batch's own
    (produced first when missing, like any stage's positional fields). ``scored`` False: the rows it returns are
    not rollouts to score, filter or compare (they carry their own fields, ``valid`` False so that no advantage,
    policy loss or metric counts them); they are appended once, after the keep filters (e.g. ``rehearsal``).
    ``mode = "replace"`` (with ``scored`` False): ``expand`` returns the batch itself with some groups swapped for
    as many rows (``avatar_replay``). A stateful expansion (a :class:`postrl.stages.Stateful` too) records the
    step's final batch in ``observe``. ``joins`` True: the rows it returns join groups of the batch (their
    ``group_ids`` are the batch's own ids, kept as they are) instead of forming new groups (e.g. ``demonstrations``,
    ``teacher_hint``)."""

    reads: tuple[str, ...] = ()
    scored: bool = True
    mode: str = "append"
    joins: bool = False

    def expand(self, batch: Any, ctx: Any) -> Any:
        return None



@dataclass
class ExpandContext:
    """What an expanding stage may use: ``generate(prompt_token_lists, n, seeds)`` -> ``Generation`` with the run's
    sampling parameters; ``decode(token_ids)`` -> text (special tokens skipped); ``encode(text)`` -> token ids
    (no special tokens); the run's group size and a seed for this step and attempt. Optional (None where the driver
    cannot give them): ``score(batch)`` fills a batch's rewards with the run's rewards and shaping (stateful stages
    do not learn from it); ``logprobs(batch)`` -> [N, T] the current policy's log-probs of the batch's completion
    tokens at the rollout temperature (no gradient); ``teacher_generate(prompt_token_lists, n, seeds,
    max_new_tokens)`` -> ``Generation`` with the run's teacher (``model.teacher``) and sampling parameters;
    ``eos_id``: the policy's end-of-sequence token."""

    generate: Callable
    decode: Callable[[list[int]], str]
    group_size: int
    seed: int
    pad_id: int = 0
    encode: Callable[[str], list[int]] | None = None  # text -> token ids, no special tokens (reflection prompts)
    score: Callable[[Any], Any] | None = None
    logprobs: Callable[[Any], torch.Tensor] | None = None
    teacher_generate: Callable | None = None
    eos_id: int | None = None


def _prompt_tokens(batch: RolloutBatch, i: int) -> list[int]:
    return batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()


def branch_batch(parent: RolloutBatch, rows: list[int], cuts: list[int], n: int, ctx: ExpandContext,
                 keep_original: bool = False, guides: list[list[int]] | None = None) -> RolloutBatch | None:
    """New groups: for each (row, cut), ``n`` continuations of prompt + completion[:cut] (one group per row);
    ``keep_original`` puts the row's own suffix completion[cut:] first in its group. ``guides`` (token ids per
    row, may be empty): inserted between the prompt and the prefix for the generation only; the new rows' prompt
    is prompt + prefix without it (the continuations are then off-policy samples of that context; rows with a
    guide carry ``extra['guided']`` True)."""
    if not rows:
        return None
    prefixes = [parent.completion_ids[i, :t].tolist() for i, t in zip(rows, cuts)]
    new_prompts = [_prompt_tokens(parent, i) + p for i, p in zip(rows, prefixes)]
    guides = guides or [[] for _ in rows]
    contexts = [_prompt_tokens(parent, i) + gd + p for i, gd, p in zip(rows, guides, prefixes)]
    seeds = [(ctx.seed + 7919 * j) % (2**62) for j in range(len(rows))]
    gen = ctx.generate(contexts, n, seeds)
    texts = [ctx.decode(p) for p in prefixes]
    cols = {k: [v[i] for i in rows for _ in range(n)] for k, v in parent.columns.items()}
    gids = torch.arange(len(rows)).repeat_interleave(n)
    guided = any(guides)
    pids, pmask = (left_pad([p for p in new_prompts for _ in range(n)], ctx.pad_id) if guided
                   else (gen.prompt_ids, gen.prompt_mask))
    out = RolloutBatch(
        prompt_ids=pids, prompt_mask=pmask, completion_ids=gen.completion_ids,
        completion_mask=gen.completion_mask.float(), group_ids=gids, sampler_logprobs=gen.logprobs,
        truncated=gen.truncated, prompts=[parent.prompts[i] for i in rows for _ in range(n)],
        completions=[texts[j] + gen.texts[j * n + c] for j in range(len(rows)) for c in range(n)], columns=cols,
        extra={"branch": torch.ones(len(gids), dtype=torch.bool),
               "completion_prefix": [texts[j] for j in range(len(rows)) for _ in range(n)],
               **({} if gen.kept_logmass is None else {"sampler_kept_logmass": gen.kept_logmass}),
               **({"guided": torch.tensor([bool(gd) for gd in guides]).repeat_interleave(n)} if guided else {})})
    if not keep_original:
        return out
    # the original suffixes, one per new group, with the same (prompt + prefix) context
    lens = parent.completion_mask[rows].sum(-1).long().tolist()
    suffix = [parent.completion_ids[i, t:L].tolist() for i, t, L in zip(rows, cuts, lens)]
    width = max(max((len(s) for s in suffix), default=1), 1)
    comp = torch.full((len(rows), width), ctx.pad_id, dtype=torch.long)
    lp = torch.zeros((len(rows), width))
    mask = torch.zeros((len(rows), width))
    for j, (i, t, L) in enumerate(zip(rows, cuts, lens)):
        comp[j, :L - t] = parent.completion_ids[i, t:L]
        lp[j, :L - t] = parent.sampler_logprobs[i, t:L]
        mask[j, :L - t] = 1.0
    pids, pmask = left_pad(new_prompts, ctx.pad_id)
    orig = RolloutBatch(
        prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask,
        group_ids=torch.arange(len(rows)), sampler_logprobs=lp, truncated=parent.truncated[rows],
        prompts=[parent.prompts[i] for i in rows], completions=[parent.completions[i] for i in rows],
        columns={k: [v[i] for i in rows] for k, v in parent.columns.items()},
        extra={"branch": torch.ones(len(rows), dtype=torch.bool), "completion_prefix": texts,
               **({"guided": torch.zeros(len(rows), dtype=torch.bool)} if guided else {})})
    both = RolloutBatch.concat([orig, out], pad_id=ctx.pad_id)
    both.group_ids = torch.cat([torch.arange(len(rows)), gids])
    return both


def _first_per_group(candidate: torch.Tensor, group_ids: torch.Tensor, k: int) -> list[int]:
    """The first ``k`` candidate rows of every group (rows in batch order)."""
    inv, ng = group_index(group_ids)
    idx = torch.nonzero(candidate.bool()).flatten()
    if not len(idx):
        return []
    order = torch.sort(inv[idx], stable=True).indices  # candidates by group, batch order within a group
    g = inv[idx][order]
    counts = torch.bincount(g, minlength=ng)
    rank = torch.arange(len(g)) - (torch.cumsum(counts, 0) - counts)[g]
    return sorted(idx[order][rank < k].tolist())


@register("expansion", "cure_branching", source="CURE: Critical-Token-Guided Re-Concatenation for Entropy-Collapse "
          "Prevention")
class CureBranching(Expansion):
    """Re-generate from the highest-entropy token of completions and train on the original and the branched groups.

    "CURE" (stage 1): for the first ``branches`` (default 1) completions of every group, the critical token is the
    one with the highest policy entropy (``token_entropy``, from the trainer's no-grad forward; the last token is
    excluded so something is regenerated); prompt + completion[:t*] becomes a new prompt and ``group_size``
    continuations (default: the run's G) form a new group, trained jointly with the original groups.
    Assumed: one critical token per branched completion (the argmax), branching the first completions of a group.
    CURE's second stage (plain DAPO training) is a second run without this option.
    """

    reads = ("token_entropy",)

    def __init__(self, *, branches: Annotated[int, Ge(1)] = 1, group_size: Annotated[int, Ge(1)] | None = None):
        self.branches, self.group_size = branches, group_size

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch | None:
        ok = batch.valid if batch.valid is not None else torch.ones(len(batch), dtype=torch.bool)
        if "branch" in batch.extra:
            ok = ok & ~batch.extra["branch"].bool()
        rows = _first_per_group(ok, batch.group_ids, self.branches)
        H = batch.extra["token_entropy"]
        lens = batch.completion_mask.sum(-1).long()
        T = H.shape[-1]
        pos = torch.arange(T)
        allowed = pos.unsqueeze(0) < (lens - 1).clamp(min=1).unsqueeze(-1)  # not the last token (unless L = 1)
        cut = torch.where(allowed, H.float(), torch.full_like(H.float(), -torch.inf)).argmax(-1)
        return branch_batch(batch, rows, [int(cut[i]) for i in rows], self.group_size or ctx.group_size, ctx)


REFLECT_TEMPLATE = (
    "\n\nThe attempt above is wrong. Its steps:\n{steps}\nFind the first step that went wrong and reply with JSON "
    'only: {{"retry_from_step": <step number, 0 to {last}>, "improvement_suggestion": "<what to do instead>"}}\n')
GUIDANCE_TEMPLATE = "\n(Hint from a previous attempt: {suggestion})\n"
_STEP_KEY = re.compile(r'"?retry_from_step"?\s*[:=]\s*(-?\d+)')
_SUGGESTION_KEY = re.compile(r'"?improvement_suggestion"?\s*[:=]\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)


def parse_reflection(text: str, n_steps: int) -> tuple[int | None, str]:
    """(retry_from_step or None, improvement_suggestion) of a reflection: the first JSON object in ``text`` with
    those keys, else the keys found by pattern; the step must lie in [0, n_steps)."""
    step, hint = None, ""
    a, b = text.find("{"), text.rfind("}")
    obj = None
    if 0 <= a < b:
        try:
            obj = json.loads(text[a:b + 1])
        except (json.JSONDecodeError, ValueError):
            obj = None
    if isinstance(obj, dict):
        st = obj.get("retry_from_step")
        step = st if isinstance(st, int) and not isinstance(st, bool) else None
        hint = str(obj.get("improvement_suggestion") or "")
    else:
        m = _STEP_KEY.search(text)
        step = int(m.group(1)) if m else None
        m = _SUGGESTION_KEY.search(text)
        hint = m.group(1) if m else ""
    if step is None or not 0 <= step < n_steps:
        return None, hint
    return step, hint.strip()


@register("expansion", "retry_from_failure", source="R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided "
          "Exploration, Pivotal Credit, and Positive Amplification")
class RetryFromFailure(Expansion):
    """Restart sampling from the step where a failed completion went wrong; train only on the diverging suffix.

    After "R^3L: Reflect-then-Retry RL" (restart from identified failure points; Pivotal Credit Assignment trains
    only the suffix after the shared prefix). For up to ``max_per_group`` (1) failed completions per group (raw
    ``reward`` < ``threshold``, default 'correct' < 1.0), a pivot step is found; a new group = the failed suffix +
    ``retries`` (default G - 1) fresh continuations of prompt + prefix (the steps before the pivot); the prefix is
    part of the prompt, so only the diverging suffixes get gradient. Steps split after tokens containing
    ``delimiter`` (default newline); ``delimiter: ''`` makes every token a step boundary.

    Pivot without reflection (``reflect: false``, default): the step holding the completion's most surprising
    token (max -log pi_old); ``delimiter: ''``: that token itself. Assumed: surprisal as the failure locator.

    Reflect-then-retry (``reflect: true``, R^3L's language-guided exploration): the policy itself diagnoses the
    attempt. Its context is prompt + failed completion + ``reflect_template`` (``{steps}``: the completion's
    steps numbered from 0, ``{last}``: the last step number), generated once with the run's sampling parameters;
    the reply's JSON ``retry_from_step`` k (0 = from scratch) is the pivot (retry from step k, keep steps < k) and
    its ``improvement_suggestion`` is the guidance: the retries are generated from prompt +
    ``guidance_template`` (``{suggestion}``) + prefix, and trained as continuations of prompt + prefix without
    the guidance (so they are off-policy samples, as in R^3L, whose released workflow trains the retried
    trajectory without its guidance; ``extra['guided']`` marks them; ``loss.tis`` corrects the mismatch). A reply
    without a valid step in [0, S) falls back to the surprisal pivot and no guidance. ``extra['retry_step']``
    holds the pivot step of the new rows, ``extra['reflected']`` whether it came from a reflection.
    The templates are appended as raw text (no chat turn). R^3L's Positive Amplification is the advantage
    ``r3l``.
    """

    def __init__(self, *, reward: str = "correct", threshold: float = 1.0, retries: Annotated[int, Ge(1)] | None = None,
                 max_per_group: Annotated[int, Ge(1)] = 1, delimiter: str = "\n", reflect: bool = False,
                 reflect_template: str = REFLECT_TEMPLATE, guidance_template: str = GUIDANCE_TEMPLATE):
        self.reward, self.threshold, self.retries = reward, threshold, retries
        self.max_per_group, self.delimiter = max_per_group, delimiter
        self.reflect, self.reflect_template, self.guidance_template = reflect, reflect_template, guidance_template

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch | None:
        x = raw_column(batch.rewards, batch.reward_names, self.reward, "filters.retry_from_failure",
                       getattr(batch, "raw_rewards", None), batch.extra.get("raw_reward_names"))
        failed = torch.isfinite(x) & (x < self.threshold)
        if batch.valid is not None:
            failed = failed & batch.valid
        if "branch" in batch.extra:
            failed = failed & ~batch.extra["branch"].bool()
        rows = _first_per_group(failed, batch.group_ids, self.max_per_group)
        if not rows:
            return None
        mask = batch.completion_mask[rows] > 0
        surprisal = torch.where(mask, -batch.sampler_logprobs[rows].float(), torch.full_like(mask, -torch.inf,
                                                                                             dtype=torch.float32))
        t_max = surprisal.argmax(-1)
        ids = batch.completion_ids[rows]
        vocab = {int(t): self.delimiter in ctx.decode([int(t)]) for t in torch.unique(ids).tolist()} \
            if self.delimiter else {}
        is_delim = torch.tensor([[vocab.get(int(t), False) for t in row] for row in ids.tolist()],
                                dtype=torch.bool).reshape(ids.shape) & mask
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        before = is_delim & (pos < t_max.unsqueeze(-1))
        last_delim = torch.where(before, pos, torch.full_like(pos, -1)).amax(-1)
        cuts = torch.where(last_delim >= 0, last_delim + 1, t_max if not self.delimiter else torch.zeros_like(t_max))
        cuts = cuts.tolist()
        guides, steps, reflected = None, [None] * len(rows), [False] * len(rows)
        if self.reflect:
            guides, steps, reflected, cuts = self._reflect(batch, rows, ids, mask, is_delim, cuts, ctx)
        retries = self.retries or max(ctx.group_size - 1, 1)
        out = branch_batch(batch, rows, cuts, retries, ctx, keep_original=True, guides=guides)
        if out is not None and self.reflect:  # rows: each failed suffix, then each row's retries
            order = list(range(len(rows))) + [j for j in range(len(rows)) for _ in range(retries)]
            out.extra["retry_step"] = torch.tensor([-1 if s is None else s for s in steps], dtype=torch.long)[order]
            out.extra["reflected"] = torch.tensor(reflected, dtype=torch.bool)[order]
        return out

    def _reflect(self, batch: RolloutBatch, rows: list[int], ids: torch.Tensor, mask: torch.Tensor,
                 is_delim: torch.Tensor, cuts: list[int], ctx: ExpandContext):
        """(guides, pivot steps, reflected flags, cuts) from the policy's reflection on each failed row."""
        if ctx.encode is None:
            raise ConfigError("filters.retry_from_failure.reflect: this run's expansion context cannot encode text")
        lens = mask.sum(-1).tolist()
        starts_all, prompts = [], []
        for j, i in enumerate(rows):
            L = int(lens[j])
            starts = [0] + [t + 1 for t in range(L - 1) if bool(is_delim[j, t])] if self.delimiter \
                else list(range(L))
            starts_all.append(starts)
            bounds = starts + [L]
            listing = "".join(f"Step {k}: {ctx.decode(ids[j, bounds[k]:bounds[k + 1]].tolist()).strip()}\n"
                              for k in range(len(starts)))
            text = self.reflect_template.format(steps=listing, last=len(starts) - 1)
            prompts.append(_prompt_tokens(batch, i) + ids[j, :L].tolist() + list(ctx.encode(text)))
        gen = ctx.generate(prompts, 1, [(ctx.seed + 104729 * (j + 1)) % (2**62) for j in range(len(rows))])
        guides, steps, reflected, new_cuts = [], [], [], []
        for j, reply in enumerate(gen.texts):
            k, hint = parse_reflection(reply, len(starts_all[j]))
            if k is None:  # no usable diagnosis: the surprisal pivot, no guidance
                guides.append([])
                steps.append(None)
                reflected.append(False)
                new_cuts.append(cuts[j])
                continue
            guides.append(list(ctx.encode(self.guidance_template.format(suggestion=hint))) if hint else [])
            steps.append(k)
            reflected.append(True)
            new_cuts.append(starts_all[j][k])
        return guides, steps, reflected, new_cuts


# ------------------------------------------------------------------------------------------------ rehearsal
_DPH = ("The Choice of Divergence: A Neglected Key to Mitigating Diversity Collapse in Reinforcement Learning with "
        "Verifiable Reward (DPH-RL)")


def _rehearsal_check(params: dict, run: Any, where: str) -> dict:
    """The rehearsal file's temperature must be the run's (its log-probs are compared with the policy's at
    ``rollout.temperature``)."""
    if run is not None and params.get("temperature") is None:
        params = {**params, "temperature": float(run.rollout.temperature or 1.0)}
    return params


def read_rehearsal(path: str, temperature: float | None = None) -> list[dict]:
    """The rows of a rehearsal file (``postrl presample`` writes it): JSON lines with ``prompt_ids`` and
    ``completion_ids`` (token ids, non-empty) and ``logprobs`` (the initial policy's log-prob of each completion
    token, as many), optionally ``prompt``, ``completion`` (texts) and ``temperature``. A bad row is a
    :class:`~postrl.errors.DataError` naming the file and row."""
    rows = read_jsonl(path, strict=True)
    if not rows:
        raise DataError(f"{path}: no rehearsal rows (write them with postrl presample)")
    for i, r in enumerate(rows, 1):
        for key in ("prompt_ids", "completion_ids", "logprobs"):
            v = r.get(key)
            if not isinstance(v, list) or not v or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                           for x in v):
                raise DataError(f"{path}: row {i}: field '{key}' must be a non-empty list of numbers")
        if len(r["logprobs"]) != len(r["completion_ids"]):
            raise DataError(f"{path}: row {i}: {len(r['logprobs'])} logprobs for {len(r['completion_ids'])} "
                            f"completion tokens")
        if temperature is not None and r.get("temperature") is not None and \
                abs(float(r["temperature"]) - temperature) > 1e-9:
            raise DataError(f"{path}: row {i}: log-probs at temperature {r['temperature']}, the run samples at "
                            f"{temperature} (rollout.temperature); presample at the run's temperature")
    return rows


@register("expansion", "rehearsal", source=_DPH, check=_rehearsal_check)
class Rehearsal(Expansion):
    """Append completions pre-sampled once from the initial policy (DPH-RL's rehearsal set), unscored.

    DPH-RL computes its mass-covering f-divergence with generator functions on samples of the initial policy,
    "requiring only sampling from the initial policy and no online reference model". This stage reads such
    samples, written once by ``postrl presample`` (``path``: JSON lines with ``prompt_ids``, ``completion_ids``
    and the initial policy's per-token ``logprobs`` at the run's ``rollout.temperature``; DPH-RL rehearses the
    prompts the initial model already solves: ``postrl presample --only-correct``), and appends ``per_step``
    (default 8) of them to every training batch, drawn without replacement per step (seeded by the step; with
    wrap-around when the file has fewer rows). Appended rows: ``valid`` False (no advantage, no policy loss, no
    metric), rewards NaN, and the fields the ``f_divergence_rehearsal`` regulariser reads:
    ``rehearsal`` [N] bool, ``rehearsal_logp`` [N, T] (log pi_0 of each token), ``rehearsal_mask`` [N, T] (1 on
    the rehearsal completion tokens) and ``rehearsal_weight`` [N] (1 / the number of rehearsal tokens of the
    batch, so the term is a token mean over them); 0 on the rollouts. ``temperature``: the run's (set from the
    config); a file row whose ``temperature`` differs is an error.
    """

    scored = False

    def __init__(self, *, path: str, per_step: Annotated[int, Ge(1)] = 8, temperature: float | None = None):
        self.path, self.per_step, self.temperature = path, int(per_step), temperature
        self.rows = read_rehearsal(path, temperature)

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch:
        gen = torch.Generator().manual_seed(int(ctx.seed) % (2**63))
        n_rows = len(self.rows)
        reps = -(-self.per_step // n_rows)
        pick = torch.cat([torch.randperm(n_rows, generator=gen) for _ in range(reps)])[:self.per_step].tolist()
        rows = [self.rows[i] for i in pick]
        n = len(rows)
        pids, pmask = left_pad([[int(t) for t in r["prompt_ids"]] for r in rows], ctx.pad_id)
        T = max(len(r["completion_ids"]) for r in rows)
        comp = torch.full((n, T), ctx.pad_id, dtype=torch.long)
        mask, lp = torch.zeros((n, T)), torch.zeros((n, T))
        for j, r in enumerate(rows):
            L = len(r["completion_ids"])
            comp[j, :L] = torch.tensor([int(t) for t in r["completion_ids"]], dtype=torch.long)
            mask[j, :L] = 1.0
            lp[j, :L] = torch.tensor([float(x) for x in r["logprobs"]])
        K = len(batch.reward_names)
        nan_k = torch.full((n, K), float("nan"))
        raw = batch.raw_rewards
        return RolloutBatch(
            prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask,
            group_ids=torch.arange(n), sampler_logprobs=lp, truncated=torch.zeros(n, dtype=torch.bool),
            prompts=[str(r.get("prompt", "")) for r in rows],
            completions=[str(r["completion"]) if "completion" in r else ctx.decode(r["completion_ids"]) for r in rows],
            columns={k: [None] * n for k in batch.columns}, reward_names=list(batch.reward_names),
            rewards=nan_k, reward_weights=batch.reward_weights,
            raw_rewards=None if raw is None else torch.full((n, raw.shape[1]), float("nan")),
            reward=torch.zeros(n), valid=torch.zeros(n, dtype=torch.bool),
            step_ends=None if batch.step_ends is None else torch.full((n, 1), -1, dtype=torch.long),
            step_rewards=None if batch.step_rewards is None else torch.full((n, 1), float("nan")),
            extra={"rehearsal": torch.ones(n, dtype=torch.bool), "rehearsal_logp": lp, "rehearsal_mask": mask.clone(),
                   "rehearsal_weight": torch.full((n,), 1.0 / float(mask.sum()))})
