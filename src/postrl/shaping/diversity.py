"""Diversity through potential-based shaping (DIVER): a completion's distance to the others of its batch."""

from __future__ import annotations

import math
from collections import Counter
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Le

from postrl.groups import group_index
from postrl.registry import register
from postrl.shaping._util import NAN, append_column, correctness

# DIVER's released code: sentence BLEU (nltk, no smoothing) with these n-gram weights, both directions averaged,
# on the first 1000 characters of each response.
DIVER_BLEU_WEIGHTS = (0.02, 0.1, 0.15, 0.25, 0.38)


def _grams(words: list[str], n: int) -> Counter:
    return Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def bleu(ref: list[Counter], ref_len: int, hyp: list[Counter], hyp_len: int, weights=DIVER_BLEU_WEIGHTS) -> float:
    """Sentence BLEU of a hypothesis against one reference, from their n-gram counts (``ref[n-1]`` = the n-grams of
    the reference): BP * exp(sum_n w_n log p_n), p_n = clipped matches / hypothesis n-grams, BP =
    min(1, exp(1 - ref_len / hyp_len)); 0 when some p_n with w_n > 0 is 0 (no smoothing, as nltk's
    ``sentence_bleu`` returns), and for an empty hypothesis."""
    if hyp_len == 0:
        return 0.0
    logp = 0.0
    for w, r, h in zip(weights, ref, hyp):
        if w <= 0:
            continue
        total = sum(h.values())
        match = sum(min(c, r[g]) for g, c in h.items())
        if total == 0 or match == 0:
            return 0.0
        logp += w * math.log(match / total)
    bp = 1.0 if hyp_len > ref_len else math.exp(1.0 - ref_len / hyp_len)
    return bp * math.exp(logp)


def similarity_matrix(texts: list[str], *, similarity: str = "bleu", n: int = 3, max_chars: int | None = 1000
                      ) -> torch.Tensor:
    """Pairwise similarity [N, N] of ``texts`` (first ``max_chars`` characters, whitespace words): 'bleu' =
    (BLEU(i | j) + BLEU(j | i)) / 2 with DIVER's weights (:func:`bleu`); 'jaccard' = |A & B| / |A | B| of the word
    ``n``-gram sets (1 for two empty texts). The diagonal is 1."""
    words = [(t or "")[:max_chars].split() if max_chars else (t or "").split() for t in texts]
    N = len(texts)
    S = torch.eye(N, dtype=torch.float64)
    if similarity == "bleu":
        grams = [[_grams(w, k) for k in range(1, len(DIVER_BLEU_WEIGHTS) + 1)] for w in words]
        for i in range(N):
            for j in range(i + 1, N):
                s = 0.5 * (bleu(grams[j], len(words[j]), grams[i], len(words[i]))
                           + bleu(grams[i], len(words[i]), grams[j], len(words[j])))
                S[i, j] = S[j, i] = s
    else:
        sets = [set(_grams(w, n)) if len(w) >= n else ({tuple(w)} if w else set()) for w in words]
        for i in range(N):
            for j in range(i + 1, N):
                a, b = sets[i], sets[j]
                s = 1.0 if not a and not b else len(a & b) / len(a | b)
                S[i, j] = S[j, i] = s
    return S


@register("shaping", "diversity_potential", source="Diversity-Incentivized Exploration for Versatile Reasoning "
                                                   "(DIVER)")
def diversity_potential(rewards, reward_names, reward_weights, completions, group_ids, *,
                        scope: Literal["batch", "group"] = "batch", similarity: Literal["bleu", "jaccard"] = "bleu",
                        n: Annotated[int, Ge(1)] = 3, max_chars: Annotated[int, Ge(1)] | None = 1000,
                        gamma: Annotated[float, Gt(0), Le(1)] = 1.0, source: str | None = "correct",
                        correct_threshold: float = 1.0, name: str = "diversity", weight: float = 0.1):
    """DIVER: a completion's diversity against the batch, paid through potential-based shaping (a new column).

    After "Diversity-Incentivized Exploration for Versatile Reasoning" (the abstract: global sequence-level
    diversity as an intrinsic reward, "a potential-based reward shaping mechanism to preserve optimal policy
    invariance" and "simple heuristics to mitigate possible reward hacking"; no formula). For completion i:

        d_i   = 1 - mean_{j in S_i, j != i} sim(o_i, o_j)        its distance to the others
        Phi_i = d_i * 1[correct_i]                             (without ``source``: Phi_i = d_i)
        F_i   = gamma * Phi_i - Phi(q_i),   Phi(q) = mean of Phi over the completions of q's group

    S_i = the whole batch (``scope='batch'``, default) or the completion's group ('group', as DIVER's released
    code computes it); sim = DIVER's bidirectional sentence BLEU (weights 0.02, 0.1, 0.15, 0.25, 0.38 for 1- to
    5-grams, no smoothing) on the first ``max_chars`` (1000) characters (``similarity='bleu'``, default), or the
    Jaccard similarity of word ``n``-gram sets ('jaccard'). F is the shaping reward of a one-step episode from the
    prompt state q to the terminal completion state with potential Phi: its potential at q is assumed to be the
    mean potential of q's sampled completions, so F sums to (gamma - 1) sum Phi over a group (0 at gamma = 1,
    the default) and moves no group's mean. The heuristic against reward hacking (from the released code, which
    multiplies the diversity bonus by the correctness reward): only a correct completion (``source`` column >=
    ``correct_threshold``, default 'correct' >= 1) has a potential, so an incorrect one cannot earn diversity;
    ``source: null`` turns it off. The column ``name`` ('diversity') enters the weighted sum with ``weight``
    (0.1, assumed; the released code scales its bonus by 0.001). A completion whose correctness failed (NaN) gets
    NaN; it takes no part in Phi(q). O(N^2) similarities per batch (``scope='group'``: per group). With several
    processes the batch is the one this process scores (its share of the step's prompts).
    """
    N = len(completions)
    inv, ng = group_index(group_ids)
    if scope == "batch":
        S = similarity_matrix(list(completions), similarity=similarity, n=n, max_chars=max_chars)
        d = 1.0 - (S.sum(1) - 1.0) / max(N - 1, 1) if N > 1 else torch.zeros(N, dtype=torch.float64)
    else:
        d = torch.zeros(N, dtype=torch.float64)
        for gi in range(ng):
            rows = torch.nonzero(inv == gi).flatten().tolist()
            if len(rows) < 2:
                continue
            S = similarity_matrix([completions[i] for i in rows], similarity=similarity, n=n, max_chars=max_chars)
            d[rows] = 1.0 - (S.sum(1) - 1.0) / (len(rows) - 1)
    if source is not None:
        ok, known = correctness(rewards, reward_names, source, correct_threshold, "diversity_potential")
        phi = torch.where(known, d * ok.to(torch.float64), torch.full_like(d, NAN))
    else:
        phi = d
    fin = torch.isfinite(phi)
    s = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, torch.where(fin, phi, torch.zeros_like(phi)))
    c = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, fin.to(torch.float64))
    phi_q = (s / c.clamp(min=1.0))[inv]
    F = gamma * phi - phi_q
    return append_column(rewards, reward_names, reward_weights, F, name, weight, "diversity_potential")


__all__ = ["diversity_potential", "similarity_matrix", "bleu", "DIVER_BLEU_WEIGHTS"]
