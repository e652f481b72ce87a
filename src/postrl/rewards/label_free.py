"""Label-free reward sources computed within each group: majority vote (TTRL, RLCCF) and novelty (EVOL-RL).

Both read the ``group_ids`` column (completions of one prompt share an id), which the scorer always passes.
``co_reward`` (Co-Reward) votes across groups instead: a question's label comes from its paraphrases' completions.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Annotated, Literal

from annotated_types import Ge, Le

from postrl.io import column_flag
from postrl.registry import register
from postrl.rewards.builtin import Extract, extract_answer, normalize_text, parse_number
from postrl import registry
from postrl.generation import encode_prompt

_PURE_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+)?")


def _answer_key(text: str | None) -> str | None:
    """Canonical form for voting: numbers by value (``2``, ``2.0``, ``4/2`` agree), other text normalised."""
    if text is None:
        return None
    t = normalize_text(text)
    if not t:
        return None
    if _PURE_NUMBER.fullmatch(t.replace(",", "").replace(" ", "")):
        x = parse_number(t)
        if x is not None:
            return f"num:{x:.12g}"
    return f"str:{t}"


def _groups(group_ids: list) -> dict:
    out: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        out[g].append(i)
    return out


def _majority(keys: list, weights: list[float]):
    """The answer with the largest total weight (ties: the one seen first); None when no one voted."""
    tot: dict = {}
    for k, w in zip(keys, weights):
        if k is not None:
            tot[k] = tot.get(k, 0.0) + w
    if not tot:
        return None
    best = max(tot.values())
    return next(k for k in keys if k is not None and tot[k] == best)


@register("reward", "majority_vote",
          source="TTRL (Test-Time Reinforcement Learning); RLCCF (Wisdom of the Crowd: Coevolutionary Collective "
                 "Feedback)")
def majority_vote(prompts, completions, group_ids, voter=None, labeled=None, *, extract: Extract = "auto",
                  weighting: Literal["none", "self_consistency"] = "none", only_unlabeled: bool = False):
    """1.0 when the completion's answer equals its group's voted answer, else 0.0 (label-free).

    TTRL (weighting='none'): the voted answer is the most frequent extracted answer of the group; r_i =
    1[a_i = a_maj]. RLCCF (weighting='self_consistency', after RLCCF): completions are split into voters by the
    ``voter`` column; each voter v casts one vote for its own majority answer m_v, weighted by its
    self-consistency SC_v = (#samples of v with answer m_v) / (#samples of v with an answer); the collective
    answer maximises the summed weights, and r_i = 1[a_i = collective answer]. Ties go to the answer seen first
    in the group. Answers are extracted with ``extract`` (default 'auto') and compared after normalisation
    (numbers by value). A completion without an answer gets 0.0 and does not vote; a group where nobody answered
    gets 0.0 throughout.
    Assumptions of the RLCCF mode (the abstract: a collective of several LLMs trained jointly, each model's vote
    weighted by its self-consistency, reward = agreement with the collective): postrl trains one policy, so a
    "model" is whatever the ``voter`` column names (e.g. the sampler, temperature or system prompt that produced
    the completion, or completions of other models supplied as data); without a ``voter`` column the group is one
    voter and the mode equals TTRL. One vote per voter for its own majority (not one vote per sample weighted by
    its voter's SC); SC computed per prompt from this group's samples; no co-training of several models.
    ``only_unlabeled`` (default false; semi-supervised data, TraPO): rows whose ``labeled`` column is true get None
    (the reward does not apply: the verifier scores them), so ``rewards: [correct, {majority_vote, only_unlabeled:
    true}]`` pays labeled rows by their answer and unlabeled rows by the vote (``postrl.io.column_flag`` reads the
    column; a row without it is unlabeled).
    """
    keys = [_answer_key(extract_answer(c, extract)) for c in completions]
    out: list = [0.0] * len(completions)
    skip = [False] * len(completions)
    if only_unlabeled and labeled is not None:
        skip = [column_flag(v, f"reward majority_vote: row {i} column 'labeled'") for i, v in enumerate(labeled)]
    for rows in _groups(group_ids).values():
        gk = [keys[i] for i in rows]
        if weighting == "none":
            maj = _majority(gk, [1.0] * len(rows))
        else:
            voters: dict = defaultdict(list)
            for i in rows:
                voters[voter[i] if voter is not None else None].append(keys[i])
            vk, vw = [], []
            for ks in voters.values():
                answered = [k for k in ks if k is not None]
                if not answered:
                    continue
                m = _majority(answered, [1.0] * len(answered))
                vk.append(m)
                vw.append(sum(k == m for k in answered) / len(answered))
            maj = _majority(vk, vw)
        for i in rows:
            out[i] = None if skip[i] else float(maj is not None and keys[i] == maj)
    return out


def _ngrams(text: str, n: int, unit: str) -> set:
    toks = text.split() if unit == "word" else list(text)
    if len(toks) < n:
        return {tuple(toks)} if toks else set()
    return {tuple(toks[i: i + n]) for i in range(len(toks) - n + 1)}


def _jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


@register("reward", "novelty", source="EVOL-RL (Evolving Language Models without Labels: Majority Drives "
                                      "Selection, Novelty Promotes Variation)")
def novelty(prompts, completions, group_ids, *, n: Annotated[int, Ge(1)] = 3, unit: Literal["word", "char"] = "word",
            alpha: Annotated[float, Ge(0), Le(1)] = 0.5,
            embed: str | None = None):
    """Novelty bonus in [0, 1]: 1 - (alpha * mean_j s_ij + (1 - alpha) * max_j s_ij) over the other members j of
    the completion's group, after EVOL-RL.

    s_ij = Jaccard similarity of the two completions' n-gram sets (default: word 3-grams; unit='char' for
    character n-grams), or, with ``embed`` = 'module:function' mapping list[str] -> [N, D] vectors, the cosine
    similarity of the embeddings. A group of one scores 1.0. Combine with ``majority_vote`` (selection) for
    EVOL-RL.
    Assumptions relative to EVOL-RL (the abstract: the majority-voted answer is a stable anchor for selection; a
    novelty-aware reward favours responses whose *reasoning* differs from what has already been produced,
    measured in semantic space; GRPO with asymmetric clipping and an entropy regulariser):
    - similarity is measured on the whole completion text (reasoning and answer), against the other completions
      of the same group only (not earlier batches); by default in n-gram space, semantic only with ``embed``;
    - the mix of mean and nearest-neighbour similarity (alpha 0.5) is postrl's reading;
    - the coupling is a weighted sum of two reward columns: a minority answer outscores a majority one when
      w_novelty (u_minority - u_majority) > w_vote, possible only with a novelty weight above the vote's (novelty
      lies in [0, 1], the vote in {0, 1}); to keep selection first (the abstract's "majority drives selection")
      give ``novelty`` a smaller weight than ``majority_vote``, e.g. 1.0 and 0.5;
    - asymmetric clipping and the entropy regulariser are separate options (``loss: ppo_clip`` with
      eps_high > eps_low, ``regularizers: entropy_bonus``), not part of this source.
    """
    N = len(completions)
    if embed is not None:
        import torch

        vecs = torch.as_tensor(registry.get("reward", embed)(list(completions)), dtype=torch.float32)
        vecs = torch.nn.functional.normalize(vecs, dim=-1)
        sim = (vecs @ vecs.T).tolist()
    else:
        grams = [_ngrams(c, n, unit) for c in completions]
        sim = None
    out = [1.0] * N
    for rows in _groups(group_ids).values():
        for i in rows:
            others = [j for j in rows if j != i]
            if not others:
                continue
            s = [sim[i][j] if sim is not None else _jaccard(grams[i], grams[j]) for j in others]
            val = 1.0 - (alpha * sum(s) / len(s) + (1.0 - alpha) * max(s))
            out[i] = min(1.0, max(0.0, val)) if math.isfinite(val) else None
    return out


@register("reward", "co_reward", source="Co-Reward: Self-supervised Reinforcement Learning for Large Language Model "
                                        "Reasoning via Contrastive Agreement")
def co_reward(prompts, completions, group_ids, paraphrase_id=None, paraphrase=None, context=None, *,
              extract: Extract = "auto", votes: Annotated[int, Ge(1)] = 8, max_new_tokens: Annotated[int, Ge(1)] = 256,
              temperature: Annotated[float, Ge(0)] = 1.0):
    """1.0 when the completion's answer equals the majority answer of its paraphrases' completions (label-free).

    "Co-Reward": each training question comes with an analogous (paraphrased) question; each question's
    surrogate label is the majority vote of its own rollouts, and the reward cross-refers the labels of the
    pair, so that the model must answer consistently across analogous inputs (harder to collapse than
    ``majority_vote``'s self-agreement). For completion i of group g:
      label_{-g} = the most frequent answer over the completions of g's paraphrases (ties: first seen),
      r_i = 1[a_i = label_{-g}].
    The paraphrases' completions come from one of two places:
    * in the batch: rows whose data column ``paraphrase_id`` holds the same value are paraphrases of one question
      (each a prompt with its own group); the votes of all other groups of the set are pooled (with a pair, the
      paper's setting, label_{-g} is the partner's own majority answer). This needs the data to put a question and
      its paraphrases in the same batch (file rows are shuffled; with ``reward.chunk_size`` a set must not be split
      across chunks).
    * generated: for a group with no paraphrase in the batch whose row carries the paraphrase's text in the data
      column ``paraphrase``, ``votes`` (default 8) completions of that text are sampled from the policy (the
      trainer's ``context``, no grad, ``temperature`` 1.0, at most ``max_new_tokens`` 256, the run's chat
      template) and their majority is the label. Those completions are not trained on (the paper trains on both
      questions; here only the batch's own rollouts are).
    A group with neither fails (NaN entries, excluded from the advantage) with the reason. A completion without an
    answer gets 0.0 and does not vote. Answers are extracted with ``extract`` (default 'auto') and compared after
    normalisation (numbers by value).
    """
    if paraphrase_id is None and paraphrase is None:
        raise ValueError("co_reward: the rows have neither a 'paraphrase_id' column (the id shared by a question and "
                         "its paraphrases in the batch) nor a 'paraphrase' column (the paraphrased question's text)")
    keys = [_answer_key(extract_answer(c, extract)) for c in completions]
    groups = _groups(group_ids)
    sets: dict = defaultdict(list)  # paraphrase id -> group ids (in order of first appearance)
    for g, rows in groups.items():
        pid = paraphrase_id[rows[0]] if paraphrase_id is not None else None
        sets[("id", pid) if pid is not None else ("group", g)].append(g)
    out: list = [0.0] * len(completions)
    for members in sets.values():
        for g in members:
            voters = [keys[i] for h in members if h != g for i in groups[h]]
            if not voters:
                text = paraphrase[groups[g][0]] if paraphrase is not None else None
                if not isinstance(text, str) or not text or context is None:
                    pid = paraphrase_id[groups[g][0]] if paraphrase_id is not None else None
                    why = (f"no paraphrase of this question in the batch (paraphrase_id {pid!r})"
                           + (" and no 'paraphrase' text" if not isinstance(text, str) or not text
                              else " and no policy to sample it (context)"))
                    for i in groups[g]:
                        out[i] = ValueError(f"co_reward: {why}")
                    continue
                voters = [_answer_key(extract_answer(c, extract))
                          for c in _sample(context, text, votes, max_new_tokens, temperature)]
            label = _majority(voters, [1.0] * len(voters))
            for i in groups[g]:
                out[i] = float(label is not None and keys[i] == label)
    return out


def _sample(context, text: str, n: int, max_new_tokens: int, temperature: float) -> list[str]:
    """n completions of ``text`` sampled from the policy in ``context`` (a RewardContext), decoded."""
    import torch

    tok = context.tokenizer
    ids = torch.tensor([encode_prompt(tok, text, context.chat_template)] * n, device=context.device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        gen = context.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                     pad_token_id=pad)
    return tok.batch_decode(gen[:, ids.shape[1]:].cpu(), skip_special_tokens=True)
