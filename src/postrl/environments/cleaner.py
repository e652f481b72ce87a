"""CLEANER: self-purified trajectories (a failed tool call that a later turn corrected is replaced by the correction).

"CLEANER: Self-Purified Trajectories Boost Agentic Reinforcement Learning". After the multi-turn rollout
(``environment.purify: cleaner``), each episode is rewritten: a run of turns whose tool calls failed (a call that
raised, timed out, was malformed or refused) followed by a turn whose calls all ran (the self-correction) becomes
one turn, the correction, placed where the first failure was, with the error observations removed. Similarity-aware
adaptive rollback (SAAR): when the reasoning before the call of the first failed turn and of the correction are
similar (``difflib`` ratio of their texts >= ``similarity``, default 0.8) the failure was an execution slip and only
the call is replaced (the failed turn's reasoning tokens, then the correction's tokens from its ``<tool_call>``
on: a shallow repair); otherwise the whole turn is (the correction's tokens: a deep substitution). Failures never
corrected stay as they are. The episode's rewards, counters and turn records follow its kept turns.

Token-in/token-out for what trains: every token in the loss mask of a purified episode is a token the policy
sampled, but in a context it was not sampled in (the failure and its error message are gone). So postrl does not
assume its sampling log-probs: the rewritten episode is re-scored by the policy (``ctx.logprobs``, the rollout's
temperature and sampling filter, the same forward that gives any trainer log-prob) and those log-probs become its
``sampler_logprobs``; the trainer recomputes the old/reference log-probs of exactly these ids as for any episode,
so the importance ratio of the update is that of the purified sequence under the policy that produced the batch.
Purified episodes are therefore proposals scored by the policy rather than samples of it (as in CLEANER, a
deliberate bias toward clean paths); ``extra['purified']`` marks them (``turns/purified``). Environment tokens
(the observations that stay) are the ids the rollout appended, unchanged. After CLEANER (assumed where the
abstract is silent: the character-level similarity in place of a semantic one, the 0.8 threshold, a failed turn =
one with a call that did not run, the correction = the next turn whose calls all ran).
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

from postrl.batch import RolloutBatch
from postrl.environments.turns import TURN_COUNTERS, turn_index
from postrl.environments.tools import OPEN


def _spans(turn_ends: torch.Tensor, mask: torch.Tensor, length: int) -> list[tuple[int, int, int]] | None:
    """Per model turn (start, end + 1, end of the observation after it) in completion positions; None when a turn
    has no token (nothing to rewrite)."""
    ends = [int(e) for e in turn_ends.tolist() if e >= 0]
    out, prev = [], -1
    m = mask.tolist()
    for k, e in enumerate(ends):
        b = next((t for t in range(prev + 1, e + 1) if m[t] > 0), None)
        nxt = ends[k + 1] if k + 1 < len(ends) else None
        obs_end = length if nxt is None else next((t for t in range(e + 1, nxt + 1) if m[t] > 0), None)
        if b is None or obs_end is None:
            return None
        out.append((b, e + 1, obs_end))
        prev = e
    return out


def _call_start(tok: Any, ids: list[int]) -> int:
    """Index of the token where the turn's first ``<tool_call>`` begins (the split of reasoning and call):
    the largest t with len(decode(ids[:t])) <= the tag's character position (len(ids) when there is none)."""
    text = tok.decode(ids, skip_special_tokens=True)
    c = text.find(OPEN)
    if c < 0:
        return len(ids)
    t = 0
    while t < len(ids) and len(tok.decode(ids[:t + 1], skip_special_tokens=True)) <= c:
        t += 1
    return t


def _classify(calls: int, errors: int, malformed: int) -> str:
    made, ok = calls + malformed, max(calls - errors, 0)
    if made == 0:
        return "none"
    return "ok" if ok == made else "failed"


def purify_rows(tok: Any, batch: RolloutBatch, similarity: float) -> dict[int, dict]:
    """{row: its rewrite} for the rows with a corrected failure: ``ids``, ``mask`` (lists over the completion),
    ``turns`` (the original turn index each new turn comes from), ``ends`` (new turn ends), ``actions`` (each new
    turn's model ids), ``removed`` (failed turns dropped), ``shallow`` (repairs that kept the failed turn's
    reasoning)."""
    ex = batch.extra
    out = {}
    for r in range(len(batch)):
        n = int((ex["turn_ends"][r] >= 0).sum())
        if n < 2:
            continue
        L = int(ex["episode_length"][r])
        ids = batch.completion_ids[r, :L].tolist()
        mask = batch.completion_mask[r, :L].tolist()
        spans = _spans(ex["turn_ends"][r], batch.completion_mask[r, :L], L)
        if spans is None:
            continue
        kinds = [_classify(int(ex["turn_tool_calls"][r, k]), int(ex["turn_tool_errors"][r, k]),
                           int(ex["turn_malformed_calls"][r, k])) for k in range(n)]
        pieces: list[tuple[list[int], list[float], int]] = []  # (ids, mask, source turn)
        pending: list[int] = []
        removed = shallow = 0

        for k in range(n):
            if kinds[k] == "failed":
                pending.append(k)
                continue
            if kinds[k] == "ok" and pending:
                f = pending[0]
                fb, fe, _ = spans[f]
                cb, ce, co = spans[k]
                f_ids, c_ids = ids[fb:fe], ids[cb:ce]
                fs, cs = _call_start(tok, f_ids), _call_start(tok, c_ids)
                f_reason = tok.decode(f_ids[:fs], skip_special_tokens=True)
                c_reason = tok.decode(c_ids[:cs], skip_special_tokens=True)
                ratio = difflib.SequenceMatcher(None, f_reason, c_reason).ratio() if (f_reason or c_reason) else 1.0
                if ratio >= similarity:
                    new = f_ids[:fs] + c_ids[cs:]
                    shallow += 1
                else:
                    new = c_ids
                pieces.append((new + ids[ce:co], [1.0] * len(new) + mask[ce:co], k))
                removed += len(pending)
                pending = []
                continue
            for p in pending:  # failures never corrected stay
                pieces.append((ids[spans[p][0]:spans[p][2]], mask[spans[p][0]:spans[p][2]], p))
            pending = []
            pieces.append((ids[spans[k][0]:spans[k][2]], mask[spans[k][0]:spans[k][2]], k))
        if not removed:
            continue
        for p in pending:
            pieces.append((ids[spans[p][0]:spans[p][2]], mask[spans[p][0]:spans[p][2]], p))
        new_ids, new_mask, ends, src, actions = [], [], [], [], []
        for p_ids, p_mask, k in pieces:
            start = len(new_ids)
            new_ids += p_ids
            new_mask += p_mask
            model = [i for i, m in enumerate(p_mask) if m > 0]
            ends.append(start + model[-1])
            actions.append([p_ids[i] for i in model])
            src.append(k)
        out[r] = {"ids": new_ids, "mask": new_mask, "ends": ends, "turns": src, "actions": actions,
                  "removed": removed, "shallow": shallow}
    return out


def purify(ctx: Any, batch: RolloutBatch, *, similarity: float = 0.8) -> RolloutBatch:
    """The batch with every episode that had a corrected failure rewritten (module docstring), its model tokens
    re-scored by the policy (``ctx.logprobs``) as ``sampler_logprobs``; ``extra['purified']`` bool [N],
    ``extra['purified_turns']`` [N] (failed turns removed)."""
    tok = ctx.tokenizer
    rewrites = purify_rows(tok, batch, similarity)
    N = len(batch)
    ex = batch.extra
    ex["purified"] = torch.zeros(N, dtype=torch.bool)
    ex["purified_turns"] = torch.zeros(N, dtype=torch.long)
    if not rewrites:
        return batch
    if ctx.model is None:
        raise RuntimeError("environment.purify=cleaner needs the policy (ctx.model) to re-score purified episodes")
    lengths = [len(rewrites[r]["ids"]) if r in rewrites else int(ex["episode_length"][r]) for r in range(N)]
    W = max(max(lengths), 1)
    pad = int(ctx.pad_id)
    ids = torch.full((N, W), pad, dtype=torch.long)
    mask, lp = torch.zeros((N, W)), torch.zeros((N, W))
    keys2d = ["turn_ends", "turn_rewards", "turn_truncated", *[f"turn_{c}" for c in TURN_COUNTERS]]
    for r in range(N):
        L = lengths[r]
        if r not in rewrites:
            w = min(L, batch.completion_ids.shape[1])
            ids[r, :w], mask[r, :w] = batch.completion_ids[r, :w], batch.completion_mask[r, :w]
            lp[r, :w] = batch.sampler_logprobs[r, :w]
            continue
        rw = rewrites[r]
        ids[r, :L] = torch.tensor(rw["ids"], dtype=torch.long)
        mask[r, :L] = torch.tensor(rw["mask"])
        src = torch.tensor(rw["turns"], dtype=torch.long)
        n = len(rw["turns"])
        for key in keys2d:
            old = ex[key][r].clone()
            fill = -1 if key == "turn_ends" else (float("nan") if key == "turn_rewards" else 0)
            ex[key][r] = torch.full_like(old, fill)
            ex[key][r, :n] = old[src] if key != "turn_ends" else torch.tensor(rw["ends"], dtype=old.dtype)
        for c in TURN_COUNTERS:
            ex[c][r] = ex[f"turn_{c}"][r].sum()
        ex["turn_actions"][r] = [tok.decode(a, skip_special_tokens=True) for a in rw["actions"]]
        ex["turn_observations"][r] = [ex["turn_observations"][r][k] for k in rw["turns"]]
        turns = batch.columns["env_turn_rewards"][r]
        batch.columns["env_turn_rewards"][r] = [turns[k] for k in rw["turns"] if k < len(turns)]
        ex["episode_length"][r] = L
        ex["purified"][r] = True
        ex["purified_turns"][r] = rw["removed"]
    ex["num_turns"] = (ex["turn_ends"] >= 0).sum(-1)
    rows = sorted(rewrites)
    batch.completion_ids, batch.completion_mask, batch.sampler_logprobs = ids, mask, lp
    sub = batch.select(rows)
    rescored, _ = ctx.logprobs(sub)
    batch.sampler_logprobs[rows] = rescored * sub.completion_mask
    ex["turn_index"] = turn_index(ex["turn_ends"], mask)
    batch.completions = [tok.decode(ids[r, :lengths[r]].tolist(), skip_special_tokens=True) for r in range(N)]
    return batch
