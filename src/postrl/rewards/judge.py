"""Judges: a rubric / LLM-judge reward over any OpenAI-compatible ``/v1/chat/completions`` endpoint (stdlib
urllib), and ``self_judge``, the policy itself as the judge ("Self-Rewarding Language Models").

:func:`chat` is the one request; :func:`chat_function` makes a judge of either kind (an endpoint, or a function
named by import path) for the other judge-based stages (``rubric_judge``, the DRLC critic) and for
:func:`bias_judge` (the cognitive-bias probability of a preference comparison, ``postrl rm train --rationality
judged``).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable, Literal

from annotated_types import Ge, Gt, Le

from postrl.errors import ConfigError
from postrl.io import load_object
from postrl.registry import register
from postrl.generation import encode_prompt, left_pad
from postrl.rewards.label_free import _sample

DEFAULT_RUBRIC = (
    "You are a strict grader. Read the task, the reference answer (if any) and the response. Score the response "
    "from 0 (wrong or useless) to {max_score:g} (fully correct, clear and concise). Reply with JSON only: "
    '{{"score": <number>, "reason": "<one sentence>"}}'
)
DEFAULT_TEMPLATE = "Task:\n{prompt}\n\nReference answer:\n{answer}\n\nResponse:\n{completion}"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class JudgeError(Exception):
    """One judge call that failed (HTTP error, timeout, unreadable reply); reported per entry."""


def _each(one, n: int, concurrency: int) -> list:
    """[one(0), ..., one(n - 1)], up to ``concurrency`` calls at once (each judge call waits on the network)."""
    if not n:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, n))) as pool:
        return list(pool.map(one, range(n)))

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

    return _each(one, len(completions), concurrency)


# ---------------------------------------------------------------------------------------------- cognitive bias

BIAS_RUBRIC = (
    "You audit one human preference judgment for cognitive bias. A person read a task and two responses and "
    "preferred response A to response B. Judge how likely it is that a cognitive bias, rather than the quality of "
    "the responses, decided this preference: for example anchoring on a number or claim in the task, the framing "
    "of the task, the conjunction fallacy, a preference for the longer, more confident or more familiar-sounding "
    "response, authority or bandwagon cues. Score from 0 (the preference follows the quality of the responses) to "
    "{max_score:g} (a bias almost surely decided it). Reply with JSON only: "
    '{{"score": <number>, "reason": "<one sentence>"}}'
)
BIAS_TEMPLATE = "Task:\n{prompt}\n\nPreferred response (A):\n{chosen}\n\nOther response (B):\n{rejected}"


def bias_judge(prompts: list[str], chosen: list[str], rejected: list[str], *, judge: str | None = None,
               base_url: str = "http://127.0.0.1:8000/v1", model: str = "judge", rubric: str = BIAS_RUBRIC,
               template: str = BIAS_TEMPLATE, max_score: float = 10.0, api_key_env: str = "OPENAI_API_KEY",
               timeout: float = 30.0, concurrency: int = 8, temperature: float = 0.0,
               max_tokens: int = 256) -> list:
    """An LLM-as-judge's probability that a cognitive bias shaped each preference comparison: a float in [0, 1]
    per pair (the reply's ``score`` / ``max_score``), or a :class:`JudgeError` for a pair whose call failed.

    The judge is :func:`chat_function`'s: an OpenAI-compatible endpoint (``base_url``, ``model``) or, with ``judge``,
    a function ``(system, user) -> reply text`` named by import path; the reply format is :func:`judge`'s (JSON
    ``{"score": ...}``, a ``` fence accepted). The system message is ``rubric`` (default :data:`BIAS_RUBRIC`:
    anchoring, framing, the conjunction fallacy, length / confidence / familiarity preferences, authority and
    bandwagon cues) and the user message ``template`` filled with ``{prompt}``, ``{chosen}``, ``{rejected}``; up to
    ``concurrency`` calls at once. What ``postrl rm train --rationality judged --bias-judge ...`` asks before
    training ("Mitigating Cognitive Bias in RLHF by Altering Rationality": an LLM judge assesses the likely presence
    of cognitive biases; the rubric is postrl's)."""
    ask = chat_function(judge, base_url=base_url, model=model, what="--bias-judge", api_key_env=api_key_env,
                        timeout=timeout, temperature=temperature, max_tokens=max_tokens)
    system = rubric.format(max_score=max_score)

    def one(i: int):
        try:
            return parse_score(str(ask(system, template.format(prompt=prompts[i], chosen=chosen[i],
                                                               rejected=rejected[i]))), max_score)
        except JudgeError as e:
            return e

    return _each(one, len(prompts), concurrency)


# ---------------------------------------------------------------------------------------------- the policy as judge

SELF_JUDGE_TEMPLATE = (
    "Review the question and the response below and score the response on an additive 5-point scale:\n"
    "- add 1 point if the response is relevant and gives some information related to the question,\n"
    "- add a 2nd point if it addresses a substantial part of the question,\n"
    "- add a 3rd point if it answers the basic elements of the question in a useful way,\n"
    "- add a 4th point if it is clear, direct and complete,\n"
    "- add a 5th point if it is impeccable: correct, expert, with nothing extraneous.\n\n"
    "Question: {prompt}\n\nResponse: {completion}\n\n"
    "Reply with a short justification, then a last line 'Score: <points>'."
)
_SCORE = re.compile(r"Score:\s*(\d+(?:\.\d+)?)")


def parse_self_score(text: str, max_score: int) -> float | None:
    """The number after the last ``Score:`` in a judge's reply, if it is in [0, max_score]; else None."""
    found = _SCORE.findall(text)
    if not found:
        return None
    v = float(found[-1])
    return v if 0.0 <= v <= max_score else None


def _score_tokens(tok, max_score: int) -> list[int]:
    ids = []
    for k in range(max_score + 1):
        t = tok(str(k), add_special_tokens=False)["input_ids"]
        if len(t) != 1:
            raise ValueError(f"self_judge mode=expected: the score '{k}' is {len(t)} tokens for this tokenizer; "
                             f"it needs one token per score 0..{max_score} (use mode=generate)")
        ids.append(t[0])
    return ids


@register("reward", "self_judge", source="Self-Rewarding Language Models (Yuan et al. 2024): LLM-as-a-Judge by the "
          "policy itself")
def self_judge(prompts, completions, context=None, *, mode: Literal["generate", "expected"] = "generate",
               template: str = SELF_JUDGE_TEMPLATE, max_score: Annotated[int, Ge(1), Le(9)] = 5,
               samples: Annotated[int, Ge(1)] = 3, temperature: Annotated[float, Gt(0)] = 1.0,
               max_new_tokens: Annotated[int, Ge(1)] = 256, batch_size: Annotated[int, Ge(1)] = 16):
    """r_i = s_i / max_score in [0, 1], s_i the score the policy itself gives completion i as a judge.

    "Self-Rewarding Language Models": the model being trained is prompted as an LLM-as-a-judge with an additive
    5-point rubric (``template``, filled with ``{prompt}`` and ``{completion}``, encoded as a prompt with the run's
    chat template), and its own judgement is the reward (in the paper, of candidate responses for the next round
    of iterative DPO: ``postrl pairs`` then ``postrl dpo``, docs/preference.md). The judge is the policy of the
    trainer's :class:`~postrl.rewards.core.RewardContext` (``context``), under no_grad.

    * ``mode='generate'`` (the paper's): ``samples`` judgements (default 3, averaged, as the paper does) sampled at
      ``temperature`` (1.0) with at most ``max_new_tokens`` (256); s_i = the mean of the numbers after the last
      ``Score:`` of each reply that has one in [0, max_score]; no such reply: the entry fails (excluded, counted),
      never a 0.
    * ``mode='expected'`` (postrl's addition, not in the paper: deterministic, and usable by a model too small to
      write a judgement): the template followed by ``\\nScore: ``, and s_i = sum_k k p_k / sum_k p_k over the
      next-token probabilities p_k of the tokens '0'..'max_score' (each must be one token); one forward per
      completion, in batches of ``batch_size``.

    Defaults: mode generate, max_score 5 (the paper's scale), samples 3, temperature 1.0, max_new_tokens 256,
    batch_size 16. The rubric text is postrl's paraphrase of the paper's additive-scale judge prompt.
    """
    import torch

    if context is None or context.model is None:
        raise ValueError("self_judge needs the policy (the trainer's RewardContext) to judge with")
    tok, model = context.tokenizer, context.model
    texts = [template.format(prompt=p, completion=c) for p, c in zip(prompts, completions)]
    if mode == "generate":
        out: list = []
        for t in texts:
            scores = [s for s in (parse_self_score(r, max_score)
                                  for r in _sample(context, t, samples, max_new_tokens, temperature))
                      if s is not None]
            out.append(sum(scores) / len(scores) / max_score if scores else
                       JudgeError(f"no 'Score: <0..{max_score}>' in {samples} judgements"))
        return out
    score_ids = torch.tensor(_score_tokens(tok, max_score))
    values = torch.arange(max_score + 1, dtype=torch.float32)
    seqs = [encode_prompt(tok, t, context.chat_template) + tok("\nScore: ", add_special_tokens=False)["input_ids"]
            for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = []
    with torch.no_grad():
        for s in range(0, len(seqs), batch_size):
            ids, mask = left_pad(seqs[s:s + batch_size], pad)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            dev = context.device
            logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                           use_cache=False, logits_to_keep=1).logits[:, -1].float().cpu()
            p = torch.softmax(logits[:, score_ids], dim=-1)  # renormalised over the score tokens
            out.extend(((p * values).sum(-1) / max_score).tolist())
    return out
