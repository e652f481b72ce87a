"""AVATAR's off-policy replay (kind ``expansion``): past groups with reward variance fill the slots of groups without.

A stateful expansion in ``replace`` mode: after the keep filters (and the DDP row padding) it returns the batch
with each zero-signal group swapped for a stored group of the same size, so the batch keeps its shape; it records
the step's candidate groups and the stored groups it used (``observe``, on the step's final batch), and the buffer
changes once per step (``end_step``, with every process's records in rank order: every process holds the same
buffer).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from annotated_types import Ge

from postrl.batch import RolloutBatch
from postrl.errors import ConfigError
from postrl.generation import left_pad
from postrl.groups import group_index
from postrl.registry import register
from postrl.selection.expansions import ExpandContext, Expansion
from postrl.stages import StepEnd, Stateful

AVATAR = "AVATAR: Reinforcement Learning to See, Hear, and Reason Over Video"


def _needs_tis(params: dict, run: Any, where: str) -> dict:
    """``avatar_replay``: the replayed rows were sampled by an earlier policy; ``loss.tis`` corrects for it."""
    if run is not None and run.loss.tis.level == "none":
        raise ConfigError(f"{where}: replayed groups were sampled by an earlier policy; set loss.tis.level=token "
                          f"(or sequence) so that the importance weight exp(log pi_old - log mu) corrects them")
    return params


def group_spread(reward: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(group number of each row [N], rows per group [ng], all rows ok [ng], range max - min [ng], population std
    [ng]) of ``reward`` over each group's rows (NaN where a group has a row that is not ``ok``)."""
    inv, ng = group_index(group_ids)
    x = reward.double()
    n = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, torch.ones_like(inv))
    bad = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, (~ok).long())
    xs = torch.where(ok, x, torch.zeros_like(x))
    s = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, xs)
    mean = s / n.clamp(min=1)
    var = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, torch.where(ok, (x - mean[inv]) ** 2,
                                                                               torch.zeros_like(x))) / n.clamp(min=1)
    hi = torch.full((ng,), -math.inf, dtype=torch.float64).scatter_reduce(0, inv, torch.where(ok, x, -math.inf),
                                                                         "amax")
    lo = torch.full((ng,), math.inf, dtype=torch.float64).scatter_reduce(0, inv, torch.where(ok, x, math.inf),
                                                                        "amin")
    whole = bad == 0
    nan = torch.full((ng,), math.nan, dtype=torch.float64)
    return inv, n, whole, torch.where(whole, hi - lo, nan), torch.where(whole, var.sqrt(), nan)


@register("expansion", "avatar_replay", source=AVATAR, needs=("groups",), check=_needs_tis)
class AvatarReplay(Expansion, Stateful):
    """Replay stored high-variance groups into the slots of zero-advantage groups, off-policy (importance-corrected).

    After AVATAR's off-policy architecture, which "resolves vanishing advantages by reusing past experiences with
    greater reward diversity". A slot is a group of the step's batch (after the keep filters) whose rows are all
    valid with finite scalar ``reward`` and max - min <= ``tol`` (1e-6): its group-relative advantages are all 0.
    Each slot is replaced by a stored group of the same size, drawn without replacement with probability
    proportional to its reward std (seeded per step and process: under DDP each process draws on its own, so one
    stored group may fill a slot on two processes in the same step); slots beyond what the buffer holds stay.
    The buffer: every group of a batch that trained (rollouts only: not replayed, branched or rehearsal rows),
    whole and valid, whose population std of ``reward`` exceeds ``min_std`` (0: any variance), with its tokens,
    the sampler's per-token log-probs (of the policy that generated it), its rewards and columns; it keeps the
    ``capacity`` (64) groups of largest std (ties: the newer), drops those older than ``max_age`` steps (None:
    never) and a group once replayed (each is replayed once).

    Replayed rows: ``valid`` True, their stored ``reward`` / ``rewards`` (the advantage stage computes their
    group-relative advantages now), ``sampler_logprobs`` = the old policy's log-probs, ``extra['replayed']`` True,
    ``extra['replay_age']`` (steps since stored). Importance correction: the step's trainer log-probs ``old_logp``
    are the current policy's, so ``loss.tis`` (required; token or sequence level) multiplies their policy loss by
    the truncated ratio exp(log pi_old - log mu) of the current policy to the one that sampled them (on the fresh
    rows it is ~1). The step's batch metrics leave replayed rows out (as rehearsal rows);
    ``expansion/avatar_replay/slots`` counts the step's zero-signal groups, ``replayed`` those filled, ``buffer``
    the stored groups. Assumed (the abstract gives no rule): the slot test, the std priority (the released code
    scores a batch by its mean advantage minus 0.1 x its KL in easy/medium/hard tiers and recomputes replayed
    advantages with a moving-average baseline; here the run's advantage estimator on the stored rewards),
    replay-once, and TIS as the importance correction.
    """

    scored = False
    mode = "replace"
    _state = ("buffer", "next_id")

    def __init__(self, *, capacity: Annotated[int, Ge(1)] = 64, min_std: Annotated[float, Ge(0)] = 0.0,
                 tol: Annotated[float, Ge(0)] = 1e-6, max_age: Annotated[int, Ge(1)] | None = None):
        self.capacity, self.min_std, self.tol, self.max_age = capacity, min_std, tol, max_age
        self.buffer: list[dict] = []
        self.next_id = 0

    # ------------------------------------------------------------------------------------------------ replay
    @staticmethod
    def _fresh(batch: RolloutBatch) -> torch.Tensor:
        """Rows that are this step's own rollouts (not replayed, branched or rehearsal rows)."""
        fresh = torch.ones(len(batch), dtype=torch.bool)
        for k in ("replayed", "branch", "rehearsal"):
            v = batch.extra.get(k)
            if isinstance(v, torch.Tensor) and v.shape[:1] == (len(batch),):
                fresh &= ~v.bool()
        return fresh

    def slots(self, batch: RolloutBatch) -> list[list[int]]:
        """The rows of each zero-signal group, in group order."""
        valid = batch.valid if batch.valid is not None else torch.ones(len(batch), dtype=torch.bool)
        ok = valid.bool() & torch.isfinite(batch.reward) & self._fresh(batch)
        inv, n, whole, rng, _ = group_spread(batch.reward, batch.group_ids, ok)
        out = []
        for g in torch.nonzero(whole & (rng <= self.tol)).flatten().tolist():
            out.append(torch.nonzero(inv == g).flatten().tolist())
        return out

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch:
        """The batch with slots replaced by stored groups of their size (the batch itself when nothing fits)."""
        slots = self.slots(batch)
        if not slots or not self.buffer:
            return batch
        gen = torch.Generator().manual_seed(int(ctx.seed) % (2**63))
        free = list(range(len(self.buffer)))
        picks: list[tuple[list[int], dict]] = []
        for rows in slots:
            fit = [j for j in free if len(self.buffer[j]["rows"]) == len(rows)]
            if not fit:
                continue
            w = torch.tensor([self.buffer[j]["std"] for j in fit], dtype=torch.float64)
            j = fit[int(torch.multinomial(w / w.sum(), 1, generator=gen))]
            free.remove(j)
            picks.append((rows, self.buffer[j]))
        if not picks:
            return batch
        gone = {i for rows, _ in picks for i in rows}
        kept = batch.select([i for i in range(len(batch)) if i not in gone])
        n = len(kept)
        kept.extra.update(replayed=torch.zeros(n, dtype=torch.bool), replay_id=torch.full((n,), -1, dtype=torch.long),
                          replay_age=torch.zeros(n, dtype=torch.long))
        step = int(batch.extra.get("step", 0))
        more = self._rows(batch, [e for _, e in picks], step, ctx.pad_id)
        out = RolloutBatch.concat([kept, more], ctx.pad_id)
        return out

    def _rows(self, batch: RolloutBatch, entries: list[dict], step: int, pad_id: int) -> RolloutBatch:
        rows = [(e, r) for e in entries for r in e["rows"]]
        n, K = len(rows), len(batch.reward_names)
        pids, pmask = left_pad([r["prompt_ids"] for _, r in rows], pad_id)
        T = max(max(len(r["completion_ids"]) for _, r in rows), 1)
        comp = torch.full((n, T), pad_id, dtype=torch.long)
        mask, lp = torch.zeros((n, T)), torch.zeros((n, T))
        for i, (_, r) in enumerate(rows):
            L = len(r["completion_ids"])
            comp[i, :L] = torch.tensor(r["completion_ids"], dtype=torch.long)
            mask[i, :L] = torch.tensor(r["mask"], dtype=torch.float32)
            lp[i, :L] = torch.tensor(r["logprobs"], dtype=torch.float32)

        def vec(key: str, width: int) -> torch.Tensor:
            return torch.tensor([r[key] if r.get(key) is not None and len(r[key]) == width else [math.nan] * width
                                 for _, r in rows], dtype=torch.float32).reshape(n, width)

        raw = batch.raw_rewards
        extra: dict[str, Any] = {}
        for k, v in batch.extra.items():  # the batch's per-row fields, neutral on the replayed rows
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == len(batch):
                extra[k] = torch.zeros((n, *v.shape[1:]), dtype=v.dtype)
            elif isinstance(v, list) and len(v) == len(batch):
                extra[k] = ["" if any(isinstance(x, str) for x in v) else None] * n
        extra.update(replayed=torch.ones(n, dtype=torch.bool),
                     replay_id=torch.tensor([e["id"] for e, _ in rows], dtype=torch.long),
                     replay_age=torch.tensor([step - e["step"] for e, _ in rows], dtype=torch.long))
        gids = torch.tensor([k for k, e in enumerate(entries) for _ in e["rows"]], dtype=torch.long)
        return RolloutBatch(
            prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask, group_ids=gids,
            sampler_logprobs=lp, truncated=torch.tensor([bool(r["truncated"]) for _, r in rows]),
            prompts=[r["prompt"] for _, r in rows], completions=[r["completion"] for _, r in rows],
            columns={k: [r["columns"].get(k) for _, r in rows] for k in batch.columns},
            reward_names=list(batch.reward_names), rewards=vec("rewards", K), reward_weights=batch.reward_weights,
            raw_rewards=None if raw is None else vec("raw_rewards", raw.shape[1]),
            reward=torch.tensor([r["reward"] for _, r in rows], dtype=torch.float32),
            valid=torch.ones(n, dtype=torch.bool),
            step_ends=None if batch.step_ends is None else torch.full((n, 1), -1, dtype=torch.long),
            step_rewards=None if batch.step_rewards is None else torch.full((n, 1), math.nan), extra=extra)

    # ------------------------------------------------------------------------------------------------ state
    def observe(self, reward, group_ids, prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs,
                truncated, prompts, completions, columns, rewards, valid=None, raw_rewards=None, replay_id=None,
                replayed=None, branch=None, rehearsal=None, step=0) -> None:
        """Record the step's candidate groups (for the buffer), the stored groups it replayed and its slot count."""
        N = len(reward)
        fresh = torch.ones(N, dtype=torch.bool)
        for v in (replayed, branch, rehearsal):
            if isinstance(v, torch.Tensor):
                fresh &= ~v.bool()
        ok = (torch.ones(N, dtype=torch.bool) if valid is None else valid.bool()) & torch.isfinite(reward) & fresh
        inv, n, whole, rng, std = group_spread(reward, group_ids, ok)
        used = sorted({int(x) for x in replay_id[replayed.bool()].tolist()}) if isinstance(replayed, torch.Tensor) \
            and replay_id is not None else []
        slots = int((whole & (rng <= self.tol)).sum())
        groups = []
        for g in torch.nonzero(whole & (std > self.min_std)).flatten().tolist():
            rows = []
            for i in torch.nonzero(inv == g).flatten().tolist():
                m = completion_mask[i]
                L = int(torch.nonzero(m > 0).max()) + 1 if bool((m > 0).any()) else 0
                rows.append({"prompt_ids": prompt_ids[i][prompt_mask[i].bool()].tolist(),
                             "completion_ids": completion_ids[i, :L].tolist(), "mask": m[:L].tolist(),
                             "logprobs": sampler_logprobs[i, :L].tolist(), "truncated": bool(truncated[i]),
                             "reward": float(reward[i]), "rewards": rewards[i].tolist(),
                             "raw_rewards": None if raw_rewards is None else raw_rewards[i].tolist(),
                             "prompt": prompts[i], "completion": completions[i],
                             "columns": {k: v[i] for k, v in (columns or {}).items()}})
            groups.append({"std": float(std[g]), "rows": rows})
        self.record({"step": int(step), "groups": groups, "used": used, "slots": slots,
                     "replayed": len(set(used))})

    def end_step(self, step: StepEnd) -> dict:
        used: set[int] = set()
        slots = replayed = added = 0
        for rec in self.observed:
            used.update(rec["used"])
            slots += rec["slots"] + rec["replayed"]  # the filled slots are replayed groups in the final batch
            replayed += rec["replayed"]
            for g in rec["groups"]:
                self.buffer.append({"id": self.next_id, "step": rec["step"], **g})
                self.next_id += 1
                added += 1
        now = max((rec["step"] for rec in self.observed), default=0)
        keep = [e for e in self.buffer if e["id"] not in used
                and (self.max_age is None or now - e["step"] < self.max_age)]
        keep.sort(key=lambda e: (-e["std"], -e["id"]))  # largest std first; ties: the newer
        self.buffer = keep[:self.capacity]
        return {"slots": float(slots), "replayed": float(replayed), "added": float(added),
                "buffer": float(len(self.buffer))}
