"""A flawed process reward for the PURE claim (examples/compare/pure_min_vs_sum.yaml).

With ``reward.step_delimiter: ","`` the built-in model's hedged answer ``"65, I think"`` has two steps, ``"65"``
and ``" I think"``; the bare ``"65"`` has one. The toy PRM scores the answer step 1.0 when its number is right
(else 0.0) and any further step 0.3, as a PRM that rewards any fluent step would. Summed (the canonical return),
the hedged right answer scores 1.3 > 1.0, so RL learns to add steps, which the gold verifier (``correct``) scores 0;
min-form (PURE) scores it min(1.0, 0.3) = 0.3 < 1.0. ``extra`` sets the further steps' score.
"""

from __future__ import annotations


def fluent_steps(prompts, completions, steps, answer, *, extra: float = 0.3, **kwargs):
    """Per completion: [1.0 or 0.0 for the first step's number, then ``extra`` (default 0.3) per further step]."""
    out = []
    for st, ans in zip(steps, answer):
        if not st:
            out.append(None)
            continue
        first = 1.0 if st[0].strip() == str(ans).strip() else 0.0
        out.append([first] + [float(extra)] * (len(st) - 1))
    return out
