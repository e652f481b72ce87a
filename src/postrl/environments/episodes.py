"""Token-in/token-out multi-turn rollouts: a model and an environment take turns; the batch holds the exact ids.

One episode is one row of the :class:`~postrl.batch.RolloutBatch`:

* ``prompt_ids``: the first observation, encoded once (the chat template's user turn with the tools' schemas and
  the generation prompt when the tokenizer has a template and ``chat_template='auto'``; the plain text otherwise);
* ``completion_ids``: every later token in order: each model turn's *sampled ids* exactly as the backend returned
  them, then the environment's observation ids, then the next model turn ...; nothing already in the context is
  decoded and re-encoded (each turn generates from ``prompt_ids + completion_ids`` so far);
* ``completion_mask``: 1 on model tokens, 0 on environment tokens (they are context, never trained);
* ``sampler_logprobs``: the sampler's log-prob of each model token, 0 on environment tokens.

An observation's ids: with a chat template, the text the template puts between an assistant turn's content and
the next generation prompt, with the observation as a message of the environment's ``observation_role``
(``tool`` for tool environments, ``user`` otherwise), i.e. ``render([u, a, obs], generation prompt)`` minus
``render([u], generation prompt) + a``, tokenised on its own (the template's end-of-turn, the observation's turn,
the next assistant header). When the model ended its turn with an EOS id the template's end-of-turn begins with,
that id is not added twice. A template that does not render the history as a prefix of the longer conversation
is a :class:`~postrl.errors.PostrlError`. Without a template the observation text is tokenised as it is.

Limits: at most ``max_turns`` model turns; at most ``max_total_tokens`` completion tokens (model and environment)
per episode: a turn generates at most min(``params.max_new_tokens``, what is left) tokens, and an observation
that does not fit is cut and ends the episode. A model turn that ends without EOS or a stop string is truncated
(``turn_truncated``); the environment still reads it. When the environment has tools, ``</tool_call>`` is a stop
string (the turn ends after the call, the tool runs, the model reads the result).

Per-turn records in ``batch.extra`` (K = ``max_turns``): ``turn_ends`` [N, K] long (index in the completion of
each model turn's last token, -1 padded), ``turn_rewards`` [N, K] float (the environment's reward of each turn,
0 where it gave none, NaN where it raised, NaN beyond the episode), ``turn_truncated`` [N, K] bool,
``num_turns`` [N] long, per-turn counts ``turn_tool_calls``, ``turn_tool_errors``, ``turn_malformed_calls``
[N, K] long (the turn's ``info`` counters), per-episode counts ``tool_calls``, ``tool_errors``,
``malformed_calls``, ``user_errors`` (a simulated user that failed), ``env_errors`` [N] long, ``turn_index``
[N, T] long (the model turn each completion token belongs to, -1 on environment tokens and padding),
``turn_actions`` / ``turn_observations`` (per episode, the list of its turns' decoded actions / the observation
texts that followed them), ``episode_length`` [N] long (completion tokens, model and environment), ``turn_scores``
[N, K] float (the step-level process score the environment gave in a turn's ``info['process_score']``, NaN where
none; ``code_repair`` gives each attempt's layered score), ``failure_cause`` (a list of N: ``'env_error'`` when the
environment raised, ``'token_limit'`` when the token budget ended an episode the environment had not ended, else
the last ``info['failure_cause']`` the environment reported; None when none, e.g. solved). The column
``env_turn_rewards`` (a list per episode, None where a turn gave no reward) feeds the reward source ``environment``;
the column ``env_scores`` holds per episode the named scores the environment reported in ``info['scores']`` (a
dict, the latest value of each name; empty when none). ``truncated`` [N] is True for an episode the environment did
not end.

Fault isolation: an environment whose ``reset`` or ``step`` raises, whose ``step`` runs past ``step_timeout``
seconds (when set: each call then runs in its own daemon thread, abandoned when late) or returns something that is
not ``(observation, reward, done, info)`` with a number or None as reward and a dict (or None) as info ends its
episode: ``env_errors`` counts it and the episode's reward is NaN (a failed entry, excluded from the advantage);
the other episodes and the run go on. When the rollout is over, each environment's optional ``close()`` is called
(an exception there is ignored: the episodes are already recorded). ``purify='cleaner'`` rewrites, after the rollout, each episode whose failed
tool call was later corrected (:mod:`postrl.environments.cleaner`; its tokens re-scored by the policy).

Randomness: turn k of completion j of prompt i samples with seed (seed_i, j, k), so the batch does not depend on
how many episodes end early or on the number of processes. The generation backend is reached only through
``ctx.generate(prompt_token_lists, 1, SamplingParams, seeds)``: any backend works.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import replace
from typing import Any, Callable

import torch

from postrl.batch import RolloutBatch
from postrl.seeding import stable_hash
from postrl.environments import call
from postrl.environments.chat import CallTimeout, call_with_timeout
from postrl.environments.cleaner import purify as purify_batch
from postrl.environments.tools import CLOSE, schemas
from postrl.environments.turns import TURN_COUNTERS, turn_index
from postrl.errors import PostrlError
from postrl.generation import SamplingParams
from postrl.generation import left_pad

COUNTERS = ("tool_calls", "tool_errors", "malformed_calls", "user_errors")
def uses_template(tokenizer: Any, chat_template: str) -> bool:
    return chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, observation: str, tools: list[dict] | None, chat_template: str) -> list[int]:
    """The first observation as prompt ids (a user turn of the template, with the tools, and the generation
    prompt; or the plain text with the tokenizer's special tokens)."""
    if uses_template(tokenizer, chat_template):
        return _ids(tokenizer, _render(tokenizer, [{"role": "user", "content": observation}], tools))
    return list(tokenizer(observation, add_special_tokens=True)["input_ids"])


def observation_ids(tokenizer: Any, observation: str, role: str, tools: list[dict] | None, chat_template: str,
                    ended_with: int | None) -> list[int]:
    """The ids appended after a model turn for ``observation`` (see the module docstring); ``ended_with``: the
    turn's last id when it is an EOS id (not repeated), else None."""
    if not uses_template(tokenizer, chat_template):
        return _ids(tokenizer, observation)
    user, asst = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}
    full = _render(tokenizer, [user, asst, {"role": role, "content": observation}], tools)
    head = _render(tokenizer, [user], tools) + "A"
    if not full.startswith(head):
        raise PostrlError("environment: the tokenizer's chat template does not render a conversation's history as "
                          "a prefix of the longer conversation, so observations cannot be appended as ids; use "
                          "model.chat_template=none or a template that keeps history unchanged")
    ids = _ids(tokenizer, full[len(head):])
    if ended_with is not None and ids and ids[0] == ended_with:
        ids = ids[1:]
    return ids


class _Unmade:
    """Stands in for an environment whose constructor raised (not a user mistake in its parameters): its ``reset``
    raises the same error, so that episode ends as an environment error, counted, and the others run."""

    def __init__(self, error: Exception):
        self.error = error

    def reset(self, row: dict) -> str:
        raise self.error

    def step(self, action: str):
        raise self.error


def _made(make_env: Callable[[], Any]) -> Any:
    """``make_env()``, or an :class:`_Unmade` when the constructor raises (a :class:`PostrlError`, a mistake in the
    configuration, stops the run in one line)."""
    try:
        return make_env()
    except PostrlError:
        raise
    except Exception as e:  # noqa: BLE001 - one environment's failure ends its episode, counted
        return _Unmade(e)


def _in_thread(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread (:func:`postrl.environments.chat.call_with_timeout`); its result, its exception,
    or a TimeoutError after ``timeout`` seconds (the thread is abandoned)."""
    try:
        return call_with_timeout(fn, timeout)
    except CallTimeout:
        return TimeoutError(f"environment step timed out after {timeout:g}s")
    except BaseException as e:  # noqa: BLE001 - returned to the caller, who ends the episode
        return e


def _step_all(envs: list, actions: list[str], timeout: float | None = None) -> list:
    """env.step(action) for each pair; async environments' steps run concurrently; an exception (or, with
    ``timeout``, a TimeoutError for a step past it) is returned in place of the result."""
    results: list[Any] = [None] * len(envs)
    pending = []
    for i, (env, a) in enumerate(zip(envs, actions)):
        try:
            out = env.step(a) if timeout is None else _in_thread(lambda env=env, a=a: env.step(a), timeout)
        except Exception as e:  # noqa: BLE001 - an environment's failure ends its episode, counted
            results[i] = e
            continue
        if inspect.isawaitable(out):
            pending.append((i, out))
        else:
            results[i] = out
    if pending:
        async def one(aw):
            return await (asyncio.wait_for(aw, timeout) if timeout is not None else aw)

        async def gather():
            return await asyncio.gather(*(one(aw) for _, aw in pending), return_exceptions=True)

        for (i, _), r in zip(pending, asyncio.run(gather())):
            results[i] = TimeoutError(f"environment step timed out after {timeout:g}s") \
                if isinstance(r, asyncio.TimeoutError) else r
    return results


def _checked(out: Any) -> tuple[str, float | None, bool, dict, dict] | None:
    """The step's result as (observation, reward, done, counts, info) or None when it is not one (garbage: an env
    error); ``counts`` the checked counters of ``COUNTERS``, ``info`` the environment's info dict (empty when None)."""
    if isinstance(out, BaseException) or not (isinstance(out, tuple) and len(out) == 4):
        return None
    obs, reward, done, info = out
    if info is not None and not isinstance(info, dict):
        return None
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            try:
                reward = float(reward)  # a numpy / torch scalar
            except (TypeError, ValueError):
                return None
        reward = float(reward)
    counts = {}
    for c in COUNTERS:
        v = (info or {}).get(c, 0)
        try:
            iv = int(v)
        except (TypeError, ValueError, OverflowError):
            return None
        if isinstance(v, bool) or iv != v or iv < 0:  # a count: a non-negative whole number (1.0 is one)
            return None
        counts[c] = iv
    return ("" if obs is None else str(obs)), reward, bool(done), counts, (info or {})


def _cut_at_stops(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def rollout(ctx: Any, rows: list[dict], group_size: int, seeds: list[int], make_env: Callable[[], Any], *,
            max_turns: int, max_total_tokens: int, group_ids: torch.Tensor, chat_template: str = "auto",
            extra: dict | None = None, step_timeout: float | None = None, purify: str = "none",
            purify_similarity: float = 0.8) -> RolloutBatch:
    """``group_size`` episodes per prompt row, through ``make_env()`` instances and ``ctx.generate``; one row of
    the returned batch per episode (prompt-major, like single-turn rollouts). See the module docstring.
    ``purify='cleaner'`` rewrites corrected failures (:func:`postrl.environments.cleaner.purify`, with
    ``purify_similarity``); it needs ``ctx.model`` to re-score the rewritten episodes."""
    tok, params = ctx.tokenizer, ctx.sampling or SamplingParams()
    eos = set(int(e) for e in ([tok.eos_token_id] if tok.eos_token_id is not None else []))
    G, N, K = group_size, len(rows) * group_size, max_turns
    envs = [_made(make_env) for _ in range(N)]
    tools = [schemas(list(getattr(env, "tools", None) or [])) for env in envs]
    roles = [getattr(env, "observation_role", "user") for env in envs]
    user_stops = [s for s in params.stop if s]
    turn_params = replace(params, stop=user_stops + ([CLOSE] if any(tools) and CLOSE not in user_stops else []))
    row_of = [i for i in range(len(rows)) for _ in range(G)]

    counts = {k: torch.zeros(N, dtype=torch.long) for k in (*COUNTERS, "env_errors")}
    turn_counts = {k: torch.zeros((N, K), dtype=torch.long) for k in TURN_COUNTERS}
    turn_scores = torch.full((N, K), math.nan)  # the environment's step-level process score (info), NaN if none
    causes: list = [None] * N  # the last failure cause the environment reported (info), per episode
    token_limit = torch.zeros(N, dtype=torch.bool)
    env_rewards: list[list] = [[] for _ in range(N)]
    env_scores: list[dict] = [{} for _ in range(N)]
    finished = torch.zeros(N, dtype=torch.bool)  # the environment ended the episode
    prompts: list[list[int]] = []
    live = []
    for r in range(N):
        try:
            obs = call(envs[r].reset, rows[row_of[r]])
            live.append(r)
        except Exception:  # noqa: BLE001 - a reset that raises ends (empties) that episode, counted
            obs = rows[row_of[r]].get("prompt", "")
            counts["env_errors"][r] += 1
            env_rewards[r].append(math.nan)
            finished[r] = True
        prompts.append(prompt_ids(tok, str(obs), tools[r], chat_template))
    comp: list[list[int]] = [[] for _ in range(N)]
    mask: list[list[float]] = [[] for _ in range(N)]
    logp: list[list[float]] = [[] for _ in range(N)]
    actions_of: list[list[str]] = [[] for _ in range(N)]
    observations_of: list[list[str]] = [[] for _ in range(N)]
    turn_ends = torch.full((N, K), -1, dtype=torch.long)
    turn_rewards = torch.full((N, K), math.nan)
    turn_trunc = torch.zeros((N, K), dtype=torch.bool)

    for k in range(K):
        for r in live:
            if len(comp[r]) >= max_total_tokens:
                token_limit[r] = True
        live = [r for r in live if len(comp[r]) < max_total_tokens]
        if not live:
            break
        budget = [max_total_tokens - len(comp[r]) for r in live]
        p = replace(turn_params, max_new_tokens=max(1, min(params.max_new_tokens, max(budget))))
        gen = ctx.generate([prompts[r] + comp[r] for r in live], 1, p,
                           [stable_hash(seeds[row_of[r]], r % G, k) % 2**62 for r in live])
        actions = []
        for j, r in enumerate(live):
            n = int(gen.completion_mask[j].sum())
            cut = min(n, budget[j], params.max_new_tokens)
            ids = gen.completion_ids[j, :cut].tolist()
            comp[r] += ids
            mask[r] += [1.0] * cut
            logp[r] += gen.logprobs[j, :cut].tolist()
            turn_ends[r, k] = len(comp[r]) - 1
            turn_trunc[r, k] = bool(gen.truncated[j]) or cut < n
            actions.append(_cut_at_stops(tok.decode(ids, skip_special_tokens=True), user_stops))
            actions_of[r].append(actions[-1])
        results = _step_all([envs[r] for r in live], actions, step_timeout)
        nxt = []
        for j, r in enumerate(live):
            out = _checked(results[j])
            if out is None:
                counts["env_errors"][r] += 1
                turn_rewards[r, k] = math.nan
                env_rewards[r].append(math.nan)
                observations_of[r].append("")
                finished[r] = True
                continue
            obs, reward, done, turn_count, info = out
            for c in COUNTERS:
                counts[c][r] += turn_count[c]
            for c in TURN_COUNTERS:
                turn_counts[c][r, k] = turn_count[c]
            score = info.get("process_score")
            if isinstance(score, (int, float)) and not isinstance(score, bool):
                turn_scores[r, k] = float(score)
            if "failure_cause" in info:
                causes[r] = None if info["failure_cause"] is None else str(info["failure_cause"])
            if isinstance(info.get("scores"), dict):
                env_scores[r].update({str(name): float(v) for name, v in info["scores"].items()})
            env_rewards[r].append(reward)
            turn_rewards[r, k] = 0.0 if reward is None else reward
            observations_of[r].append(obs)
            if done:
                finished[r] = True
                continue
            if k == K - 1:
                continue
            last = comp[r][-1] if comp[r] else None
            o = observation_ids(tok, obs, roles[r], tools[r], chat_template, last if last in eos else None)
            room = max_total_tokens - len(comp[r])
            comp[r] += o[:room]
            mask[r] += [0.0] * min(len(o), room)
            logp[r] += [0.0] * min(len(o), room)
            if len(o) < room:
                nxt.append(r)
            else:  # the observation did not fit: the token budget ended the episode
                token_limit[r] = True
        live = nxt
    for env in envs:  # the episodes are over: an environment's optional close() releases what it holds
        if callable(getattr(env, "close", None)):
            try:
                call(env.close)
            except Exception:  # noqa: BLE001 - a failing close changes no episode (their rewards are in)
                pass

    width = max(max((len(c) for c in comp), default=0), 1)
    pad = int(ctx.pad_id)
    c_ids = torch.full((N, width), pad, dtype=torch.long)
    c_mask, c_lp = torch.zeros((N, width)), torch.zeros((N, width))
    for r in range(N):
        L = len(comp[r])
        c_ids[r, :L] = torch.tensor(comp[r], dtype=torch.long)
        c_mask[r, :L] = torch.tensor(mask[r])
        c_lp[r, :L] = torch.tensor(logp[r])
    p_ids, p_mask = left_pad(prompts, pad)
    keys = [key for key in rows[0] if key != "prompt"] if rows else []
    columns = {key: [rows[row_of[r]].get(key) for r in range(N)] for key in keys}
    columns["env_turn_rewards"] = env_rewards
    columns["env_scores"] = env_scores
    ex = dict(extra or {})
    failure = ["env_error" if int(counts["env_errors"][r]) else "token_limit" if bool(token_limit[r]) and
               not bool(finished[r]) else causes[r] for r in range(N)]
    ex.update(turn_ends=turn_ends, turn_rewards=turn_rewards, turn_truncated=turn_trunc,
              num_turns=(turn_ends >= 0).sum(-1), turn_index=turn_index(turn_ends, c_mask), **counts,
              turn_scores=turn_scores, failure_cause=failure,
              episode_length=torch.tensor([len(c) for c in comp], dtype=torch.long),
              **{f"turn_{c}": v for c, v in turn_counts.items()}, turn_actions=actions_of,
              turn_observations=observations_of)
    batch = RolloutBatch(
        prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask, group_ids=group_ids,
        sampler_logprobs=c_lp, truncated=~finished, prompts=[rows[row_of[r]].get("prompt", "") for r in range(N)],
        completions=[tok.decode(c, skip_special_tokens=True) for c in comp], columns=columns, extra=ex)
    if purify == "cleaner":
        batch = purify_batch(ctx, batch, similarity=purify_similarity)
    elif purify != "none":
        raise PostrlError(f"environment.purify: expected none or cleaner, got '{purify}'")
    return batch
