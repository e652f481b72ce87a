"""Sampling plans (kind ``sampling``; config ``filters: [...]``): how the completions of a group are sampled.

* ``multi_temperature`` (protocol ``plan(group_size) -> temperatures``): the completions of a group are sampled
  across several temperatures (:func:`generate_multi_temperature` runs the plan with the run's generator).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Callable

import torch
from annotated_types import Ge, MinLen

from postrl.errors import ConfigError
from postrl.generation import Generation, SamplingParams
from postrl.registry import register
from postrl.stages import parameters


def _enough_completions(params: dict, run: Any, where: str) -> dict:
    """``multi_temperature``: the run's group holds a completion for every temperature."""
    temps = params.get("temperatures", parameters(MultiTemperature)["temperatures"][1])
    if run is not None and run.rollout.group_size < len(temps):
        raise ConfigError(f"{where}.temperatures: rollout.group_size={run.rollout.group_size} is smaller than the "
                          f"{len(temps)} temperatures; every temperature needs a completion")
    return params


@register("sampling", "multi_temperature", source="On the Role of Temperature Sampling in Test-Time Scaling",
          check=_enough_completions)
class MultiTemperature:
    """Sample each group across several temperatures: completion j of a prompt uses temperatures[j mod m].

    A training-time reading of a test-time paper. "On the Role of Temperature Sampling in Test-Time Scaling" is
    about inference only: it finds that different sampling temperatures solve different problems, so scaling the
    number of traces along the temperature dimension (and its multi-temperature voting) widens the reasoning
    boundary of a fixed model, with no training. The paper does not train on such samples; postrl's use of the
    idea for the rollouts of RL (more diverse groups) is postrl's assumption, not a result of the paper. Default
    temperatures [0.6, 1.0, 1.4] (assumed). The group size must be at least m. The sampler's log-probs of each row
    are at that row's temperature (``extra['temperature']`` holds it); the trainer's log-probs use
    ``rollout.temperature``, so rows sampled at another temperature are off-policy samples of the trained policy
    (combine with ``loss.tis`` to correct the mismatch, or accept it as exploration noise).
    """

    def __init__(self, *, temperatures: Annotated[tuple[Annotated[float, Ge(0)], ...], MinLen(1)] = (0.6, 1.0, 1.4)):
        self.temperatures = [float(t) for t in temperatures]

    def plan(self, group_size: int) -> list[float]:
        """The temperature of each completion index 0..G-1."""
        if group_size < len(self.temperatures):
            raise ConfigError(f"filters.multi_temperature: rollout.group_size={group_size} is smaller than the "
                              f"{len(self.temperatures)} temperatures; every temperature needs a completion")
        return [self.temperatures[j % len(self.temperatures)] for j in range(group_size)]


def generate_multi_temperature(generate: Callable, prompt_ids: list[list[int]], params: SamplingParams,
                               temps: list[float], seeds: list[int], pad_id: int = 0):
    """Generate G = len(temps) completions per prompt, completion j at temps[j], with ``generate(prompt_ids, n,
    params, seeds)`` (a generation backend's); returns (Generation, [N] temperature of each row)."""
    G, n_prompts = len(temps), len(prompt_ids)
    by_t: dict[float, list[int]] = {}
    for j, t in enumerate(temps):
        by_t.setdefault(t, []).append(j)
    parts = {}
    for t, js in by_t.items():
        s = [(x + int(round(t * 1000)) * 104729) % (2**62) for x in seeds]
        parts[t] = (js, generate(prompt_ids, len(js), replace(params, temperature=t), s))
    width = max(g.completion_ids.shape[1] for _, g in parts.values())
    P = max(g.prompt_ids.shape[1] for _, g in parts.values())
    N = n_prompts * G
    pad = int(pad_id or 0)
    comp = torch.full((N, width), pad, dtype=torch.long)
    lp, mask, kept = torch.zeros((N, width)), torch.zeros((N, width)), torch.zeros((N, width))
    pids = torch.full((N, P), pad, dtype=torch.long)
    pmask = torch.zeros((N, P), dtype=torch.long)
    trunc = torch.zeros(N, dtype=torch.bool)
    texts: list[str] = [""] * N
    row_t = torch.zeros(N)
    for t, (js, g) in parts.items():
        k = len(js)
        for c, j in enumerate(js):
            src = torch.arange(n_prompts) * k + c
            dst = torch.arange(n_prompts) * G + j
            w = g.completion_ids.shape[1]
            comp[dst, :w], lp[dst, :w], mask[dst, :w] = g.completion_ids[src], g.logprobs[src], g.completion_mask[src]
            if g.kept_logmass is not None:
                kept[dst, :w] = g.kept_logmass[src]
            pids[dst, P - g.prompt_ids.shape[1]:] = g.prompt_ids[src]
            pmask[dst, P - g.prompt_ids.shape[1]:] = g.prompt_mask[src]
            trunc[dst] = g.truncated[src]
            row_t[dst] = t
            for a, b in zip(src.tolist(), dst.tolist()):
                texts[b] = g.texts[a]
    filtered = any(g.kept_logmass is not None for _, g in parts.values())
    return Generation(prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask, logprobs=lp,
                      truncated=trunc, texts=texts, kept_logmass=kept if filtered else None), row_t
