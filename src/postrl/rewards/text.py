"""Text rewards: reference metrics for translation (sentence BLEU, chrF, MT-R1-Zero's rule-metric mix) and the
reasoning-pattern reward (RPR).

BLEU and chrF are sacrebleu's (``pip install 'postrl[mt]'``; imported on first use). The reference is the row's
``answer`` column; a row without one fails (None, counted and excluded, never read as 0).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated, Literal

from annotated_types import Ge, Gt

from postrl.errors import PostrlError
from postrl.registry import register
from postrl.rewards.builtin import TagName

Tokenize = Literal["13a", "intl", "zh", "char", "none"]  # sacrebleu's tokenizers that need no extra package


def _sacrebleu():
    try:
        from sacrebleu.metrics import BLEU, CHRF
    except ImportError:
        raise PostrlError("the BLEU / chrF rewards need the sacrebleu package; pip install 'postrl[mt]'") from None
    return BLEU, CHRF


def tagged(text: str, tag: str | None) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` of ``text`` (None when there is none), or the whole
    stripped text when ``tag`` is None."""
    if tag is None:
        return (text or "").strip()
    m = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text or "", re.DOTALL)
    return m[-1].strip() if m else None


def sentence_metric(hyp: str, ref: str, metric: str, *, tokenize: str = "13a", effective_order: bool = False,
                    char_order: int = 6, word_order: int = 0, beta: int = 2) -> float:
    """sacrebleu's BLEU or chrF of one hypothesis against one reference, divided by 100 (in [0, 1]).

    BLEU: ``BLEU(tokenize).corpus_score([hyp], [[ref]])`` (4-gram, exponential smoothing, brevity penalty): the
    computation of MT-R1-Zero's reward code; ``effective_order=True`` gives ``sentence_score`` (sacrebleu's
    sentence BLEU, which ignores n-gram orders the hypothesis is too short to have). chrF: ``CHRF(char_order,
    word_order, beta).sentence_score(hyp, [ref])`` (word_order 2: chrF++)."""
    BLEU, CHRF = _sacrebleu()
    if metric == "bleu":
        m = BLEU(tokenize=tokenize, effective_order=effective_order)
        s = m.sentence_score(hyp, [ref]) if effective_order else m.corpus_score([hyp], [[ref]])
    else:
        s = CHRF(char_order=char_order, word_order=word_order, beta=beta).sentence_score(hyp, [ref])
    return float(s.score) / 100.0


def _refs(answer, name: str) -> list:
    if answer is None:
        raise ValueError(f"{name} needs an 'answer' column (the reference translation)")
    return list(answer)


@register("reward", "bleu", source="MT-R1-Zero: Advancing LLM-based Machine Translation via R1-Zero-like "
                                   "Reinforcement Learning (sacrebleu BLEU)")
def bleu(prompts, completions, answer=None, *, tag: TagName | None = None, tokenize: Tokenize = "13a",
         effective_order: bool = False):
    """Sentence BLEU / 100 in [0, 1] of the completion's translation against the reference ``answer``.

    BLEU = BP * exp(sum_{n=1..4} 1/4 log p_n), p_n the clipped n-gram precision (exponential smoothing of a zero
    count), BP = min(1, exp(1 - |ref| / |hyp|)), tokens of sacrebleu's ``tokenize`` (default '13a'; 'zh' for
    Chinese). With ``effective_order`` (default False) the orders the hypothesis is too short for are left out
    (sacrebleu ``sentence_score``); False is MT-R1-Zero's computation (``corpus_bleu`` on the single sentence).
    The translation is the last ``<tag>...</tag>`` of the completion when ``tag`` is set (e.g. 'translate';
    0.0 when absent), else the whole completion, stripped. None for a row without a reference.
    """
    refs = _refs(answer, "bleu")
    out = []
    for c, ref in zip(completions, refs):
        hyp = tagged(c, tag)
        out.append(None if ref is None else 0.0 if not hyp else
                   sentence_metric(hyp, str(ref), "bleu", tokenize=tokenize, effective_order=effective_order))
    return out


@register("reward", "chrf", source="MT-R1-Zero: Advancing LLM-based Machine Translation via R1-Zero-like "
                                   "Reinforcement Learning (sacrebleu chrF)")
def chrf(prompts, completions, answer=None, *, tag: TagName | None = None,
         char_order: Annotated[int, Ge(1)] = 6, word_order: Annotated[int, Ge(0)] = 0, beta: Annotated[int, Ge(1)] = 2):
    """chrF / 100 in [0, 1] of the completion's translation against the reference ``answer`` (sacrebleu).

    chrF = (1 + beta^2) P R / (beta^2 P + R), P and R the character n-gram precision and recall averaged over the
    orders n = 1..``char_order`` (6) that occur (whitespace removed), plus word n-grams up to ``word_order``
    (0; 2 is chrF++); beta 2 weighs recall higher. ``tag`` as for ``bleu``. None for a row without a reference.
    """
    refs = _refs(answer, "chrf")
    out = []
    for c, ref in zip(completions, refs):
        hyp = tagged(c, tag)
        out.append(None if ref is None else 0.0 if not hyp else
                   sentence_metric(hyp, str(ref), "chrf", char_order=char_order, word_order=word_order, beta=beta))
    return out


def mt_format_ok(text: str, tag: str = "translate", check_think: bool = True) -> bool:
    """MT-R1-Zero's structure check: ``<think>``, ``</think>``, ``<tag>``, ``</tag>`` each exactly once, in this
    order (``check_think`` False: only a ``<tag>...</tag>`` block is required)."""
    if not check_think:
        return tagged(text, tag) is not None
    marks = ["<think>", "</think>", f"<{tag}>", f"</{tag}>"]
    if any(text.count(m) != 1 for m in marks):
        return False
    pos = [text.find(m) for m in marks]
    return pos == sorted(pos)


@register("reward", "mt_mixed", source="MT-R1-Zero: Advancing LLM-based Machine Translation via R1-Zero-like "
                                       "Reinforcement Learning (rule-metric mixed reward)")
def mt_mixed(prompts, completions, answer=None, *, metric: Literal["bleu", "chrf"] = "bleu",
             format_reward: Annotated[float, Ge(0)] = 1.0, fail_penalty: Annotated[float, Ge(0)] = 2.0,
             tag: TagName = "translate", check_think: bool = True, tokenize: Tokenize = "13a"):
    """MT-R1-Zero's rule-metric mixed reward: a format score plus the translation metric, or a penalty.

        r = S_format + S_metric
        S_format = +format_reward if the format holds, else -format_reward
        S_metric = metric(translation, reference) / 100   if the format holds and the translation is not empty
                 = -fail_penalty                          otherwise

    The format: ``<think>``, ``</think>``, ``<translate>``, ``</translate>`` each exactly once and in that order
    (``check_think=False``: a ``<translate>`` block suffices); the translation is the last ``<translate>`` block,
    stripped. metric 'bleu' (sacrebleu BLEU on the single sentence, ``tokenize`` '13a'; 'zh' for Chinese targets)
    or 'chrf'. Defaults are the released code's continuous reward (format_reward 1, fail_penalty 2, so
    r in [-3, 2]); its discrete variant and the COMET-based metrics are not included. None for a row without a
    reference (``answer``).
    """
    refs = _refs(answer, "mt_mixed")
    out = []
    for c, ref in zip(completions, refs):
        if ref is None:
            out.append(None)
            continue
        ok = mt_format_ok(c, tag, check_think)
        hyp = tagged(c, tag)
        s_format = format_reward if ok else -format_reward
        s_metric = sentence_metric(hyp, str(ref), metric, tokenize=tokenize) if ok and hyp else -fail_penalty
        out.append(s_format + s_metric)
    return out


# ------------------------------------------------------------------------------------------------ RPR
# The phrases of the authors' reasoning-pattern reward (Noisy-Rewards-in-Learning-to-Reason, math_score.py), in
# their order; "makes sence" there is read as "makes sense".
REASONING_PHRASES = (
    "i need to", "we need to", "wait", "alternatively", "let me check", "let me see", "let's focus on",
    "we know that", "we can observe ", "we can see ", "let me try", "let's try", "let us try", "first, ",
    "firstly, ", "next, ", "finally, ", "let us first", "let's first", "let me first", "try again", "still not",
    "not working", "not correct", "does not work", "doesn't work", "makes sense", "since we ", "because we ",
    "consequently", "as a result", "thus", "therefore", "hence", "so that", "thereby", "if we", "given there ",
    "for instance ", "for example ",
)


def repetition_ratio(text: str, n: int) -> float:
    """(number of distinct word n-grams that occur more than once) / (number of word n-grams); 0 without any."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return sum(1 for v in Counter(grams).values() if v > 1) / len(grams)


@register("reward", "reasoning_pattern", source="The Climb Carves Wisdom Deeper Than the Summit: On the Noisy "
                                                "Rewards in Learning to Reason (reasoning pattern reward, RPR)")
def reasoning_pattern(prompts, completions, *, phrases: list[str] | None = None,
                      norm: Annotated[float, Gt(0)] = 20.0, repetition_n: Annotated[int, Ge(1)] | None = 20,
                      forbidden: list[str] | None = None, region: Literal["all", "think"] = "all"):
    """Reasoning pattern reward (RPR): pays for key reasoning phrases ("first, I need to"), not for the answer.

    The authors' released reward (the abstract names only "rewarding the appearance of key reasoning phrases"):

        r = max(0, min(1, #{phrases p in text} / norm) - rep_n(text) - sum_{f in forbidden} count(f, text))

    on the lower-cased text; a phrase counts once however often it occurs. Defaults: the authors' 40 phrases
    (:data:`REASONING_PHRASES`), norm 20 (20 distinct phrases earn the full reward), rep_n = the share of the
    text's word 20-grams that repeat (:func:`repetition_ratio`; ``repetition_n`` None: no such penalty), and
    forbidden = ["user: "] (each occurrence of a new user turn, a model writing itself a new question, costs 1).
    ``region='think'`` scores only the content of the ``<think>`` block (0 when there is none); the authors
    score the whole response. In [0, 1]. Mix it with a noisy or verifiable reward (the paper: RPR calibrates a
    noisy reward model), e.g. ``rewards: [{name: model, path: rm/}, {name: reasoning_pattern, weight: 0.5}]``.
    """
    ps = [p.lower() for p in (REASONING_PHRASES if phrases is None else phrases)]
    bad = [f.lower() for f in (["user: "] if forbidden is None else forbidden) if f]
    out = []
    for c in completions:
        text = c or ""
        if region == "think":
            text = tagged(text, "think") or ""
        text = text.lower()
        score = min(1.0, sum(1 for p in ps if p in text) / norm)
        if repetition_n is not None:
            score -= repetition_ratio(text, repetition_n)
        score -= sum(text.count(f) for f in bad)
        out.append(max(0.0, score))
    return out


__all__ = ["bleu", "chrf", "mt_mixed", "reasoning_pattern", "sentence_metric", "mt_format_ok", "repetition_ratio",
           "REASONING_PHRASES", "tagged"]
