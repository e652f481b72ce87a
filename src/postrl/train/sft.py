"""SFT warm start: teacher-forced fine-tuning on a task's demonstrations.

Each training row's ``solution`` column is the demonstration; the model learns
``-sum_t log p(solution_t + EOS | prompt, solution_<t)`` averaged over solution tokens (prompt tokens carry no
loss). A from-scratch tiny model becomes competent enough for RL to have a learning signal.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from postrl.data.base import PromptSource
from postrl.errors import DataError
from postrl.generation import encode_prompt
from postrl.accel.cpu import ThreadPolicy


def _sft_batch(tokenizer, rows: list[dict], chat_template: str):
    seqs, starts = [], []
    for r in rows:
        if "solution" not in r:
            raise DataError("sft: rows need a 'solution' column (the demonstration to imitate)")
        p = encode_prompt(tokenizer, r["prompt"], chat_template)
        s = tokenizer(r["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + s)
        starts.append(len(p))
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, st) in enumerate(zip(seqs, starts)):  # right padding: teacher forcing needs no left alignment
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, st: len(s)] = torch.tensor(s[st:])
    return ids, attn, labels


def run_sft(model, tokenizer, source: PromptSource, *, steps: int, batch_size: int, lr: float, warmup_steps: int = 0,
            weight_decay: float = 0.0, seed: int = 0, chat_template: str = "auto",
            on_step: Callable[[int, float], None] | None = None, threads: int | None = None) -> list[float]:
    """Train ``model`` in place for ``steps`` steps of ``batch_size`` rows; returns the loss per step.

    AdamW, linear warmup then cosine decay to 10% of ``lr``. ``threads``: torch threads (None: measured per
    phase, 1 or all, see ``postrl.accel.cpu``; the choice changes speed only). Rows come from ``source.train_rows(step, ...)``,
    so the run is deterministic given ``seed``.
    """
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def lr_at(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        frac = (s - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    threads = ThreadPolicy.for_model(model, threads)  # 1 or all threads, measured (postrl.accel.cpu)
    losses = []
    for step in range(steps):
        rows = source.train_rows(step, batch_size, seed)
        ids, attn, labels = _sft_batch(tokenizer, rows, chat_template)
        with threads.use("update", rows=int(attn.sum()), work=int(attn.sum())):
            out = model(input_ids=ids, attention_mask=attn, labels=labels)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
