"""Held-out evaluation: greedy accuracy, unbiased pass@k, mean completion length; of single completions or, when
the run names an environment, of multi-turn episodes (:func:`episode_runner`)."""

from __future__ import annotations

import math
from math import comb
from typing import Any, Callable

import torch

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.data import verify_row
from postrl.data.base import PromptSource
from postrl.seeding import stable_hash
from postrl.environments import make as make_environment
from postrl.environments.reward import environment as environment_reward
from postrl.generation import encode_prompt, fit_prompts
from postrl.environments import episodes
from postrl.generation import SamplingParams

Episodes = Callable[[list[dict], int, SamplingParams, int], RolloutBatch]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def episode_runner(backend, tokenizer, environment: Any, chat_template: str = "auto") -> Episodes | None:
    """``run(rows, k, params, seed)``: k episodes per row of the config's ``environment`` (``{name, max_turns,
    max_total_tokens, params}``) through :func:`postrl.environments.episodes.rollout` with ``backend.generate`` at
    ``params``, row i seeded with stable_hash(seed, i); None when ``environment`` is None (single-turn runs)."""
    if environment is None:
        return None
    env = environment

    def run(rows: list[dict], k: int, params: SamplingParams, seed: int) -> RolloutBatch:
        ctx = ModelContext(None, tokenizer, sampling=params, generate=backend.generate, pad_id=backend.pad_id)
        return episodes.rollout(ctx, rows, k, [stable_hash(seed, i) % 2**62 for i in range(len(rows))],
                                 lambda: make_environment(env.name, env.params), max_turns=env.max_turns,
                                 max_total_tokens=env.max_total_tokens,
                                 group_ids=torch.arange(len(rows)).repeat_interleave(k), chat_template=chat_template,
                                 step_timeout=getattr(env, "step_timeout", None))

    return run


def episode_success(batch: RolloutBatch) -> list[float]:
    """1.0 per episode whose environment reward (the reward source ``environment``: the sum of the rewards the
    environment gave over the episode's turns) is >= 1, else 0.0; an episode whose environment raised fails."""
    return [float(r is not None and r >= 1.0)
            for r in environment_reward(batch.prompts, batch.completions, batch.columns["env_turn_rewards"])]


def _evaluate_episodes(episodes: Episodes, rows: list[dict], *, max_new_tokens: int, k: int, temperature: float,
                       seed: int, stop: list[str] | None) -> dict:
    """:func:`evaluate` of multi-turn episodes: see its docstring."""
    stops = list(stop or [])
    greedy = episodes(rows, 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stops), seed)
    ok = episode_success(greedy)
    rewards = environment_reward(greedy.prompts, greedy.completions, greedy.columns["env_turn_rewards"])
    n = max(1, len(rows))
    out = {
        "scored_by": "environment",
        "accuracy": sum(ok) / n,
        "reward": sum(r if r is not None else 0.0 for r in rewards) / n,
        "mean_length": float(greedy.completion_mask.sum(-1).mean()) if rows else 0.0,
        "turns": float(greedy.extra["num_turns"].float().mean()) if rows else 0.0,
        "truncated": float(greedy.truncated.float().mean()) if rows else 0.0,
        "n": len(rows),
    }
    if k > 1:
        sampled = episode_success(episodes(rows, k, SamplingParams(max_new_tokens=max_new_tokens,
                                                                   temperature=temperature, stop=stops), seed + 1))
        c = [sum(sampled[i * k:(i + 1) * k]) for i in range(len(rows))]
        out["pass@1"] = sum(pass_at_k(k, int(x), 1) for x in c) / n
        out[f"pass@{k}"] = sum(pass_at_k(k, int(x), k) for x in c) / n
    return out


def evaluate(backend, tokenizer, source: PromptSource, rows: list[dict], *, max_new_tokens: int, k: int = 4,
             temperature: float = 1.0, seed: int = 0, chat_template: str = "auto", stop: list[str] | None = None,
             reward: Callable[[list[str], list[str], list[dict]], list[float]] | None = None,
             max_prompt_length: int | None = None, prompt_overflow: str = "truncate",
             episodes: Episodes | None = None) -> dict:
    """Greedy accuracy and mean length on ``rows``; with k > 1 also pass@1 and pass@k from k samples at
    ``temperature``. A completion is correct when the row's task verifier gives it 1.0. When no row has a
    verifier and ``reward(prompts, completions, rows)`` is given (the run's rewards), completions are scored by it
    instead: ``reward`` is its mean on the greedy completions and correct means the full reward (>= 1);
    ``scored_by`` says which was used ("verifier", "rewards", or "none": every completion then counts as wrong).
    A prompt over ``max_prompt_length`` tokens is cut to its last ones (``prompt_overflow='truncate'``) or its row
    left out (``'drop'``), as in training (``rollout.max_prompt_length``); their number is ``prompts_truncated`` /
    ``prompts_dropped``.

    With ``episodes`` (:func:`episode_runner`: the run names an environment) each row is played as a multi-turn
    episode instead, greedy for ``accuracy`` and k sampled episodes for pass@k, and an episode is correct when its
    environment reward is >= 1 (:func:`episode_success`; the environment's own check, e.g. the calculator's answer
    turn, so environments without a task verifier are scored too): ``scored_by`` is "environment", ``reward`` the
    greedy episodes' mean environment reward, ``turns`` their mean number of model turns, ``mean_length`` their mean
    number of model tokens, ``truncated`` the fraction the environment did not end. Prompts are not cut there (as
    in multi-turn training: ``environment.max_total_tokens`` bounds an episode)."""
    if episodes is not None:
        return _evaluate_episodes(episodes, rows, max_new_tokens=max_new_tokens, k=k, temperature=temperature,
                                  seed=seed, stop=stop)
    prompts, over = fit_prompts([encode_prompt(tokenizer, r["prompt"], chat_template) for r in rows],
                                max_prompt_length)
    if prompt_overflow == "drop":
        prompts = [p for p, o in zip(prompts, over) if not o]
        rows = [r for r, o in zip(rows, over) if not o]
    greedy = backend.generate(prompts, 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                         stop=list(stop or [])), seed)
    verified = [verify_row(t, r) for t, r in zip(greedy.texts, rows)]
    by_rewards = reward is not None and bool(rows) and all(v is None for v in verified)

    def score(texts: list[str], of_rows: list[dict], checked: list | None = None) -> list[float]:
        if by_rewards:
            return [float(x) if math.isfinite(x) else 0.0
                    for x in reward([r["prompt"] for r in of_rows], texts, of_rows)]
        return [float(v or 0.0) for v in (checked or [verify_row(t, r) for t, r in zip(texts, of_rows)])]

    scores = score(greedy.texts, rows, verified)
    out = {
        "scored_by": "rewards" if by_rewards else "verifier" if any(v is not None for v in verified) else "none",
        "accuracy": sum(s >= 1.0 for s in scores) / max(1, len(rows)),
        "mean_length": float(greedy.completion_mask.sum(-1).float().mean()),
        "truncated": float(greedy.truncated.float().mean()),
        "n": len(rows),
    }
    if max_prompt_length is not None:
        out["prompts_truncated" if prompt_overflow == "truncate" else "prompts_dropped"] = sum(over)
    if by_rewards:
        out["reward"] = sum(scores) / max(1, len(rows))
    if k > 1:
        gen = backend.generate(prompts, k, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                          stop=list(stop or [])), seed + 1)
        sampled = score(gen.texts, [r for r in rows for _ in range(k)])
        p1 = pk = 0.0
        for i in range(len(rows)):
            c = sum(x >= 1.0 for x in sampled[i * k:(i + 1) * k])
            p1 += pass_at_k(k, c, 1)
            pk += pass_at_k(k, c, k)
        out["pass@1"] = p1 / max(1, len(rows))
        out[f"pass@{k}"] = pk / max(1, len(rows))
    return out
