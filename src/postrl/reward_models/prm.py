"""Process reward models: step labels from Monte-Carlo rollouts, and training on them.

Labels (Math-Shepherd style "soft" MC estimation; "Math-Shepherd: Verify and Reinforce LLMs Step-by-step without
Human Annotations"). A completion o of prompt q is cut into steps s_1..s_S at the delimiter
(:func:`~postrl.reward_models.model.step_pieces`: the steps of :mod:`postrl.reasoning_steps`, each piece keeping
its trailing delimiter). For every step i < S the policy samples M continuations
c_1..c_M from (q, s_1..s_i); the label is the fraction that reach a correct answer,

    y_i = (1/M) sum_j verify(s_1..s_i + c_j)        (i < S),      y_S = verify(o)

(the last prefix is the completion itself, so its label is its own outcome). Defaults: M = 8 rollouts, delimiter
"\\n\\n" (the run's ``reward.step_delimiter`` default).

Training (:func:`train_prm`): the PRM's head reads the hidden state at the last token of each step;
L = mean over (completion, step) of BCE(sigmoid(logit_i), y_i) with the soft label y_i. AdamW, same settings as
:class:`~postrl.reward_models.train.RMTrainConfig` (epochs, batch_size in completions, lr, weight_decay, clip).
The trained PRM gives [N, S] step scores: :meth:`RewardModel.step_scores`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from postrl.errors import ConfigError, DataError
from postrl.reward_models.backbones import load_backbone
from postrl.reward_models.model import RewardModel, step_pieces
from postrl.reward_models.train import RMTrainConfig
from postrl.data import read_rows
from postrl.generation import SamplingParams, encode_prompt
from postrl.rollout.hf import HFGenerator

__all__ = ["StepRecord", "mc_step_labels", "hf_sampler", "train_prm", "fit_prm", "read_step_records"]

# sample_fn(prompts, prefixes, n, seed) -> for each (prompt, prefix) a list of n continuation strings
SampleFn = Callable[[Sequence[str], Sequence[str], int, int], list[list[str]]]


@dataclass
class StepRecord:
    """One completion with its steps and MC labels (fraction of successful continuations per step)."""

    prompt: str
    completion: str
    labels: list[float]
    steps: list[str] = field(default_factory=list)
    row: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "completion": self.completion, "steps": self.steps, "labels": self.labels}


def mc_step_labels(rows: Sequence[dict], completions: Sequence[str], sample_fn: SampleFn,
                   verify: Callable[[str, dict], float | None], *, delimiter: str = "\n\n", rollouts: int = 8,
                   seed: int = 0) -> list[StepRecord]:
    """Monte-Carlo step labels (module docstring) for ``completions[i]`` of ``rows[i]`` (a task row with ``prompt``).

    All prefixes of all completions are sampled in one ``sample_fn`` call. A completion without steps is
    skipped; a verifier that returns None (the row cannot be checked) is a DataError.
    """
    if rollouts < 1:
        raise ConfigError(f"prm: rollouts must be >= 1, got {rollouts}")
    if len(rows) != len(completions):
        raise ValueError(f"{len(rows)} rows for {len(completions)} completions")

    def check(v, i):
        if v is None:
            raise DataError(f"prm: row {i + 1}: the task's verifier cannot score it (None); step labels need a "
                            f"verifiable task")
        return float(v)

    records: list[StepRecord] = []
    queries: list[tuple[int, int]] = []  # (record, step) of every prefix to roll out
    q_prompts, q_prefixes = [], []
    for i, (row, comp) in enumerate(zip(rows, completions)):
        steps = step_pieces(comp, delimiter)
        if not steps:
            continue
        rec = StepRecord(row["prompt"], comp, [0.0] * len(steps), steps, dict(row))
        rec.labels[-1] = check(verify(comp, row), i)
        for k in range(len(steps) - 1):
            queries.append((len(records), k))
            q_prompts.append(row["prompt"])
            q_prefixes.append("".join(steps[: k + 1]))
        records.append(rec)
    if queries:
        conts = sample_fn(q_prompts, q_prefixes, rollouts, seed)
        if len(conts) != len(queries):
            raise ValueError(f"sample_fn returned {len(conts)} lists for {len(queries)} prefixes")
        for (r, k), prefix, cs in zip(queries, q_prefixes, conts):
            rec = records[r]
            rec.labels[k] = sum(check(verify(prefix + c, rec.row), r) for c in cs) / len(cs)
    return records


def hf_sampler(model, tokenizer, *, max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
               chat_template: str = "auto", stop: Sequence[str] = (), batch_size: int | None = None) -> SampleFn:
    """A ``sample_fn`` that continues ``prompt + prefix`` with a Hugging Face causal LM (:class:`HFGenerator`).

    The prompt is encoded like the policy's (``encode_prompt``), the prefix tokenised without special tokens.
    """
    gen = HFGenerator(model, tokenizer, batch_size=batch_size)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=list(stop))

    def sample(prompts: Sequence[str], prefixes: Sequence[str], n: int, seed: int) -> list[list[str]]:
        ids = [encode_prompt(tokenizer, p, chat_template) + list(tokenizer(x, add_special_tokens=False)["input_ids"])
               for p, x in zip(prompts, prefixes)]
        out = gen.generate(ids, n, params, seed=[seed * 1_000_003 + i for i in range(len(ids))])
        return [out.texts[i * n:(i + 1) * n] for i in range(len(ids))]

    return sample


def train_prm(model: RewardModel, records: Sequence[StepRecord], cfg: RMTrainConfig | None = None, *,
              log: Callable[[str], None] | None = None) -> dict:
    """Train a ``kind='prm'`` model on step labels: BCE(sigmoid(logit at step end), y) averaged over steps."""
    cfg = cfg or RMTrainConfig()
    cfg.check()
    if model.kind != "prm":
        raise ConfigError(f"prm train: the model's kind is '{model.kind}', expected 'prm'")
    if not records:
        raise DataError("prm train: no step records")
    enc = []
    for i, r in enumerate(records):
        try:
            ids, ends = model.encode_steps(r.prompt, r.completion, r.steps or None)
        except ValueError as e:
            raise DataError(f"prm train: record {i + 1}: {e}") from None
        if len(ends) != len(r.labels):
            raise DataError(f"prm train: record {i + 1}: {len(ends)} steps (delimiter {model.delimiter!r}) but "
                            f"{len(r.labels)} labels")
        enc.append((ids, ends, r.labels))
    dev = model.device
    params = [p for n, p in model.named_parameters() if not n.startswith("beta_raw")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    order = list(range(len(enc)))
    history = []
    model.train()
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        total, count = 0.0, 0
        for s in range(0, len(order), cfg.batch_size):
            batch = [enc[i] for i in order[s:s + cfg.batch_size]]
            width = max(len(e) for _, e, _ in batch)
            ends = torch.full((len(batch), width), -1, dtype=torch.long)
            y = torch.zeros((len(batch), width))
            for i, (_, e, lab) in enumerate(batch):
                ends[i, : len(e)] = torch.as_tensor(e)
                y[i, : len(lab)] = torch.as_tensor(lab, dtype=torch.float32)
            ids, mask = model.collate([x for x, _, _ in batch])
            ends, y = ends.to(dev), y.to(dev)
            logits = model.step_logits(ids, mask, ends)
            ok = ends >= 0
            loss = F.binary_cross_entropy_with_logits(logits[ok], y[ok])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            total += float(loss.detach()) * int(ok.sum())
            count += int(ok.sum())
        history.append(total / max(count, 1))
        if log:
            log(f"prm epoch {epoch + 1}/{cfg.epochs}  loss {history[-1]:.4f}")
    model.eval()
    summary = {"loss": history, "records": len(records), "steps": sum(len(r.labels) for r in records)}
    model.meta.update({"train": summary})
    return summary


def fit_prm(backbone: str, records: Sequence[StepRecord], cfg: RMTrainConfig | None = None, *,
            delimiter: str = "\n\n", reduce: str = "min", max_length: int = 1024, chat_template: str = "auto",
            device: str = "cpu", log: Callable[[str], None] | None = None) -> RewardModel:
    """Build a PRM on ``backbone`` and train it on ``records``."""
    cfg = cfg or RMTrainConfig()
    bb, tok = load_backbone(backbone, seed=cfg.seed)
    model = RewardModel(bb, tok, kind="prm", max_length=max_length, chat_template=chat_template,
                        delimiter=delimiter, reduce=reduce, seed=cfg.seed, meta={"backbone": str(backbone)}).to(device)
    train_prm(model, records, cfg, log=log)
    return model


def read_step_records(path) -> list[StepRecord]:
    """Step records from a JSONL/JSON/parquet file with ``prompt``, ``completion``, ``labels`` (list of numbers)."""
    out = []
    for i, r in enumerate(read_rows(path), 1):
        for f in ("prompt", "completion", "labels"):
            if f not in r:
                raise DataError(f"{path}: row {i}: missing field '{f}'")
        labels = r["labels"]
        if not isinstance(labels, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and 0.0 <= v <= 1.0 for v in labels):
            raise DataError(f"{path}: row {i}: field 'labels' must be a list of numbers in [0, 1]")
        out.append(StepRecord(str(r["prompt"]), str(r["completion"]), [float(v) for v in labels],
                              list(r.get("steps") or [])))
    return out
