"""Retrieval rewards: ConvSearch-R1's rank incentive from a BM25 retriever over a passage corpus.

BM25 is written here (a few lines over an inverted index), so the reward needs no search engine. The corpus is a
JSON-lines file of passages, indexed once per process (cached by path, modification time and parameters).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Le

from postrl.errors import ConfigError, DataError
from postrl.io import load_once, read_jsonl
from postrl.registry import register

CONVSEARCH = ("ConvSearch-R1: Enhancing Query Reformulation for Conversational Search with Reasoning via "
              "Reinforcement Learning")
_WORD = re.compile(r"\w+")


def bm25_tokens(text: str) -> list[str]:
    """Lower-cased ``\\w+`` words (no stemming, no stop words)."""
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 over ``docs`` (texts), Lucene's form.

    score(q, d) = sum over the query's words t (repeats count) of idf(t) tf(t, d) (k1 + 1) / (tf(t, d) + k1 (1 - b +
    b |d| / avgdl)), idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5)); N documents, n_t of them hold t, |d| the
    document's word count, avgdl the mean. Defaults k1 = 0.9, b = 0.4 (Pyserini's BM25 defaults, the retriever of
    ConvSearch-R1's TopiOCQA / QReCC setting)."""

    def __init__(self, docs: list[str], k1: float = 0.9, b: float = 0.4):
        self.k1, self.b = k1, b
        toks = [bm25_tokens(d) for d in docs]
        self.n = len(docs)
        self.lengths = torch.tensor([len(t) for t in toks], dtype=torch.float64)
        avgdl = float(self.lengths.mean()) if self.n else 0.0
        self.norm = k1 * (1 - b + b * self.lengths / max(avgdl, 1e-12))  # k1 (1 - b + b |d| / avgdl) per doc
        post: dict[str, tuple[list[int], list[int]]] = {}
        for j, t in enumerate(toks):
            for w, c in Counter(t).items():
                ids, tfs = post.setdefault(w, ([], []))
                ids.append(j)
                tfs.append(c)
        self.postings = {w: (torch.tensor(i), torch.tensor(f, dtype=torch.float64)) for w, (i, f) in post.items()}

    def idf(self, word: str) -> float:
        nt = len(self.postings[word][0]) if word in self.postings else 0
        return math.log(1 + (self.n - nt + 0.5) / (nt + 0.5))

    def scores(self, query: str) -> torch.Tensor:
        """score(query, d) for every document [N] (float64)."""
        out = torch.zeros(self.n, dtype=torch.float64)
        for w in bm25_tokens(query):
            if w not in self.postings:
                continue
            ids, tf = self.postings[w]
            out.index_add_(0, ids, self.idf(w) * tf * (self.k1 + 1) / (tf + self.norm[ids]))
        return out

    def rank(self, query: str, gold: list[int]) -> int | None:
        """1-based rank of the best-ranked ``gold`` document (1 + the documents scoring strictly higher); None
        when no gold document shares a word with the query (it is not retrieved at all)."""
        s = self.scores(query)
        best = max((float(s[g]) for g in gold), default=0.0)
        if not gold or best <= 0.0:
            return None
        return int((s > best).sum()) + 1




def load_index(path: str, id_field: str, text_field: str, k1: float, b: float) -> tuple[BM25, dict[str, int]]:
    """(BM25 index, passage id -> position) of the JSON-lines corpus ``path`` (rows ``{id_field, text_field}``),
    built once per process and rebuilt when the file changes."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"rewards.rank_incentive.corpus: '{path}' is not a file (JSON lines of passages with "
                          f"'{id_field}' and '{text_field}')")

    def build() -> tuple[BM25, dict[str, int]]:
        rows = read_jsonl(p, strict=True)
        for i, r in enumerate(rows, 1):
            if id_field not in r or not isinstance(r.get(text_field), str):
                raise DataError(f"{p}: row {i} needs '{id_field}' and a string '{text_field}'")
        return BM25([r[text_field] for r in rows], k1, b), {str(r[id_field]): j for j, r in enumerate(rows)}

    return load_once(p, build, "bm25", id_field, text_field, k1, b)


def rank_incentive_value(rank: int | None) -> float:
    """ConvSearch-R1's rank-incentive reward of the gold passage's rank: (19 - rank) / 9 for ranks 1..10 (2 down to
    1), (100 - rank) / 90 for ranks 11..100 (0.99 down to 0), 0 beyond 100 or when not retrieved."""
    if rank is None or rank > 100:
        return 0.0
    return (19 - rank) / 9 if rank <= 10 else (100 - rank) / 90


_THINK_REWRITE = re.compile(r"<think>.*?</think>\n<rewrite>(.*?)</rewrite>", re.DOTALL)
_REWRITE = re.compile(r"<rewrite>(.*?)</rewrite>", re.DOTALL)


@register("reward", "rank_incentive", source=CONVSEARCH)
def rank_incentive(prompts, completions, gold=None, *, corpus: str, id_field: str = "id", text_field: str = "text",
                   extract: Literal["think_rewrite", "rewrite_tag", "none"] = "think_rewrite",
                   format_penalty: Annotated[float, Ge(0)] = 0.1, k1: Annotated[float, Ge(0)] = 0.9,
                   b: Annotated[float, Ge(0), Le(1)] = 0.4):
    """Rank-incentive reward of a reformulated query: the BM25 rank of the row's gold passage, through a piecewise line.

    ConvSearch-R1 ("Retrieval-Guided Reinforcement Learning with a specially designed rank-incentive reward
    shaping mechanism that addresses the sparsity issue in conventional retrieval metrics"), after its released
    reward (``rewrite_r1.py``): the completion's rewrite q' is retrieved against the passages of ``corpus`` (JSON
    lines ``{id_field, text_field}``) with BM25 (:class:`BM25`, k1 0.9, b 0.4), rank = the position of the best
    of the row's gold passages (column ``gold``: one id or a list of ids), and
        r = (19 - rank) / 9        for rank 1..10      (2 at rank 1, 1 at rank 10)
        r = (100 - rank) / 90      for rank 11..100    (down to 0)
        r = 0                      beyond 100, or when no gold passage shares a word with q'
    (``rank_incentive_value``), so a rewrite that moves the gold passage from rank 60 to 30 is paid although
    recall@10 and MRR@10 would give it nothing. The rewrite: ``extract: think_rewrite`` (default, the released
    format) needs the whole completion to be ``<think>...</think>\\n<rewrite>q'</rewrite>`` and takes q';
    ``rewrite_tag`` takes the last ``<rewrite>`` block anywhere; ``none`` the whole completion. A completion
    without the format gets -``format_penalty`` (-0.1, the released format reward, which replaces the rank
    reward). A row without a gold passage, or naming one the corpus lacks, gives None (a failure, counted).
    Assumed: a plain word tokenizer (Pyserini's Lucene analyser also stems and drops stop words); the released
    code's curriculum variant (a linear reward over ranks 1..100 for the first quarter of training) is not
    included.
    """
    index, pos = load_index(corpus, id_field, text_field, k1, b)
    out: list[float | None] = []
    for i, c in enumerate(completions):
        g = gold[i] if gold is not None else None
        ids = [g] if isinstance(g, (str, int)) else list(g or [])
        if not ids or any(str(x) not in pos for x in ids):
            out.append(None)
            continue
        if extract == "none":
            q = c
        else:
            m = _THINK_REWRITE.fullmatch(c.strip()) if extract == "think_rewrite" else \
                (_REWRITE.findall(c) or [None])[-1]
            q = (m.group(1) if extract == "think_rewrite" and m else m if extract == "rewrite_tag" else None)
            if q is None:
                out.append(-format_penalty)
                continue
        out.append(rank_incentive_value(index.rank(q, [pos[str(x)] for x in ids])))
    return out
