"""Splitting a completion into reasoning steps, in text and in tokens.

A step ends at each occurrence of a delimiter (default ``"\\n\\n"``, the run's ``reward.step_delimiter``); the
delimiter belongs to the step it ends; the text after the last delimiter is the final step when it is not blank.
Blank steps (a delimiter right after another, or whitespace only) are merged into the step before them, so every
step has content. A completion without a delimiter is one step; an empty completion has none.

``split_steps`` gives the steps' text (what a process reward scores, without the delimiter) and
``step_token_ends`` the index of the last token of each step in the completion (what ``RolloutBatch.step_ends``
holds), so that a per-step score can be placed on the token where its step ends; ``token_char_ends`` maps tokens
to the characters of their decoded text.
"""

from __future__ import annotations

import torch


def step_spans(text: str, delimiter: str = "\n\n") -> list[tuple[int, int, int]]:
    """(start, content_end, end) character offsets of each step; ``end`` includes the trailing delimiter."""
    if not delimiter:
        raise ValueError("reward.step_delimiter must be a non-empty string")
    spans: list[tuple[int, int, int]] = []
    start = 0
    while start < len(text):
        hit = text.find(delimiter, start)
        content_end = len(text) if hit < 0 else hit
        end = len(text) if hit < 0 else hit + len(delimiter)
        if text[start:content_end].strip():
            spans.append((start, content_end, end))
        elif spans:  # blank: merge into the previous step
            s0, c0, _ = spans[-1]
            spans[-1] = (s0, c0, end)
        start = end
    return spans


def split_steps(text: str, delimiter: str = "\n\n") -> list[str]:
    """The steps of ``text`` (content only, delimiter removed)."""
    return [text[s:c] for s, c, _ in step_spans(text, delimiter)]


def token_char_ends(ids: list[int], tokenizer, text: str) -> list[int]:
    """Number of characters of ``text`` (the decoded ``ids``, special tokens skipped, or a prefix of it) covered
    after each token (exact; fast path when the pieces concatenate)."""
    pieces = tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True)
    if "".join(pieces).startswith(text):
        out, acc = [], 0
        for p in pieces:
            acc += len(p)
            out.append(acc)
        return out
    return [len(tokenizer.decode(ids[: t + 1], skip_special_tokens=True)) for t in range(len(ids))]


def step_token_ends(completion_ids: torch.Tensor, lengths: torch.Tensor, texts: list[str], tokenizer,
                    delimiter: str = "\n\n") -> torch.Tensor:
    """Token index of the last token of each step: long [N, S], -1 padded (S = most steps in the batch).

    ``texts`` are the decoded completions (stop string cut off), a prefix of the decoded tokens; the step that
    ends at character c ends on the first token whose decoded prefix covers c characters.
    """
    rows: list[list[int]] = []
    for i, text in enumerate(texts):
        L = int(lengths[i])
        spans = step_spans(text, delimiter)
        if not spans or L == 0:
            rows.append([])
            continue
        ids = completion_ids[i, :L].tolist()
        ends = token_char_ends(ids, tokenizer, text)
        row, t = [], 0
        for _, _, end in spans:
            while t < L - 1 and ends[t] < end:
                t += 1
            row.append(t)
        row[-1] = L - 1  # the last step runs to the end of the completion (EOS included)
        rows.append(row)
    S = max((len(r) for r in rows), default=0)
    out = torch.full((len(texts), S), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out

