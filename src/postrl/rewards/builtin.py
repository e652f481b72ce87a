"""Built-in reward sources and verifiers (registered under ``reward``).

Verifiers compare an answer extracted from the completion with the row's reference ``answer`` column. The
``extract`` option says where the answer is:

- ``"none"``: the whole completion;
- ``"answer_tag"``: the content of the last ``<answer>...</answer>`` block;
- ``"boxed"``: the content of the last ``\\boxed{...}`` (balanced braces);
- ``"last_number"``: the last number in the completion (lenient: this mode does not guard against hedging);
- ``"auto"``: boxed, else answer tag, else the whole completion.

Hedging never pays (found by ``postrl probe-reward``): a completion with more than one ``<answer>`` block, or, when
the answer region is the whole completion (no ``\\boxed{}`` / answer tag), with more than one distinct number
("8 or 9 or 7", or "8 8 8"), has no answer; ``numeric`` also rejects several numbers inside the extracted tag. Put reasoning before a ``\\boxed{}`` or an answer tag to have it ignored.

A completion with no extractable answer scores 0.0 (it is wrong, not a reward failure). A row whose reference
answer is missing or unusable gives None: a failure of the reward, counted and excluded, never a silent 0.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction
from typing import Annotated, Literal

from annotated_types import Ge, MinLen

from postrl.errors import PostrlError
from postrl.registry import register
from postrl.stages import Regex, TagName
from postrl.data import verify_row
from postrl.data.reasoning_gym import ReasoningGymSource

EXTRACT_MODES = ("none", "answer_tag", "boxed", "last_number", "auto")
Extract = Literal["none", "answer_tag", "boxed", "last_number", "auto"]  # where the answer is (module docstring)


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer part of a completion (see the module docstring for ``mode``); None when there is none."""
    if mode not in EXTRACT_MODES:
        raise ValueError(f"extract: expected one of {', '.join(EXTRACT_MODES)}, got '{mode}'")
    if mode == "none":
        return text
    if mode in ("boxed", "auto"):
        b = _boxed(text)
        if b is not None or mode == "boxed":
            return b
    if mode in ("answer_tag", "auto"):
        if text.count("<answer>") > 1:  # several (or nested) answer blocks: which one counts is ambiguous
            return None
        m = _ANSWER_TAG.findall(text)
        if m or mode == "answer_tag":
            return m[-1] if m else None
    if mode == "last_number":
        nums = _NUMBER.findall(text)
        return nums[-1] if nums else None  # an explicit choice: no hedge guard (a hedge's last number counts)
    return None if hedged(text) else text


def hedged(text: str) -> bool:
    """True when ``text`` holds more than one number: a hedge ("8 or 9 or 7") or a repeated answer ("8 8 8")."""
    return len(_NUMBER.findall(text)) > 1


def normalize_text(s: str, case_sensitive: bool = False) -> str:
    """Exact-match normalisation: strip, drop surrounding ``$``, trailing ``.``, collapse whitespace, casefold."""
    s = s.strip()
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    s = s.rstrip(".").strip()
    s = " ".join(s.split())
    return s if case_sensitive else s.casefold()


def parse_number(s) -> float | None:
    """A number from text: ``-3``, ``1,234.5``, ``2.5e3``, ``3/4`` (a fraction), ``$12$``; the last number when the
    text holds several; None when it holds none."""
    if isinstance(s, bool) or s is None:
        return None
    if isinstance(s, (int, float)):
        return float(s) if math.isfinite(float(s)) else None
    nums = _NUMBER.findall(str(s))
    if not nums:
        return None
    tok = nums[-1].replace(",", "").replace(" ", "")
    try:
        return float(Fraction(tok)) if "/" in tok else float(tok)
    except (ValueError, ZeroDivisionError):
        return None


@register("reward", "correct", source="task verifier (the row's task decides)")
def correct(prompts, completions, task=None, **columns):
    """1.0 when the row's task verifier accepts the completion, else 0.0 (None where a row has no verifier).

    The verifier is the ``verify`` of the prompt source registered under the row's ``task`` column; the row holds
    the per-completion columns (not ``trainer_state``, ``log_extra``, ``log_metric``: one for the whole call).
    A row without a verifier does not apply to this reward (None, TRL's semantics: the other sources score it).
    """
    keys = [k for k, v in columns.items() if isinstance(v, list) and len(v) == len(completions)]
    out = []
    for i, c in enumerate(completions):
        row = {k: columns[k][i] for k in keys}
        row["task"] = task[i] if task is not None else None
        out.append(verify_row(c, row))
    return out


def _tag_format(text: str, tags: list[str], allow_empty: bool) -> float:
    """1.0 iff ``text`` is exactly ``<t1>..</t1> <t2>..</t2> ...`` (whitespace between and around only)."""
    pos = 0
    markers = [f"<{t}>" for t in tags] + [f"</{t}>" for t in tags]
    for t in tags:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        open_, close = f"<{t}>", f"</{t}>"
        if not text.startswith(open_, pos):
            return 0.0
        end = text.find(close, pos + len(open_))
        if end < 0:
            return 0.0  # unclosed
        content = text[pos + len(open_): end]
        if any(m in content for m in markers):
            return 0.0  # nesting / repeated tags inside a block
        if not allow_empty and not content.strip():
            return 0.0
        pos = end + len(close)
    return 1.0 if not text[pos:].strip() else 0.0  # nothing but whitespace after the last block


@register("reward", "format", source="strict format check; open-r1 issue #359 (tag spam must not score)")
def format_reward(prompts, completions, *, pattern: Regex = r"\s*[-+]?\d+\s*",
                  tags: Annotated[list[TagName], MinLen(1)] | None = None, allow_empty: bool = False):
    """1.0 when the completion has exactly the required format, else 0.0.

    With ``tags`` (e.g. ``["think", "answer"]``): the completion must be exactly one block ``<t>...</t>`` of each
    tag, in the given order, separated and surrounded only by whitespace; a block holding any required tag
    (nesting, repeated or spammed tags), an unclosed tag, a missing or empty block (unless ``allow_empty``) or any
    text outside the blocks scores 0 (the loophole of open-r1 issue #359, where ``re.match`` of
    ``<think>.*?</think>\\s*<answer>.*?</answer>`` paid for extra tags and trailing text).
    Without ``tags``: ``re.fullmatch(pattern, completion, DOTALL)``; the default pattern is a single integer,
    optionally surrounded by whitespace (the built-in tasks' answer format).
    """
    if tags is not None:
        return [_tag_format(c, list(tags), allow_empty) for c in completions]
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.fullmatch(c) else 0.0 for c in completions]


@register("reward", "template_format",
          source="Prompt Augmentation Scales up GRPO Training on Mathematical Reasoning (each template's format)")
def template_format(prompts, completions, template_format=None, *, allow_empty: bool = False):
    """1.0 when the completion has the format its own prompt template asked for, else 0.0; None without one.

    Reads the row's ``template_format`` column, which the sampling plan ``prompt_augmentation`` writes: a list of
    tag names -> the strict tag check of ``format`` with ``tags`` (exactly one non-empty ``<t>...</t>`` block per
    tag, in order, whitespace only around them; ``allow_empty`` as there); a string -> ``re.fullmatch(regex,
    completion, DOTALL)``; None (a template without a format, or a row without the column) -> None, the reward does
    not apply to that row. With prompt augmentation a group mixes templates, so one format reward must accept
    each template's own format (after the paper's format reward per template); the completion includes the
    template's ``response_prefix``.
    """
    if template_format is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for c, f in zip(completions, template_format):
        if f is None:
            out.append(None)
        elif isinstance(f, (list, tuple)):
            out.append(_tag_format(c, [str(t) for t in f], allow_empty))
        else:
            out.append(1.0 if re.fullmatch(str(f), c, re.DOTALL) else 0.0)
    return out


@register("reward", "exact", source="exact match after normalisation (TRL/open-r1 style string verifier)")
def exact(prompts, completions, answer=None, *, extract: Extract = "auto", case_sensitive: bool = False):
    """1.0 when normalize(extracted answer) == normalize(reference ``answer``), else 0.0.

    normalize: strip, drop surrounding ``$...$``, trailing periods, collapse runs of whitespace, casefold (unless
    ``case_sensitive``). Defaults: extract='auto', case_sensitive=False. A missing reference gives None.
    """
    if answer is None:
        raise ValueError("exact needs an 'answer' column")
    out = []
    for c, a in zip(completions, answer):
        if a is None:
            out.append(None)
            continue
        got = extract_answer(c, extract)
        out.append(float(got is not None and normalize_text(got, case_sensitive) == normalize_text(str(a),
                                                                                                    case_sensitive)))
    return out


@register("reward", "numeric", source="numeric match with tolerance (math.isclose)")
def numeric(prompts, completions, answer=None, *, extract: Extract = "auto", rel_tol: Annotated[float, Ge(0)] = 1e-6,
            abs_tol: Annotated[float, Ge(0)] = 1e-6):
    """1.0 when |x - y| <= max(rel_tol * max(|x|, |y|), abs_tol) (``math.isclose``), else 0.0.

    x = the number of the extracted answer (none if it holds several, see the module docstring; commas as thousands separators, ``a/b`` fractions, exponents),
    y = the reference ``answer`` parsed the same way. Defaults: extract='auto', rel_tol=1e-6, abs_tol=1e-6.
    No number in the completion scores 0.0; a reference that is not a number gives None.
    """
    if answer is None:
        raise ValueError("numeric needs an 'answer' column")
    out = []
    for c, a in zip(completions, answer):
        y = parse_number(a)
        if y is None:
            out.append(None)
            continue
        got = extract_answer(c, extract)
        if got is not None and extract != "last_number" and hedged(got):
            got = None  # several numbers in the answer region: a hedge, not an answer
        x = parse_number(got) if got is not None else None
        out.append(float(x is not None and math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol)))
    return out


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise PostrlError("reward 'math' needs the math-verify package; pip install 'postrl[math]'") from None
    return math_verify


@register("reward", "math", source="math-verify (Hugging Face); TRL/open-r1 accuracy_reward")
def math_reward(prompts, completions, answer=None, *, float_rounding: int = 6):
    """1.0 when math-verify finds the completion's answer equivalent to the reference, else 0.0.

    ``verify(parse(answer), parse(completion))`` with math-verify's default extraction (LaTeX with ``\\boxed``
    first, then plain expressions): fractions, sets, intervals, LaTeX vs plain forms are compared symbolically;
    ``float_rounding`` (default 6, math-verify's) digits for numbers. A reference that math-verify cannot parse
    gives None (as TRL's ``accuracy_reward``). math-verify's own signal-based timeouts only work in the main
    thread; elsewhere they are off and the reward's wall-clock ``reward.timeout`` bounds the call instead.
    """
    mv = _math_verify()
    if answer is None:
        raise ValueError("math needs an 'answer' column")
    main = threading.current_thread() is threading.main_thread()
    t = 5 if main else None
    out = []
    for c, a in zip(completions, answer):
        if a is None:
            out.append(None)
            continue
        a = str(a)
        gold = mv.parse(a, parsing_timeout=t)
        if not gold and "$" not in a:
            gold = mv.parse(f"${a}$", parsing_timeout=t)
        if not gold:
            out.append(None)
            continue
        if _boxed(c) is None and "<answer>" not in c and hedged(c):  # see the module docstring: hedging pays 0
            out.append(0.0)
            continue
        pred = mv.parse(c, parsing_timeout=t)
        out.append(float(bool(pred) and mv.verify(gold, pred, float_rounding=float_rounding, timeout_seconds=t)))
    return out


@register("reward", "reasoning_gym", source="reasoning-gym score_answer (Stojanovski et al. 2025)")
def reasoning_gym_reward(prompts, completions, rg_dataset=None, rg_entry=None, rg_config=None, *,
                         extract: Extract = "none"):
    """The dataset's own ``score_answer(answer, entry)`` in [0, 1], for any row that carries reasoning-gym columns.

    Rows need ``rg_dataset`` and ``rg_entry`` (as written by the ``reasoning_gym`` task or a file of such rows);
    a row without them gives None (a failure, counted). ``extract`` (default 'none': the whole completion,
    stripped) picks the answer passed to the scorer, e.g. 'answer_tag' for ``<answer>`` formats; no extractable
    answer scores 0.0.
    """
    n = len(completions)
    rg_dataset = rg_dataset or [None] * n
    rg_entry = rg_entry or [None] * n
    rg_config = rg_config or [None] * n
    out = []
    for c, ds, entry, cfg in zip(completions, rg_dataset, rg_entry, rg_config):
        if not ds or not entry:
            out.append(None)
            continue
        got = extract_answer(c, extract)
        if got is None:
            out.append(0.0)
            continue
        out.append(ReasoningGymSource.verify(got, {"rg_dataset": ds, "rg_entry": entry, "rg_config": cfg}))
    return out
