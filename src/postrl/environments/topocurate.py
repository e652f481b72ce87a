"""TopoCurate's RL task selection: prompts whose multi-trial episodes branch into errors and into several distinct
successful strategies are trained first.

"TopoCurate: Modeling Interaction Topology for Tool-Use Agent Training" projects the episodes of one task onto a
quotient of their action-observation states. Here (after TopoCurate; the abstract gives no formula): each model
turn of an episode is the state pair (a, o), a = the turn's action signature (its tool calls, parsed and written
canonically as ``name(sorted keyword arguments)``, else ``answer:`` and its whitespace-normalised text) and o = the
outcome of the turn's calls (``err`` when one was malformed or failed, else ``ok``); the G episodes of a group
become a prefix tree over these pairs, so equal action-observation histories merge (the quotient is exact
signature equality of prefixes, not a learned semantic equivalence). On that tree:

    EBR = (branch edges that are error edges) / (branch edges)
          branch edges: the edges out of nodes with >= 2 children; an edge is an error edge when its observation
          is ``err`` or no episode through it succeeds (reward >= ``success``); 0 without a branch node
    SH  = H(successful paths) / log G   the entropy of the distribution of the successful episodes over their
          distinct full paths, normalised (0 with fewer than 2 successes)
    score = ``w_error`` * EBR + ``w_diverse`` * SH

The selector keeps an exponential moving average (``ema`` 0.5) of each prompt's score over the steps it was
trained on and picks the step's prompts from a pool of ``pool_factor`` (4) x prompts_per_step: unseen prompts first
(explored), then the highest scores (ties broken by a seeded permutation). It pays off with a data file whose
prompts recur over epochs (a procedural task draws new prompts every step, so every candidate is unseen). The
SFT half of TopoCurate (choosing trajectories for supervised fine-tuning) is not part of it.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le

from postrl.environments.toolrl import predicted_calls
from postrl.groups import group_index
from postrl.registry import register
from postrl.selection.filters import raw_column
from postrl.selection.selectors import PromptSelector, prompt_key


def action_signature(text: str) -> str:
    """The canonical signature of a turn's action: its parsed calls, or its normalised answer text."""
    calls, error = predicted_calls(text)
    if calls:
        return ";".join(f"{c['name']}({c['args']!r},{sorted(c['kwargs'].items())!r})" for c in calls)
    if error:
        return "malformed"
    return "answer:" + " ".join(text.lower().split())


def topology_scores(paths: list[list[tuple[str, str]]], success: list[bool]) -> tuple[float, float]:
    """(EBR, SH) of one group's episodes (module docstring): ``paths`` the (action, observation) pairs of each
    episode's turns, ``success`` whether it succeeded."""
    children: dict[tuple, set] = {}
    wins: Counter = Counter()
    for path, ok in zip(paths, success):
        for k in range(len(path)):
            children.setdefault(tuple(path[:k]), set()).add(path[k])
            wins[tuple(path[:k + 1])] += int(ok)
    edges = err = 0
    for node, kids in children.items():
        if len(kids) < 2:
            continue
        for kid in kids:
            edges += 1
            err += int(kid[1] == "err" or wins[node + (kid,)] == 0)
    ebr = err / edges if edges else 0.0
    good = Counter(tuple(p) for p, ok in zip(paths, success) if ok)
    n = sum(good.values())
    G = len(paths)
    sh = 0.0
    if n >= 2 and G >= 2:
        sh = -sum((c / n) * math.log(c / n) for c in good.values()) / math.log(G)
    return ebr, sh


@register("selector", "topocurate", source="TopoCurate: Modeling Interaction Topology for Tool-Use Agent Training",
          needs=("groups",))
class TopoCurate(PromptSelector):
    """Select the prompts whose episodes branch into errors and into distinct successful strategies (TopoCurate's
    RL task selection over the quotient tree of each group's action-observation histories).

    Per trained group: EBR (error-branch ratio) and SH (normalised entropy of the successful paths) of the
    prefix tree of its episodes (:func:`topology_scores`); score = w_error EBR + w_diverse SH (1, 1), averaged
    over steps per prompt (EMA ``ema`` 0.5). Selection: unseen prompts of the pool first, then the highest scores.
    Success: the raw ``reward`` column (default ``environment``) >= ``success`` (1.0). Reads the multi-turn
    rollout's ``turn_actions``, ``turn_tool_errors``, ``turn_malformed_calls``, ``turn_ends``. State: the score
    table (checkpointed). See the module docstring for what is assumed.
    """

    def __init__(self, *, w_error: Annotated[float, Ge(0)] = 1.0, w_diverse: Annotated[float, Ge(0)] = 1.0,
                 ema: Annotated[float, Gt(0), Le(1)] = 0.5, success: float = 1.0,
                 pool_factor: Annotated[int, Ge(1)] = 4, reward: str = "environment"):
        super().__init__(reward, pool_factor)
        self.w_error, self.w_diverse, self.ema, self.success = w_error, w_diverse, ema, success
        self.score: dict[str, float] = {}

    def observe(self, rewards, reward_names, group_ids, prompts, turn_actions, turn_tool_errors,
                turn_malformed_calls, turn_ends, valid=None, raw_rewards=None, raw_reward_names=None,
                branch=None) -> None:
        """Record (prompt key, score) of each group of a scored batch (valid rows)."""
        x = raw_column(rewards, reward_names, self.reward, "filters", raw_rewards, raw_reward_names)
        ok = torch.isfinite(x)
        if valid is not None:
            ok = ok & valid
        inv, ng = group_index(group_ids)
        for g in range(ng):
            rows = [i for i in torch.nonzero((inv == g) & ok).flatten().tolist()]
            if not rows:
                continue
            paths, wins = [], []
            for i in rows:
                n = int((turn_ends[i] >= 0).sum())
                acts = list(turn_actions[i])[:n]
                bad = (turn_tool_errors[i] + turn_malformed_calls[i])[:n].tolist()
                paths.append([(action_signature(a), "err" if b > 0 else "ok") for a, b in zip(acts, bad)])
                wins.append(float(x[i]) >= self.success)
            ebr, sh = topology_scores(paths, wins)
            self.record((prompt_key(prompts[rows[0]]), self.w_error * ebr + self.w_diverse * sh))

    def update(self, summaries: list) -> None:
        for key, s in summaries:
            old = self.score.get(key)
            self.score[key] = s if old is None else (1 - self.ema) * old + self.ema * s

    def select(self, rows: list, k: int, *, seed: int, group_size: int, features=None) -> list[int]:
        unseen = 1.0 + self.w_error + self.w_diverse  # above any score: explored first
        s = torch.tensor([self.score.get(prompt_key(r["prompt"]), unseen) for r in rows], dtype=torch.float64)
        return self._top(s, k, seed)

    def metrics(self) -> dict:
        vals = list(self.score.values())
        return {"filter/topocurate/tracked": float(len(vals)),
                "filter/topocurate/mean_score": float(sum(vals) / len(vals)) if vals else 0.0}

    def state_dict(self) -> dict:
        return {"score": dict(self.score)}

    def load_state_dict(self, state: dict) -> None:
        self.score = dict(state.get("score", {}))
