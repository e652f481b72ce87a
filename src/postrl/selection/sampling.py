"""Sampling plans (kind ``sampling``; config ``filters: [...]``): how the completions of a group are sampled.

Protocol: ``plan(group_size)`` describes the plan for a group of that size and raises a ConfigError when the group
cannot hold it (checked when the step is built); ``rollout(ctx)`` generates the step's groups (:class:`PlanContext`:
the rows, their encoded prompts, the run's generator and sampling parameters, one seed per prompt) and returns a
:class:`Planned` (the generation, row-aligned ``extra`` fields and ``columns``, and which rows' prompts were over
``rollout.max_prompt_length`` when the plan encoded its own prompts).

* ``multi_temperature``: the completions of a group are sampled across several temperatures
  (:func:`generate_multi_temperature` runs the plan with the run's generator);
* ``prompt_augmentation``: each completion of a group is generated under a template drawn from a pool, so the
  rows of one group have different prompts (``prompt_ids`` per row; the group, its advantage baseline, stays the
  question's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Callable, Literal

import torch
from annotated_types import Ge, MinLen
from typing_extensions import Required, TypedDict

from postrl.errors import ConfigError
from postrl.generation import Generation, SamplingParams, decorate_prompt
from postrl.registry import register
from postrl.seeding import derive_seed
from postrl.stages import Regex, TagName, parameters


@dataclass
class PlanContext:
    """What a sampling plan may use to generate the step's groups (one process's share).

    ``rows``: the prompt rows; ``prompt_ids``: each row's prompt encoded as the run encodes it (chat template,
    ``rollout.max_prompt_length``); ``generate(prompt_ids, n, params, seeds) -> Generation`` (the run's backend);
    ``params``: the run's sampling parameters; ``seeds``: one per row (derived from the run's seed, the step and
    the prompt's global index); ``encode(prompt)``: token ids of a prompt (text or conversation) as the run
    encodes prompts, before any length limit; ``encode_text(text)``: ids of raw text, no special tokens;
    ``fit(ids_list) -> (ids_list, over)``: ``rollout.max_prompt_length`` applied (``postrl.generation.fit_prompts``)."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    generate: Callable
    params: SamplingParams
    seeds: list[int]
    group_size: int
    pad_id: int = 0
    encode: Callable[[Any], list[int]] | None = None
    encode_text: Callable[[str], list[int]] | None = None
    fit: Callable[[list[list[int]]], tuple[list[list[int]], list[bool]]] = lambda ids: (ids, [False] * len(ids))


@dataclass
class Planned:
    """A plan's generation: rows ordered prompt by prompt (row ``i * G + j`` = completion j of prompt i);
    ``extra`` / ``columns``: per-row fields for ``batch.extra`` / ``batch.columns``; ``over``: per row, whether
    its prompt was over ``rollout.max_prompt_length`` (None: the rows use ``PlanContext.prompt_ids``)."""

    generation: Generation
    extra: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)
    over: list[bool] | None = None


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

    def rollout(self, ctx: PlanContext) -> Planned:
        gen, temps = generate_multi_temperature(ctx.generate, ctx.prompt_ids, ctx.params, self.plan(ctx.group_size),
                                                ctx.seeds, ctx.pad_id)
        return Planned(gen, extra={"temperature": temps})


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


# ------------------------------------------------------------------------------------------------ prompt augmentation
_PA = "Prompt Augmentation Scales up GRPO Training on Mathematical Reasoning"


class Template(TypedDict, total=False):
    """One prompt template of ``prompt_augmentation``'s pool (a mapping in the config)."""

    name: Required[str]                      # its name (the ``template`` column of its rows)
    system: str                              # a system message (needs the tokenizer's chat template)
    prefix: str                              # text before the query
    suffix: str                              # text after the query
    response_prefix: str                     # text that opens the response (part of the prompt's tokens)
    format: Regex  # the format it asks for: a regex the response must fullmatch
    tags: Annotated[list[TagName], MinLen(1)]  # ... or exactly these tag blocks


def _templates_check(params: dict, run: Any, where: str) -> dict:
    """``prompt_augmentation``: template names unique; ``format`` and ``tags`` not both in one template."""
    names = [t["name"] for t in params.get("templates", [])]
    for i, t in enumerate(params.get("templates", [])):
        if t["name"] in names[:i]:
            raise ConfigError(f"{where}.templates.{i}.name: '{t['name']}' names two templates; give each its own name")
        if "format" in t and "tags" in t:
            raise ConfigError(f"{where}.templates.{i}: give 'format' (a regex) or 'tags', not both")
    return params


def template_format(t: dict) -> str | list[str] | None:
    """The ``template_format`` column value of template ``t``: its tag list, its regex, or None."""
    return list(t["tags"]) if t.get("tags") else t.get("format")


@register("sampling", "prompt_augmentation", source=_PA, check=_templates_check)
class PromptAugmentation:
    """Generate each completion of a group under a prompt template drawn from a pool (diverse reasoning formats).

    After "Prompt Augmentation Scales up GRPO Training on Mathematical Reasoning": training "instructs the model to
    generate reasoning traces under diverse templates and formats", which raises rollout diversity and lets GRPO
    train longer without entropy collapse (no KL term). Template k (``templates``, at least one; a mapping with
    ``name`` and optional ``system``, ``prefix``, ``suffix``, ``response_prefix``, ``format`` or ``tags``) turns a
    query into ``decorate_prompt(query, system, prefix, suffix)`` (:func:`postrl.generation.decorate_prompt`), encoded
    as the run encodes prompts, followed by the tokens of ``response_prefix`` (the start of the answer a template
    may force, e.g. ``"<think>\\n"``); ``rollout.max_prompt_length`` applies to the result.

    Which template: completion j of prompt i gets k_ij from a generator seeded by the prompt's rollout seed (every
    process draws the same for the same prompt and step): ``assign: random`` (default) k_ij ~ Uniform{0..m-1}
    independently; ``assign: cycle`` k_ij = (o_i + j) mod m with o_i ~ Uniform{0..m-1} (every template equally
    often in a group of a multiple of m). ``per: completion`` (default) draws per completion, as the issue
    reads the paper; ``per: prompt`` draws one template for the whole group (what the released code does: its
    dataset draws ``random.choice(templates)`` per question and verl repeats the prompt G times).

    The rows of one group then have different prompts: ``prompt_ids`` (and ``prompt_mask``) are per row, and every
    log-prob the step computes (the sampler's, the trainer's, the reference's, a field producer's) is of the row's
    own tokens, so the rows stay on-policy; the group (``group_ids``: one id per question) and the advantage
    baseline are the question's, as in the paper (GRPO over completions of the same question under different
    templates). ``batch.prompts`` keeps the question (what rewards, judges and selectors read; a selector's state is
    per question); ``columns['template']`` holds each row's template name and ``columns['template_format']`` the
    format it asked for (its ``tags`` list, else its ``format`` regex, else None), which the reward
    ``template_format`` checks, so one format reward accepts each template's own format. The completion text the
    rewards see is ``response_prefix + generated text`` (``extra['completion_prefix']``, as for branched rows), so
    a format that the response prefix opens is judged whole. Assumed: the pool is the user's (the released code's
    templates are Qwen chat templates with math instructions); uniform draws (the released code uses ``random.choice``).
    """

    def __init__(self, *, templates: Annotated[list[Template], MinLen(1)],
                 per: Literal["completion", "prompt"] = "completion", assign: Literal["random", "cycle"] = "random"):
        self.templates = [dict(t) for t in templates]
        self.per, self.assign = per, assign

    def plan(self, group_size: int) -> list[str]:
        """The pool's template names (any group size holds the plan)."""
        return [t["name"] for t in self.templates]

    def draw(self, seed: int, group_size: int) -> list[int]:
        """The template index of each completion 0..G-1 of the prompt whose rollout seed is ``seed``."""
        m = len(self.templates)
        rng = random.Random(derive_seed("prompt_augmentation", seed))
        if self.per == "prompt":
            return [rng.randrange(m)] * group_size
        if self.assign == "cycle":
            o = rng.randrange(m)
            return [(o + j) % m for j in range(group_size)]
        return [rng.randrange(m) for _ in range(group_size)]

    def prompt_tokens(self, ctx: PlanContext, prompt: Any, k: int) -> list[int]:
        """Token ids of ``prompt`` under template k (before ``rollout.max_prompt_length``)."""
        if ctx.encode is None or ctx.encode_text is None:
            raise ConfigError("filters.prompt_augmentation: this run's sampling context cannot encode prompts")
        t = self.templates[k]
        ids = list(ctx.encode(decorate_prompt(prompt, system=t.get("system"), prefix=t.get("prefix", ""),
                                              suffix=t.get("suffix", ""))))
        return ids + (list(ctx.encode_text(t["response_prefix"])) if t.get("response_prefix") else [])

    def rollout(self, ctx: PlanContext) -> Planned:
        G, P = ctx.group_size, len(ctx.rows)
        picks = [self.draw(s, G) for s in ctx.seeds]                                  # [P][G] template indices
        cache: dict[tuple[int, int], list[int]] = {}
        for i, row in enumerate(ctx.rows):
            for k in set(picks[i]):
                cache[(i, k)] = self.prompt_tokens(ctx, row["prompt"], k)
        if self.per == "prompt":
            ids, over = ctx.fit([cache[(i, picks[i][0])] for i in range(P)])
            gen = ctx.generate(ids, G, ctx.params, list(ctx.seeds))
            over = [o for o in over for _ in range(G)]
        else:  # one generation row per completion, each its own prompt and seed
            ids, over = ctx.fit([cache[(i, picks[i][j])] for i in range(P) for j in range(G)])
            seeds = [derive_seed(ctx.seeds[i], "completion", j) for i in range(P) for j in range(G)]
            gen = ctx.generate(ids, 1, ctx.params, seeds)
        ks = [k for p in picks for k in p]
        prefix = [self.templates[k].get("response_prefix", "") for k in ks]
        extra: dict[str, Any] = {}
        if any(prefix):
            gen = replace(gen, texts=[a + b for a, b in zip(prefix, gen.texts)])
            extra["completion_prefix"] = prefix
        columns = {"template": [self.templates[k]["name"] for k in ks],
                   "template_format": [template_format(self.templates[k]) for k in ks]}
        return Planned(gen, extra=extra, columns=columns, over=list(over))
