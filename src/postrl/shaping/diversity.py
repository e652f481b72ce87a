"""Diversity-aware shaping: DIVER's potential-based diversity (a completion's distance to the others of its batch) and
GARDO's diversity-amplified reward (carried over from images to text)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Le

from postrl.groups import group_index
from postrl.registry import register
from postrl.shaping._util import NAN, append_column, cols, correctness, group_mean

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


def nearest_distance(texts: list[str], group_ids: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """d_i = min over the other valid rows j of i's group of the Jaccard distance 1 - |A_i & A_j| / |A_i | A_j|
    of their word n-gram sets (:func:`similarity_matrix`, whole texts; two empty texts: 0); 0 for a row without
    another valid row in its group or that is not valid. [N] float64."""
    N = len(texts)
    dist = 1.0 - similarity_matrix(list(texts), similarity="jaccard", n=n, max_chars=None)
    inv, _ = group_index(group_ids)
    v = valid.bool()
    pair = (inv.unsqueeze(0) == inv.unsqueeze(1)) & v.unsqueeze(0) & v.unsqueeze(1) & ~torch.eye(N, dtype=torch.bool)
    d = torch.where(pair, dist, torch.full_like(dist, math.inf)).amin(-1) if N else dist.sum(-1)
    return torch.where(torch.isfinite(d) & v, d, torch.zeros_like(d))


@register("shaping", "gardo_diversity", source="GARDO: Reinforcing Diffusion Models without Reward Hacking "
          "(diversity-aware optimisation)")
def gardo_diversity(rewards: torch.Tensor, reward_names: list, group_ids: torch.Tensor, completions: list, *,
                    sources: list[str] | None = None, lam: Annotated[float, Ge(0)] = 0.5,
                    ngram: Annotated[int, Ge(1)] = 2) -> dict:
    """Amplify the reward of completions both above their group's mean and unlike the group (after GARDO).

    GARDO's diversity-aware optimisation, carried over from images to text. Per group g and reward column k
    (``sources``, default all), with d_i the completion's distance to its nearest neighbour in the group (Jaccard
    distance of distinct word ``ngram``-grams, default bigrams: :func:`nearest_distance`) and
    dn_i = d_i / max_{j in g} d_j (0 when the group's distances are all 0):
      r'_ik = r_ik + lam * dn_i * max(0, r_ik - mean_g r_k)      (lam 0.5)
    so only above-mean ("high-quality") completions gain, in proportion to their margin and to how unlike the rest
    of the group they are; a group whose rewards are all equal is unchanged. Assumed where the abstract is open
    (GARDO measures diversity in an image feature space): the lexical nearest-neighbour distance, the
    group-relative max normalisation, the additive amplification of the margin above the group mean, and lam 0.5
    (postrl's). NaN stays NaN; rows with a NaN in a transformed column take no part in that column's mean, rows
    with any NaN none in the distances. O(N^2) similarities per batch.
    Shapes: rewards [N, K], group_ids [N], completions list[str] of N -> {"rewards": [N, K]}.
    """
    finite = torch.isfinite(rewards).all(-1)
    d = nearest_distance([str(c) for c in completions], group_ids, finite, ngram)
    inv, ng = group_index(group_ids)
    dmax = torch.zeros(ng, dtype=torch.float64).scatter_reduce(0, inv, d, "amax")[inv]
    dn = torch.where(dmax > 0, d / dmax.clamp(min=1e-300), torch.zeros_like(d))
    out = rewards.clone()
    for k in cols(reward_names, sources, "gardo_diversity"):
        r = rewards[:, k].to(torch.float64)
        mean = group_mean(r, group_ids, torch.isfinite(r))
        out[:, k] = (r + lam * dn * torch.relu(r - mean)).to(rewards.dtype)
    return {"rewards": out}


__all__ = ["diversity_potential", "similarity_matrix", "bleu", "DIVER_BLEU_WEIGHTS", "gardo_diversity",
           "nearest_distance"]
