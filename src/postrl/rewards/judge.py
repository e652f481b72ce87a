"""Rubric / LLM-judge reward over any OpenAI-compatible ``/v1/chat/completions`` endpoint (stdlib urllib).

:func:`chat` is the one request; :func:`chat_function` makes a judge of either kind (an endpoint, or a function
named by import path) for the other judge-based stages (``rubric_judge``, the DRLC critic).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable

from annotated_types import Ge, Gt

from postrl.errors import ConfigError
from postrl.io import load_object
from postrl.registry import register

DEFAULT_RUBRIC = (
    "You are a strict grader. Read the task, the reference answer (if any) and the response. Score the response "
    "from 0 (wrong or useless) to {max_score:g} (fully correct, clear and concise). Reply with JSON only: "
    '{{"score": <number>, "reason": "<one sentence>"}}'
)
DEFAULT_TEMPLATE = "Task:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{completion}"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class JudgeError(Exception):
    """One judge call that failed (HTTP error, timeout, unreadable reply); reported per entry."""


def parse_score(content: str, max_score: float) -> float:
    """The ``score`` of a JSON reply, divided by ``max_score``; JudgeError when the reply is not such JSON."""
    obj = parse_json_reply(content)
    score = obj.get("score") if isinstance(obj, dict) else None
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise JudgeError(f"reply has no numeric 'score': {content[:60]!r}")
    if not 0.0 <= score <= max_score:
        raise JudgeError(f"score {score} outside [0, {max_score:g}]")
    return float(score) / max_score


def _endpoint(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def chat(base_url: str, model: str, system: str, user: str, *, api_key_env: str | None = "OPENAI_API_KEY",
         timeout: float = 30.0, temperature: float = 0.0, max_tokens: int = 256) -> str:
    """The assistant's reply to one (system, user) exchange: one POST to ``<base_url>/chat/completions`` (OpenAI chat
    format); the bearer token is read from the environment variable ``api_key_env`` when it is set. Raises
    :class:`JudgeError` for an HTTP error, a failed request or timeout, or a malformed response."""
    url = _endpoint(base_url)
    key = os.environ.get(api_key_env) if api_key_env else None
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": model, "temperature": temperature, "max_tokens": max_tokens,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": user}]}).encode()
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = json.loads(resp.read().decode("utf-8"))
        return str(payload["choices"][0]["message"]["content"])
    except urllib.error.HTTPError as e:
        raise JudgeError(f"HTTP {e.code} from {url}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise JudgeError(f"request to {url} failed: {reason}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(f"malformed response from {url}") from None


def chat_function(judge: str | None, *, base_url: str, model: str, what: str,
                  api_key_env: str | None = "OPENAI_API_KEY", timeout: float = 30.0, temperature: float = 0.0,
                  max_tokens: int = 256) -> Callable[[str, str], str]:
    """A judge as one function ``(system, user) -> reply text``: the function named by the import path ``judge``
    ('module:function', e.g. a local model or a test's fake), else :func:`chat` against ``base_url`` with
    ``model``. ``what`` names the config key in a one-line error."""
    if judge is not None:
        fn = load_object(judge, what)
        if not callable(fn):
            raise ConfigError(f"{what} '{judge}': expected a function (system, user) -> reply text")
        return fn
    return lambda system, user: chat(base_url, model, system, user, api_key_env=api_key_env, timeout=timeout,
                                     temperature=temperature, max_tokens=max_tokens)


def parse_json_reply(content: str) -> Any:
    """The JSON value of a judge's reply (a ``` or ```json fence around it is accepted); JudgeError otherwise."""
    text = content.strip()
    m = _FENCE.match(text)
    if m:
        text = m.group(1)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise JudgeError(f"reply is not JSON: {content[:60]!r}") from None


@register("reward", "judge", source="rubric / LLM-as-a-judge over an OpenAI-compatible chat completions endpoint")
def judge(prompts, completions, answer=None, *, base_url: str = "http://127.0.0.1:8000/v1", model: str = "judge",
          rubric: str = DEFAULT_RUBRIC, template: str = DEFAULT_TEMPLATE, max_score: Annotated[float, Gt(0)] = 10.0,
          api_key_env: str = "OPENAI_API_KEY", timeout: Annotated[float, Gt(0)] = 30.0,
          concurrency: Annotated[int, Ge(1)] = 8, temperature: Annotated[float, Ge(0)] = 0.0,
          max_tokens: Annotated[int, Ge(1)] = 256):
    """r_i = score_i / max_score in [0, 1], where score_i is the ``score`` of the judge's JSON reply.

    One POST per completion to ``<base_url>/chat/completions`` (OpenAI chat format): a system message
    ``rubric`` (``{max_score}`` is filled in) and a user message ``template`` filled with ``{prompt}``,
    ``{completion}`` and ``{answer}`` (the row's ``answer`` column, empty when absent). ``model``,
    ``temperature`` (0) and ``max_tokens`` (256) are sent as given; the bearer token is read from the
    environment variable ``api_key_env`` (default OPENAI_API_KEY) when it is set. Up to ``concurrency`` (8)
    requests run at once, each with a ``timeout`` of 30 s. A failed request, a timeout, a reply that is not JSON
    (a ``` fence around it is accepted), has no numeric ``score``, or a score outside [0, max_score] is a failure
    of that entry (counted and excluded), never a crash and never a 0.
    """
    system = rubric.format(max_score=max_score)

    def one(i: int):
        user = template.format(prompt=prompts[i], completion=completions[i],
                               answer="" if answer is None or answer[i] is None else answer[i])
        try:
            return parse_score(chat(base_url, model, system, user, api_key_env=api_key_env, timeout=timeout,
                                    temperature=temperature, max_tokens=max_tokens), max_score)
        except JudgeError as e:
            return e

    if not completions:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(completions)))) as pool:
        return list(pool.map(one, range(len(completions))))
