"""DP-RFT's reward: differentially private nearest-neighbour votes of a private corpus for synthetic completions.

The private corpus is read by the reward only (embedded once per process); the policy never sees a private text,
only the noisy vote counts.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Annotated

import torch
from annotated_types import Ge, Gt

from postrl.errors import ConfigError, DataError
from postrl.io import load_once, read_jsonl
from postrl.registry import register
from postrl.seeding import derive_seed, stable_hash
from postrl.rewards.semantic import embed

DP_RFT = "DP-RFT: Learning to Generate Synthetic Text via Differentially Private Reinforcement Fine-Tuning"
_WORD = re.compile(r"\w+")


def hashed_embedding(texts: list[str], dim: int = 1024) -> torch.Tensor:
    """Unit-norm bag-of-words vectors [n, dim]: each lower-cased ``\\w+`` word adds 1 at stable_hash(word) % dim
    (feature hashing; an empty text is the zero vector)."""
    out = torch.zeros(len(texts), dim, dtype=torch.float32)
    for i, t in enumerate(texts):
        for w in _WORD.findall(t.lower()):
            out[i, stable_hash(w) % dim] += 1.0
    return torch.nn.functional.normalize(out, dim=-1)


def _embed(texts: list[str], encoder: str | None, dim: int) -> torch.Tensor:
    if encoder is None:
        return hashed_embedding(texts, dim)

    return embed(texts, encoder)


def private_embeddings(path: str, text_field: str, encoder: str | None, dim: int) -> torch.Tensor:
    """Embeddings [M, H] of the private corpus ``path`` (JSON lines with ``text_field``), once per process."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"rewards.dp_nn_votes.private: '{path}' is not a file (JSON lines with '{text_field}')")

    def build() -> torch.Tensor:
        texts = []
        for i, r in enumerate(read_jsonl(p, strict=True), 1):
            if not isinstance(r.get(text_field), str):
                raise DataError(f"{p}: row {i} needs a string '{text_field}'")
            texts.append(r[text_field])
        if not texts:
            raise DataError(f"{p}: no private rows")
        return _embed(texts, encoder, dim)

    return load_once(p, build, "private", text_field, encoder, dim)


def nn_votes(private: torch.Tensor, synthetic: torch.Tensor) -> torch.Tensor:
    """Votes [n]: how many private vectors have synthetic row j as their nearest (largest cosine; ties: the first)."""
    nearest = (private @ synthetic.T).argmax(-1)
    return torch.bincount(nearest, minlength=synthetic.shape[0]).to(torch.float64)


def gaussian_dp_epsilon(noise_multiplier: float, compositions: int, delta: float) -> float:
    """epsilon of ``compositions`` Gaussian mechanisms of L2 sensitivity 1 and noise std ``noise_multiplier``, at
    ``delta``, by Renyi DP: eps = min over alpha > 1 of compositions alpha / (2 sigma^2) + log(1/delta) / (alpha - 1)
    (Mironov 2017), minimised over a grid of alpha in (1, 512]."""
    if noise_multiplier <= 0:
        return math.inf
    best = math.inf
    for k in range(1, 5120):
        a = 1.0 + k / 10.0
        best = min(best, compositions * a / (2 * noise_multiplier**2) + math.log(1 / delta) / (a - 1))
    return best


@register("reward", "dp_nn_votes", source=DP_RFT, needs=("groups",))
def dp_nn_votes(prompts, completions, group_ids, trainer_state=None, *, private: str, text_field: str = "text",
                encoder: str | None = None, hash_dim: Annotated[int, Ge(16)] = 1024,
                noise_multiplier: Annotated[float, Ge(0)] = 1.0, scale: Annotated[float, Gt(0)] | None = None,
                seed: int = 0):
    """Differentially private nearest-neighbour votes of a private corpus for each completion (DP-RFT's reward).

    DP-RFT: "DP-protected nearest-neighbor votes from an eyes-off private corpus as a reward signal for on-policy
    synthetic samples"; after Private Evolution's DP histogram, which DP-RFT's votes come from. Per group (the
    completions of one prompt, the candidates compared): every private text x_m (``private``: JSON lines with
    ``text_field``) votes for its nearest completion, j*(m) = argmax_j cos(E(x_m), E(y_j)); the group's histogram
    h_j = #{m: j*(m) = j} gets Gaussian noise, and
        r_j = (h_j + N(0, noise_multiplier^2)) / scale          (scale default M / G, the votes of a uniform
                                                                 split, so r ~ 1 on average)
    E: the encoder folder ``encoder`` (a small encoder's mean-pooled embedding, as ``semantic_similarity``) or,
    without one, hashed bag-of-words vectors of ``hash_dim`` (1024) dimensions (``hashed_embedding``). Privacy:
    one private text changes one vote of each histogram by one, so each group's histogram is a Gaussian mechanism of
    L2 sensitivity 1 at noise std ``noise_multiplier``; a step's H groups (on every process) compose H such
    mechanisms, T steps H T (``gaussian_dp_epsilon(sigma, H * T, delta)`` gives the (epsilon, delta) of a run; 0:
    no privacy). The noise is seeded by (``seed``, the step, the completions), so a recomputation gives the same
    reward. Assumed (the abstract gives no formula): votes within each prompt's group, unthresholded noisy counts,
    the normalisation, and the hashed embedding as the no-model default (the paper embeds with a sentence encoder).
    """
    emb_p = private_embeddings(private, text_field, encoder, hash_dim)
    emb_s = _embed([str(c) for c in completions], encoder, hash_dim)
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    out = [0.0] * len(completions)
    rows_of: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        rows_of[g].append(i)
    for g, rows in rows_of.items():
        votes = nn_votes(emb_p, emb_s[rows])
        gen = torch.Generator().manual_seed(derive_seed("dp_nn_votes", seed, step, tuple(completions[i]
                                                                                           for i in rows)))
        noisy = votes + noise_multiplier * torch.randn(len(rows), generator=gen, dtype=torch.float64)
        denom = scale if scale is not None else emb_p.shape[0] / len(rows)
        for j, i in enumerate(rows):
            out[i] = float(noisy[j] / denom)
    return out
