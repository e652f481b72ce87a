"""Held-out evaluation: greedy accuracy, unbiased pass@k, mean completion length; of single completions or, when
the run names an environment, of multi-turn episodes (:func:`episode_runner`); instance-adaptive Best-of-N with a
calibrated PRM (:func:`evaluate_ias`)."""

from __future__ import annotations

import math
from math import comb
from typing import Any, Callable

import numpy as np
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
from postrl.calibration import ias_samples, success_bound

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
    reported = greedy.columns.get("env_scores") or []
    for name in sorted({key for sc in reported for key in sc}):
        vals = [sc[name] for sc in reported if name in sc]
        out[f"env/{name}"] = sum(vals) / len(vals)
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
    number of model tokens, ``truncated`` the fraction the environment did not end, and ``env/<name>`` the mean of
    each named score the environment reported (``info['scores']``) over the greedy episodes that reported it (e.g.
    ``adversarial_user``'s consistency and its parts). Prompts are not cut there (as
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


def evaluate_ias(backend, tokenizer, rows: list[dict], prm: Any, *, calibrator: Any = None, target: float = 0.95,
                 quantile: float = 0.1, n_min: int = 1, n_max: int = 16, condition: str | None = "prompt",
                 max_new_tokens: int, temperature: float = 1.0, seed: int = 0, chat_template: str = "auto",
                 stop: list[str] | None = None, score: Callable[[list[str], list[dict]], list[float]] | None = None
                 ) -> dict:
    """Instance-adaptive Best-of-N (:mod:`postrl.calibration.ias`) on ``rows`` against fixed Best-of-``n_max``.

    Per problem: the PRM ``prm`` (a ``postrl prm train`` model) reads the prompt (``prompt_scores``: its score
    and hidden state); the success bound p_i = ``success_bound(calibrator, score, quantile, condition,
    features=hidden when the calibrator was fitted with features)``; N_i = ``ias_samples(p_i, target, n_min,
    n_max)``. ``n_max`` completions are sampled per problem once (at ``temperature``); IAS keeps the first N_i,
    fixed Best-of-N all n_max, and each answers with the completion the PRM scores highest (``prm.score``, its
    own step reduction). A completion is correct when the row's task verifier (or ``score(completions, rows)``)
    gives it >= 1. Returns ``ias/accuracy``, ``ias/mean_n``, ``ias/compute_saved`` (1 - mean_n / n_max),
    ``ias/oracle`` (a correct completion among the N_i), ``ias/fixed_accuracy`` and ``ias/fixed_oracle``
    (Best-of-n_max), ``ias/mean_bound`` (mean p_i), ``ias/n_hist`` (problems per N)."""
    if not rows:
        return {}
    prompts = [r["prompt"] for r in rows]
    sc, hidden = prm.prompt_scores(prompts)
    feats = hidden.numpy() if getattr(calibrator, "n_features", 0) else None
    conds = [condition] * len(rows) if condition is not None else None
    bound = success_bound(calibrator, sc.numpy(), quantile=quantile, conditions=conds, features=feats)
    n = ias_samples(bound, target=target, n_min=n_min, n_max=n_max)
    ids = [encode_prompt(tokenizer, p, chat_template) for p in prompts]
    gen = backend.generate(ids, n_max, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                      stop=list(stop or [])), seed + 2)
    all_rows = [r for r in rows for _ in range(n_max)]
    if score is not None:
        ok = [float(x) >= 1.0 if x is not None and math.isfinite(float(x)) else False
              for x in score(gen.texts, all_rows)]
    else:
        ok = [float(verify_row(t, r) or 0.0) >= 1.0 for t, r in zip(gen.texts, all_rows)]
    ps = prm.score([p for p in prompts for _ in range(n_max)], gen.texts)[:, 0]
    ps = torch.nan_to_num(ps.float(), nan=-math.inf).reshape(len(rows), n_max)
    okt = torch.tensor(ok, dtype=torch.bool).reshape(len(rows), n_max)
    keep = torch.arange(n_max)[None, :] < torch.as_tensor(n)[:, None]
    pick_ias = torch.where(keep, ps, torch.full_like(ps, -math.inf)).argmax(-1)
    pick_all = ps.argmax(-1)
    rng = torch.arange(len(rows))
    hist: dict[str, int] = {}
    for k in n.tolist():
        hist[str(k)] = hist.get(str(k), 0) + 1
    return {"ias/accuracy": float(okt[rng, pick_ias].float().mean()),
            "ias/oracle": float((okt & keep).any(-1).float().mean()),
            "ias/mean_n": float(np.mean(n)), "ias/compute_saved": float(1.0 - np.mean(n) / n_max),
            "ias/fixed_accuracy": float(okt[rng, pick_all].float().mean()),
            "ias/fixed_oracle": float(okt.any(-1).float().mean()),
            "ias/mean_bound": float(np.mean(bound)), "ias/n_hist": hist, "ias/target": target, "ias/n_max": n_max}
