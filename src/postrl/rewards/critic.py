"""Dense token rewards from an LLM critic (DRLC): span-level critic scores spread onto the completion's tokens.

The producer of the batch field ``critic_token_reward`` [N, T] (:mod:`postrl.fields`), which the advantage
estimator ``critic_dense`` (:mod:`postrl.advantages.token_rewards`) reads. The critic is any judge postrl can call
(:func:`postrl.rewards.judge.chat_function`): a function ``(system, user) -> reply text`` named by import path, or
an OpenAI-compatible endpoint. It sees the task description, the question, the completion and the reward the run
gave it, and answers with the spans of the completion it judges good or bad, each with a score.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge, Gt

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError
from postrl.registry import register
from postrl.rewards.dense import _policy_rows
from postrl.rewards.judge import JudgeError, chat_function, parse_json_reply

CRITIC_SYSTEM = (
    "You are a critic of a language model's outputs. You are given a task description, a question, the model's "
    "response and the reward the environment gave the whole response. Point out the segments of the response that "
    "make it better or worse for the task: quote each segment exactly as it appears in the response, in order, and "
    "score it from -1 (hurts) to 1 (helps). Leave out neutral text. Reply with JSON only: "
    '{"spans": [{"text": "<exact quote>", "score": <number>}, ...]}'
)
CRITIC_TEMPLATE = "Task:\n{task}\n\nQuestion:\n{prompt}\n\nResponse:\n{completion}\n\nEnvironment reward: {reward}"


def parse_spans(reply: str) -> list[tuple[str, float]]:
    """[(quoted text, score)] of a critic's reply ({"spans": [{"text", "score"}]} or a bare list); JudgeError when
    it is not such JSON or a score is not a finite number. An empty list is a valid reply (nothing to point out)."""
    obj = parse_json_reply(reply)
    items = obj.get("spans") if isinstance(obj, dict) else obj
    if not isinstance(items, list):
        raise JudgeError(f"critic reply has no 'spans' list: {reply[:60]!r}")
    out = []
    for it in items:
        text = it.get("text", it.get("span")) if isinstance(it, dict) else None
        score = it.get("score") if isinstance(it, dict) else None
        if not isinstance(text, str) or isinstance(score, bool) or not isinstance(score, (int, float)) \
                or not math.isfinite(score):
            raise JudgeError(f"critic span is not {{'text': str, 'score': number}}: {it!r}"[:100])
        out.append((text, float(score)))
    return out


def locate(text: str, spans: list[tuple[str, float]]) -> list[tuple[int, int, float]]:
    """(start, end, score) character ranges of the quoted spans in ``text``: each searched from the end of the
    previous one found (spans come in order), else from the start; a quote that is not in the text is skipped."""
    out, cursor = [], 0
    for quote, score in spans:
        if not quote:
            continue
        a = text.find(quote, cursor)
        if a < 0:
            a = text.find(quote)
        if a < 0:
            continue
        out.append((a, a + len(quote), score))
        cursor = a + len(quote)
    return out


def spread(ranges: list[tuple[int, int, float]], char_ends: list[int], how: str) -> list[float]:
    """Token rewards from character ranges: token t covers the characters (c_{t-1}, c_t] (``char_ends`` = c;
    c_{-1} = 0); a range [a, b) with score s reaches the tokens it overlaps (c_t > a and c_{t-1} < b) and gives
    each s / (their number) ('uniform'), s ('each'), or its last one s ('last'). Ranges add up."""
    r = [0.0] * len(char_ends)
    for a, b, s in ranges:
        toks = [t for t, c in enumerate(char_ends) if c > a and (char_ends[t - 1] if t else 0) < b]
        if not toks:
            continue
        if how == "last":
            r[toks[-1]] += s
        else:
            for t in toks:
                r[t] += s / len(toks) if how == "uniform" else s
    return r


def _check_critic(params: dict, run: Any, where: str) -> dict:
    """Exactly one critic: ``critic`` (an import path) or ``critic_url`` (an endpoint)."""
    if (params.get("critic") is None) == (params.get("critic_url") is None):
        raise ConfigError(f"{where}: set exactly one of critic (a function 'module:function' (system, user) -> "
                          "reply) and critic_url (an OpenAI-compatible endpoint)")
    return params


@register("field", "critic_token_reward", source="DRLC: Reinforcement Learning with Dense Rewards from LLM Critic")
def critic_token_reward(ctx: ModelContext, batch: RolloutBatch, *, critic: str | None = None,
                        critic_url: str | None = None, critic_model: str = "critic", critic_task: str = "",
                        critic_spread: Literal["uniform", "each", "last"] = "uniform",
                        critic_api_key_env: str = "OPENAI_API_KEY", critic_timeout: Annotated[float, Gt(0)] = 60.0,
                        critic_concurrency: Annotated[int, Ge(1)] = 8,
                        critic_max_tokens: Annotated[int, Ge(1)] = 1024) -> torch.Tensor:
    """An LLM critic's span scores spread onto the completion tokens [N, T] (NaN over a row whose critic failed).

    0 on padding and on text no span quotes.

    The critic (``critic``: a function ``(system, user) -> reply`` by import path; or ``critic_url`` +
    ``critic_model``: an OpenAI-compatible endpoint) gets ``CRITIC_SYSTEM`` and ``CRITIC_TEMPLATE`` filled with
    ``critic_task`` (the task description), the prompt, the completion (its tokens decoded) and the row's scalar
    reward, and replies with quoted spans and scores (:func:`parse_spans`); each span's score goes to the tokens
    it covers (:func:`spread`, ``critic_spread``: 'uniform' (default) splits it evenly, so a span's tokens sum to
    its score; 'each' gives every token the score; 'last' puts it on the span's last token)."""
    if (critic is None) == (critic_url is None):
        _check_critic({"critic": critic, "critic_url": critic_url}, None, "advantage")
    chat = chat_function(critic, base_url=critic_url or "", model=critic_model, what="advantage.critic",
                         api_key_env=critic_api_key_env, timeout=critic_timeout, max_tokens=critic_max_tokens)
    rows = _policy_rows(ctx.tokenizer, batch.completion_ids, batch.completion_mask)
    reward = batch.reward.tolist() if batch.reward is not None else [math.nan] * len(rows)

    def one(i: int) -> list[float] | None:
        _, ends, text = rows[i]
        user = CRITIC_TEMPLATE.format(task=critic_task, prompt=batch.prompts[i], completion=text,
                                      reward="unknown" if not math.isfinite(reward[i]) else f"{reward[i]:g}")
        try:
            spans = parse_spans(chat(CRITIC_SYSTEM, user))
        except JudgeError:
            return None
        return spread(locate(text, spans), ends, critic_spread)

    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    if not rows:
        return out
    with ThreadPoolExecutor(max_workers=max(1, min(critic_concurrency, len(rows)))) as pool:
        res = list(pool.map(one, range(len(rows))))
    for i, r in enumerate(res):
        n = len(rows[i][1])
        if r is None:
            out[i, :n] = math.nan
        elif n:
            out[i, :n] = torch.tensor(r, dtype=torch.float32)
    return out


__all__ = ["critic_token_reward", "parse_spans", "locate", "spread", "CRITIC_SYSTEM", "CRITIC_TEMPLATE"]
