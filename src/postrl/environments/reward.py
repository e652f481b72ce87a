"""The reward source ``environment``: the rewards the environment gave during the episode."""

from __future__ import annotations

import math
from typing import Literal

from postrl.registry import register


@register("reward", "environment",
          source="issue 20: the environment's rewards (TRL environment_factory, verl agent loop)")
def environment(prompts: list, completions: list, env_turn_rewards: list, *,
                reduce: Literal["sum", "last"] = "sum") -> list:
    """The episode's reward from the environment's per-turn rewards (column ``env_turn_rewards``, filled by the
    multi-turn rollout: a list per episode, None where a turn gave no reward, NaN when the environment raised).

    reduce='sum' (default): sum of the turns' rewards; 'last': the last reward given. An episode without any
    reward scores 0.0 (it ended, truncated, before the environment rewarded it); one whose environment raised
    fails (None: NaN in the matrix, excluded from the advantage).
    """
    out = []
    for turns in env_turn_rewards:
        given = [float(r) for r in (turns or []) if r is not None]
        if any(math.isnan(r) for r in given):
            out.append(None)
        elif not given:
            out.append(0.0)
        else:
            out.append(sum(given) if reduce == "sum" else given[-1])
    return out
