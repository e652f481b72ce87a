"""Offline preference optimisation (``postrl dpo``): DPO and its family on (prompt, chosen, rejected) pairs.

The driver of the ``preference`` stages (:mod:`postrl.losses.preference`). Per optimizer step, for a batch of
``batch_size`` pairs (in micro-batches of ``micro_batch_size`` pairs, one forward of the 2m sequences
[chosen_1..m, rejected_1..m] each, as TRL's concatenated forward):

    logp_t    = ModelContext.token_logprobs (postrl.logprobs.completion_logprobs: the one log-prob function)
    *_logps   = sum_t m_t logp_t per completion (EOS included), *_lengths = sum_t m_t
    ref_*     = the same under the reference (no gradient), when the stage reads them
    L         = mean over the batch's pairs of the stage's per-pair loss (TRL: per_sequence_loss.mean())

then the gradient-norm clip and one AdamW step (``postrl.train.optim``), the learning-rate schedule, and a line of
``metrics.jsonl`` named as TRL's DPOTrainer logs them: ``loss``, ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies`` (fraction of pairs with chosen reward > rejected reward), ``rewards/margins``,
``logps/chosen``, ``logps/rejected`` (means of the summed log-probs), ``grad_norm``, ``learning_rate``, ``epoch``.
Held-out pairs are evaluated before, every ``eval_every`` steps and after training (``eval.jsonl``, the same names
with TRL's ``eval_`` prefix, plus ``eval_preference_accuracy``: the fraction of pairs whose chosen completion the
policy itself finds more likely, pi(y_c | x) > pi(y_r | x), which is not trivially 0 or 1 before training).

Encoding (the data: :mod:`postrl.reward_models.data`, the reader of ``postrl rm train``): the prompt as for
generation (:func:`postrl.generation.encode_prompt`: the tokenizer's chat template when it has one and
``chat_template='auto'``), each completion tokenised on its own with EOS appended (TRL appends EOS to
non-conversational completions); a sequence longer than ``max_length`` keeps its start (TRL's ``keep_start``) and
a pair whose prompt alone fills ``max_length`` is left out (as TRL drops it), saying how many.

A pair's ``ref_prompt`` column (optional) is the prompt the reference reads its completions under instead of
``prompt`` (context distillation); a stage that reads ``chosen_logits`` / ``ref_chosen_logits`` (``ssb``) gets the
policy's and the reference's token logits over the chosen completion [B, T, V] and ``chosen_mask`` [B, T].

The reference: a frozen copy of the initial policy (loaded again from ``model``), the model at ``ref`` (same
vocabulary required), or with LoRA the policy with its adapter disabled (``postrl.train.policy.reference_model``,
as ``postrl train``); ``precompute_ref`` computes every pair's reference log-probs once before training (TRL
``precompute_ref_log_probs``) and frees a separate reference model. A reference-free stage (simpo, alphapo) loads
none. LoRA, bf16 (float32 master weights, bf16 autocast) and gradient checkpointing as in ``postrl train``
(:func:`postrl.train.policy.load_policy`).

The run directory: ``dpo.json`` (the settings), ``metrics.jsonl``, ``eval.jsonl``, ``notices.jsonl`` (pairs left
out, checkpoints set aside, resumes: :class:`postrl.train.run_state.Notices`), ``checkpoints/step-N``
(atomic, :mod:`postrl.train.checkpoint`; weights, optimizer, scheduler, RNG), ``final/`` (a ``from_pretrained``
folder; with LoRA as ``lora_save`` says), ``summary.json``; the run lock and ``status.json`` of
:mod:`postrl.train.run_state`. The pair order of epoch e is a permutation seeded by (seed, e), so a run resumed
from a checkpoint continues exactly as the uninterrupted run (``tests/test_preference.py`` checks the weights).

:func:`generate_ssb` (``postrl pairs --ssb``) makes Semantic Soft Bootstrapping's rows: per prompt a verified
solution the policy writes after seeing its own correct and most common wrong rollout, with that hinted prompt as
``ref_prompt``; ``postrl dpo ROWS --loss ssb`` distils it.

:func:`generate_pairs` (``postrl pairs``) makes pairs from a policy's own completions: the run's prompt source,
rollout and reward sources (e.g. ``self_judge``, the policy as its own judge) through the step's
:class:`~postrl.step.sampling.BatchSource`; per prompt the best and the worst completion by reward, skipped when
they tie ("Self-Rewarding Language Models"' pair selection), with ``margin`` = the reward gap.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Sequence

import torch

from postrl import accel, stages
from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError, DataError, PostrlError
from postrl.generation import SamplingParams, encode_prompt, left_pad
from postrl.reward_models.data import PreferencePair
from postrl.seeding import derive_seed
from postrl.train import checkpoint as ckpt
from postrl.train import run_state
from postrl.config import load_config
from postrl.data import load_source
from postrl.reward_models import load_reward_model
from postrl.reward_models.model import step_pieces
from postrl.rewards import RewardContext, score_batch
from postrl.rewards.builtin import extract_answer, normalize_text
from postrl.rewards.label_free import _answer_key
from postrl.step import Step
from postrl.step.sampling import BatchSource
from postrl.train.optim import make_optimizer, make_scheduler
from postrl.train.policy import frozen_model, load_policy, reference_model

SETTINGS_FILE = "dpo.json"
REF_FIELDS = ("ref_chosen_logps", "ref_rejected_logps", "ref_chosen_logits")
LOGIT_FIELDS = ("chosen_logits", "ref_chosen_logits")  # [B, T, V]: a distillation stage's token distributions


@dataclass
class PreferenceSettings:
    """Everything a ``postrl dpo`` run is made of (recorded in ``RUN/dpo.json``; a resume reads it back).

    Defaults in brackets: loss ['sigmoid'] and its parameters loss_params [{}] (``beta`` among them; see
    ``postrl methods --kind preference``), ref [None: a frozen copy of ``model``], precompute_ref [False],
    epochs [1], lr [1e-6, TRL DPOConfig], batch_size [8] pairs per optimizer step, micro_batch_size [None: the
    batch] pairs per forward, max_length [1024] tokens per sequence, schedule ['linear', TRL], warmup_ratio [0.0],
    weight_decay [0.0], max_grad_norm [1.0], dtype ['float32' | 'bfloat16'], gradient_checkpointing [False],
    lora_r [None: every weight trains], lora_alpha [16], lora_dropout [0.0], lora_save ['both'],
    chat_template ['auto'], seed [0], save_every [0: at the end only] optimizer steps, keep_last [2],
    eval_every [0: before and after only], accel ['auto' | 'off'], device ['auto': CUDA when available].
    ``data`` / ``eval_data`` / ``eval_fraction`` say where the pairs came from (the command reads them)."""

    model: str
    data: str = ""
    loss: str = "sigmoid"
    loss_params: dict = field(default_factory=dict)
    ref: str | None = None
    precompute_ref: bool = False
    epochs: int = 1
    lr: float = 1e-6
    batch_size: int = 8
    micro_batch_size: int | None = None
    max_length: int | None = 1024
    schedule: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora_r: int | None = None
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_save: str = "both"
    chat_template: str = "auto"
    seed: int = 0
    save_every: int = 0
    keep_last: int | None = 2
    eval_every: int = 0
    eval_data: str | None = None
    eval_fraction: float = 0.1
    accel: str = "auto"
    device: str = "auto"

    def check(self) -> None:
        for name, low in (("epochs", 1), ("batch_size", 1), ("micro_batch_size", 1), ("max_length", 2),
                          ("save_every", 0), ("eval_every", 0), ("keep_last", 1)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ConfigError(f"--{name.replace('_', '-')}: expected an integer >= {low}, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ConfigError(f"--lr: expected a value > 0, got {self.lr!r}")

    def run_config(self):
        """The postrl :class:`~postrl.config.Config` sections this run shares with ``postrl train`` (model, LoRA,
        optimizer, gradient checkpointing, speed layer), validated as ``postrl train`` validates them."""
        lora = {"r": self.lora_r, "alpha": self.lora_alpha, "dropout": self.lora_dropout, "save": self.lora_save}
        return load_config(None, [], base={
            "seed": self.seed,
            "model": {"path": self.model, "dtype": self.dtype, "chat_template": self.chat_template, "lora": lora},
            "optim": {"lr": float(self.lr), "weight_decay": float(self.weight_decay), "schedule": self.schedule,
                      "warmup_ratio": float(self.warmup_ratio) if self.warmup_ratio else None,
                      "max_grad_norm": None if self.max_grad_norm is None else float(self.max_grad_norm)},
            "train": {"gradient_checkpointing": self.gradient_checkpointing, "keep_last": self.keep_last or 1},
            "accel": {"mode": self.accel}})

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, where: str) -> "PreferenceSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown or "model" not in data:
            why = f"unknown key {unknown[0]}" if unknown else "no model"
            raise PostrlError(f"{where}: not a postrl dpo settings file ({why})")
        return cls(**data)


def build_loss(name: str, params: dict) -> stages.Stage:
    """The configured preference stage (``postrl.stages.build``: parameters checked by their annotations, errors
    name ``loss.<key>``)."""
    return stages.build("preference", name, params, where="loss")


# ---------------------------------------------------------------------------------------------- encoding


@dataclass
class EncodedPairs:
    """Token ids of the pairs a run trains or evaluates on (prompt, chosen + EOS, rejected + EOS), the pairs'
    ``margin`` column, the pairs themselves (for their texts), and the prompt the reference reads (``ref_prompt``:
    the pair's ``ref_prompt`` column, else its prompt)."""

    prompt: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: torch.Tensor
    pairs: list[PreferencePair]
    ref_prompt: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt)

    @property
    def has_ref_prompt(self) -> bool:
        """Some pair's reference reads another prompt than the policy (context distillation)."""
        return any(p.ref_prompt is not None for p in self.pairs)


def encode_pairs(tokenizer, pairs: Sequence[PreferencePair], *, chat_template: str = "auto",
                 max_length: int | None = 1024) -> tuple[EncodedPairs, int]:
    """(the encoded pairs, how many were left out because the prompt alone fills ``max_length``)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the policy's tokenizer has no EOS token; postrl dpo ends every completion with it")
    cache: dict[str, list[int]] = {}

    def prompt_ids(text: str) -> list[int]:
        if text not in cache:
            cache[text] = encode_prompt(tokenizer, text, chat_template)
        return cache[text]

    def completions(texts: list[str], final: list[bool]) -> list[list[int]]:
        nonempty = [t for t in texts if t]
        toks = iter(tokenizer(nonempty, add_special_tokens=False)["input_ids"] if nonempty else [])
        out = []
        for t, end in zip(texts, final):
            ids = list(next(toks)) if t else []
            out.append(ids if not end or (ids and ids[-1] == eos) else ids + [eos])
        return out

    def state_ids(p: PreferencePair, prompt: str) -> list[int]:
        q = prompt_ids(prompt)
        return q + list(tokenizer(p.prefix, add_special_tokens=False)["input_ids"]) if p.prefix else q

    chosen = completions([p.chosen for p in pairs], [p.chosen_final for p in pairs])
    rejected = completions([p.rejected for p in pairs], [p.rejected_final for p in pairs])
    enc = EncodedPairs([], [], [], torch.zeros(0), [])
    margins, dropped = [], 0
    for p, c, r in zip(pairs, chosen, rejected):
        q = state_ids(p, p.prompt)
        q_ref = q if p.ref_prompt is None else state_ids(p, p.ref_prompt)
        if max_length is not None:
            longest = max(len(q), len(q_ref))
            if longest >= max_length:
                dropped += 1
                continue
            c, r = c[:max_length - longest], r[:max_length - longest]
        enc.ref_prompt.append(q_ref)
        enc.prompt.append(q)
        enc.chosen.append(c)
        enc.rejected.append(r)
        enc.pairs.append(p)
        margins.append(p.margin)
    enc.margin = torch.tensor(margins, dtype=torch.float32)
    return enc, dropped


def pair_batch(enc: EncodedPairs, idx: Sequence[int], pad_id: int, ref: bool = False) -> RolloutBatch:
    """The 2m rows [chosen of the m pairs, rejected of the m pairs] as a :class:`RolloutBatch` (prompts
    left-padded, completions right-padded; ``group_ids``: the pair's position, shared by its two rows); ``ref``:
    under the prompts the reference reads (``EncodedPairs.ref_prompt``)."""
    idx = list(idx)
    comps = [enc.chosen[i] for i in idx] + [enc.rejected[i] for i in idx]
    prompts = enc.ref_prompt if ref and enc.ref_prompt else enc.prompt
    prompt_ids, prompt_mask = left_pad([prompts[i] for i in idx] * 2, pad_id)
    width = max(len(c) for c in comps)
    cids = torch.full((len(comps), width), int(pad_id), dtype=torch.long)
    cmask = torch.zeros((len(comps), width))
    for j, c in enumerate(comps):
        cids[j, :len(c)] = torch.tensor(c, dtype=torch.long)
        cmask[j, :len(c)] = 1.0
    pairs = [enc.pairs[i] for i in idx]
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=cids, completion_mask=cmask,
                        group_ids=torch.arange(len(idx)).repeat(2), sampler_logprobs=torch.zeros(cids.shape),
                        truncated=torch.zeros(len(comps), dtype=torch.bool), prompts=[p.prompt for p in pairs] * 2,
                        completions=[p.chosen for p in pairs] + [p.rejected for p in pairs],
                        columns={"margin": [p.margin for p in pairs] * 2})


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t m_t logp_t, sum_t m_t) per row: a completion's log-probability and token count."""
    mask = mask.to(logp.device, logp.dtype)
    return (logp * mask).sum(-1), mask.sum(-1)


def batch_stats(fields_: dict, info: dict) -> dict[str, torch.Tensor]:
    """The per-pair quantities TRL averages into its logged metrics (detached)."""
    c, r = info["chosen_rewards"].float(), info["rejected_rewards"].float()
    return {"rewards/chosen": c, "rewards/rejected": r, "rewards/accuracies": (c > r).float(),
            "rewards/margins": c - r, "logps/chosen": fields_["chosen_logps"].detach().float(),
            "logps/rejected": fields_["rejected_logps"].detach().float(),
            "preference_accuracy": (fields_["chosen_logps"] > fields_["rejected_logps"]).float().detach()}


# ---------------------------------------------------------------------------------------------- the driver


class PreferenceTrainer:
    """Trains a policy on preference pairs with one ``preference`` stage (see the module docstring).

    ``train`` / ``held``: the pairs to train and evaluate on (already read and checked); ``run_dir``: the run
    directory; ``resume``: continue from its newest usable checkpoint (the settings are those of ``dpo.json``)."""

    def __init__(self, settings: PreferenceSettings, train: Sequence[PreferencePair], held: Sequence[PreferencePair],
                 run_dir: str | Path, *, resume: bool = False, log: Callable[[str], None] = print):
        settings.check()
        self.s, self.run_dir, self.log = settings, Path(run_dir), log
        self.stage = build_loss(settings.loss, settings.loss_params)
        self.needs_ref = bool(set(REF_FIELDS) & set(self.stage.reads))
        self.logit_fields = set(LOGIT_FIELDS) & set(self.stage.reads)
        if settings.precompute_ref and "ref_chosen_logits" in self.logit_fields:
            raise ConfigError(f"--precompute-ref: loss '{settings.loss}' reads the reference's token distributions "
                              f"(ref_chosen_logits), which are not stored; drop --precompute-ref")
        if settings.ref is not None and not self.needs_ref:
            raise ConfigError(f"--ref: loss '{settings.loss}' is reference-free (it reads no reference log-probs); "
                              f"drop --ref")
        self.reads_advantage = bool({"chosen_advantage", "rejected_advantage"} & set(self.stage.reads))
        if self.reads_advantage:
            for pairs_, what in ((train, settings.data or "DATA"), (held, settings.eval_data or "the held-out pairs")):
                bad = next((p for p in pairs_ if p.chosen_advantage is None or p.rejected_advantage is None), None)
                if bad is not None:
                    raise DataError(f"{what}: row {bad.row}: loss '{settings.loss}' reads each completion's advantage "
                                    f"(chosen_advantage, rejected_advantage: postrl pairs --dapo writes them)")
        if "margin" in self.stage.reads and train and not any(p.margin for p in train):
            raise DataError(f"{settings.data or 'DATA'}: loss '{settings.loss}' reads each pair's 'margin' (the reward "
                            f"gap r(chosen) - r(rejected)), and every row's margin is 0 or absent")
        self.cfg = cfg = settings.run_config()
        if cfg.model.dtype == "float16":
            raise ConfigError("--dtype float16 needs loss scaling, which postrl does not do; use bfloat16")
        self.mixed = cfg.model.dtype == "bfloat16"
        dev = settings.device
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if dev == "auto" else dev)
        self._lock = run_state.RunLock(self.run_dir)  # before anything is written into the folder
        # what changes what the run does: stderr, and RUN/notices.jsonl (postrl doctor lists them)
        self.notice = run_state.Notices(self.run_dir)
        try:
            model, self.tokenizer, self.model_path = load_policy(cfg, self.device, log)
            self.policy = model.to(self.device)
            acfg = cfg.accel.model_copy(update={"matmul": "torch"}) if self.mixed else cfg.accel
            self.accel = accel.prepare(self.policy, acfg, self.device)
            self.accel.fused = self.accel.fused and not self.mixed
            pad = self.tokenizer.pad_token_id
            self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
            self.train_pairs, dropped = encode_pairs(self.tokenizer, train, chat_template=cfg.model.chat_template,
                                                     max_length=settings.max_length)
            self.held_pairs, dropped_held = encode_pairs(self.tokenizer, held, chat_template=cfg.model.chat_template,
                                                         max_length=settings.max_length)
            if len(self.train_pairs) == 0:
                why = f" (every prompt fills --max-length {settings.max_length})" if dropped else ""
                raise DataError(f"{settings.data or 'DATA'}: no pair to train on{why}")
            if (self.train_pairs.has_ref_prompt or self.held_pairs.has_ref_prompt) and not self.needs_ref:
                self.notice(f"the pairs' ref_prompt column is not used: loss '{settings.loss}' reads no reference "
                            f"model", kind="warning")
            if dropped or dropped_held:
                self.notice(f"{dropped + dropped_held} pairs left out ({dropped} of training, {dropped_held} held "
                            f"out): the prompt alone fills --max-length {settings.max_length}", kind="warning")
            self.micro = settings.micro_batch_size or settings.batch_size
            self.ctx = ModelContext(self.policy, self.tokenizer, self.device, temperature=1.0,
                                    micro_batch_size=2 * self.micro, chat_template=cfg.model.chat_template,
                                    pad_id=self.pad_id, logprob_fn=self.accel.logprobs, autocast=self.mixed)
            # the reference
            self.ref_model = None
            if self.needs_ref:
                if settings.ref is not None:
                    self.ref_model = self._load_ref(settings.ref)
                else:
                    self.ref_model = reference_model(cfg, self.policy, self.model_path, self.device, self.accel)
            # optimisation
            torch.manual_seed(settings.seed)
            self.steps_per_epoch = math.ceil(len(self.train_pairs) / settings.batch_size)
            self.total = settings.epochs * self.steps_per_epoch
            self.optimizer = make_optimizer(self.policy, cfg.optim)
            self.scheduler = make_scheduler(self.optimizer, cfg.optim.warmup_for(self.total), self.total,
                                            cfg.optim.schedule)
            self.params = [p for p in self.policy.parameters() if p.requires_grad]
            self.start_step = 0
            self.eval_before: dict | None = None
            self.finished: dict | None = None
            if resume:
                self._resume()
            else:
                self._open()
            self.notice.start(new=not resume)
            self.ref_train = self.ref_held = None
            if self.needs_ref and settings.precompute_ref and self.finished is None:
                self.ref_train = self._ref_all(self.train_pairs)
                self.ref_held = self._ref_all(self.held_pairs)
                self.ref_model = None  # (a separate reference is no longer needed; with LoRA there was none)
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------------------------------------ set-up
    def _load_ref(self, path: str):
        """The model at ``--ref``, frozen, after checking that it reads the policy's tokens
        (:func:`postrl.train.policy.frozen_model`)."""
        return frozen_model(path, self.tokenizer, self.device, self.accel, what="--ref",
                            policy_name=f"the policy {self.s.model}")

    def _open(self) -> None:
        """A new run: the settings, empty logs, no checkpoint or summary of an earlier run in the folder."""
        if (self.run_dir / ckpt.CHECKPOINTS_DIR).is_dir() and any((self.run_dir / ckpt.CHECKPOINTS_DIR).iterdir()):
            raise PostrlError(f"--out {self.run_dir}: holds checkpoints of an earlier run; continue it with "
                              f"postrl dpo --resume {self.run_dir}, or choose another --out")
        run_state.write_json_atomic(self.run_dir / SETTINGS_FILE, self.s.to_json())
        for name in ("metrics.jsonl", "eval.jsonl"):
            (self.run_dir / name).write_text("")
        (self.run_dir / "summary.json").unlink(missing_ok=True)

    def _resume(self) -> None:
        last, skipped = ckpt.resumable_checkpoint(self.run_dir)
        if last is None:
            if skipped:
                raise PostrlError(f"--resume {self.run_dir}: no usable checkpoint: " + "; ".join(
                    f"{p.name}/{problem}" for p, problem in skipped))
            raise PostrlError(f"--resume {self.run_dir}: no complete checkpoint in "
                              f"{self.run_dir / ckpt.CHECKPOINTS_DIR}")
        for path, problem in skipped:
            moved = ckpt.quarantine_checkpoint(path)
            self.notice(f"checkpoint {path} is unusable ({problem}): moved to {moved.name}; resuming from "
                        f"{last.name}")
        state = ckpt.load_checkpoint(last, self.policy, self.optimizer, self.scheduler)
        self.start_step = int(state["step"])
        self.eval_before = state.get("eval_before")
        if self.start_step >= self.total:
            try:
                summary = json.loads((self.run_dir / "summary.json").read_text())
                self.finished = summary if summary.get("steps") == self.total else None
            except (OSError, ValueError):
                self.finished = None
        if self.finished is None:
            for name in ("metrics.jsonl", "eval.jsonl"):
                run_state.truncate_jsonl(self.run_dir / name, self.start_step)
        self.notice(f"resuming {self.run_dir} from {last.name} (step {self.start_step} of {self.total})",
                    step=self.start_step)

    # ------------------------------------------------------------------------------------------------ log-probs
    def _ref_logps(self, batch: RolloutBatch) -> torch.Tensor:
        """Summed reference log-probs [2m] of a pair batch (no gradient): the reference model's, or with LoRA the
        policy's with its adapter disabled (the base weights, which LoRA never changes)."""
        if self.ref_model is not None:
            logp = self.ctx.logprobs(batch, model=self.ref_model)[0]
        else:
            with self.policy.disable_adapter():
                logp = self.ctx.logprobs(batch)[0]
        return sequence_logps(logp, batch.completion_mask)[0]

    @torch.no_grad()
    def _ref_with_logits(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed reference log-probs [2m], the reference's logits over the chosen rows' tokens [m, T, V]), one
        forward (no gradient)."""
        rows = torch.arange(len(batch))
        if self.ref_model is not None:
            logp, _, logits = self.ctx.token_logprobs(batch, rows, model=self.ref_model, with_logits=True)
        else:
            with self.policy.disable_adapter():
                logp, _, logits = self.ctx.token_logprobs(batch, rows, with_logits=True)
        return sequence_logps(logp.float(), batch.completion_mask)[0], logits[:len(batch) // 2].float()

    def _ref_all(self, enc: EncodedPairs) -> torch.Tensor:
        """[n, 2] reference log-probs (chosen, rejected) of every pair, once (``precompute_ref``)."""
        out = torch.zeros(len(enc), 2)
        for s in range(0, len(enc), self.micro):
            idx = list(range(s, min(s + self.micro, len(enc))))
            lp = self._ref_logps(pair_batch(enc, idx, self.pad_id, ref=True))
            out[idx, 0], out[idx, 1] = lp[:len(idx)], lp[len(idx):]
        return out

    def pair_fields(self, enc: EncodedPairs, idx: list[int], precomputed: torch.Tensor | None,
                    grad: bool) -> dict[str, torch.Tensor]:
        """The stage's fields for pairs ``idx`` of ``enc`` (policy log-probs differentiable when ``grad``)."""
        n = len(idx)
        batch = pair_batch(enc, idx, self.pad_id)
        rows = torch.arange(2 * n)
        want_logits = "chosen_logits" in self.logit_fields
        with torch.set_grad_enabled(grad):
            logp, _, logits = self.ctx.token_logprobs(batch, rows, with_logits=want_logits)
        seq, lens = sequence_logps(logp.float(), batch.completion_mask)
        out = {"chosen_logps": seq[:n], "rejected_logps": seq[n:], "chosen_lengths": lens[:n],
               "rejected_lengths": lens[n:], "margin": enc.margin[idx].to(seq.device),
               "chosen_mask": batch.completion_mask[:n].to(seq.device)}
        if self.reads_advantage:
            adv = [(enc.pairs[i].chosen_advantage, enc.pairs[i].rejected_advantage) for i in idx]
            out["chosen_advantage"] = torch.tensor([a for a, _ in adv], dtype=torch.float32, device=seq.device)
            out["rejected_advantage"] = torch.tensor([b for _, b in adv], dtype=torch.float32, device=seq.device)
        if want_logits:
            out["chosen_logits"] = logits[:n].float()
        if self.needs_ref:
            rbatch = pair_batch(enc, idx, self.pad_id, ref=True) if enc.has_ref_prompt else batch
            if "ref_chosen_logits" in self.logit_fields:
                ref, out["ref_chosen_logits"] = self._ref_with_logits(rbatch)
                out["ref_chosen_logits"] = out["ref_chosen_logits"].to(seq.device)
            else:
                ref = precomputed[idx].T.reshape(-1) if precomputed is not None else self._ref_logps(rbatch)
            ref = ref.to(seq.device)
            out["ref_chosen_logps"], out["ref_rejected_logps"] = ref[:n], ref[n:]
        return out

    # ------------------------------------------------------------------------------------------------ steps
    def order(self, epoch: int) -> list[int]:
        """The pair order of ``epoch``: a permutation seeded by (seed, epoch)."""
        g = torch.Generator().manual_seed(derive_seed(self.s.seed, epoch, "dpo-order"))
        return torch.randperm(len(self.train_pairs), generator=g).tolist()

    def batch_of(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        b = self.s.batch_size
        return self.order(epoch)[k * b:(k + 1) * b]

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        idx = self.batch_of(step)
        self.policy.train()
        sums: dict[str, float] = {}
        loss_total = 0.0
        tokens = 0
        for s in range(0, len(idx), self.micro):
            part = idx[s:s + self.micro]
            rows = 2 * len(part)
            with self.accel.use("update", rows=rows, work=rows):
                f = self.pair_fields(self.train_pairs, part, self.ref_train, grad=True)
                loss_vec, info = self.stage(f)
                loss = loss_vec.sum() / len(idx)
                loss.backward()
            loss_total += float(loss.detach())
            tokens += int(f["chosen_lengths"].sum() + f["rejected_lengths"].sum())
            for k, v in batch_stats(f, info).items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        gn = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        skipped = not math.isfinite(gn)
        if not skipped:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        m = {"step": step + 1, "epoch": (step + 1) / self.steps_per_epoch, "loss": loss_total}
        m.update({k: v / len(idx) for k, v in sums.items() if k != "preference_accuracy"})
        m.update({"grad_norm": gn, "learning_rate": lr, "completion_tokens": tokens,
                  "time/step": time.perf_counter() - t0})
        if skipped:
            m["skipped_step"] = 1
        return m

    @torch.no_grad()
    def evaluate(self, enc: EncodedPairs, precomputed: torch.Tensor | None) -> dict:
        """TRL's ``eval_`` metrics of the policy on held-out pairs, plus ``eval_preference_accuracy``."""
        self.policy.eval()
        sums: dict[str, float] = {}
        loss = 0.0
        for s in range(0, len(enc), self.micro):
            part = list(range(s, min(s + self.micro, len(enc))))
            f = self.pair_fields(enc, part, precomputed, grad=False)
            loss_vec, info = self.stage(f)
            loss += float(loss_vec.sum())
            for k, v in batch_stats(f, info).items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
        n = max(len(enc), 1)
        return {"eval_loss": loss / n, **{f"eval_{k}": v / n for k, v in sums.items()}, "eval_pairs": len(enc)}

    def _eval(self, tag: str, step: int) -> dict | None:
        if len(self.held_pairs) == 0:
            return None
        res = {"step": step, "tag": tag, **self.evaluate(self.held_pairs, self.ref_held)}
        with open(self.run_dir / "eval.jsonl", "a") as fh:
            fh.write(json.dumps(res) + "\n")
        return res

    def save(self, step: int) -> None:
        ckpt.save_checkpoint(self.run_dir, step, self.policy, self.tokenizer, self.optimizer, self.scheduler,
                             {"seed": self.s.seed, "eval_before": self.eval_before, "loss": self.s.loss},
                             keep_last=self.s.keep_last)

    def train(self) -> dict:
        """Run the optimizer steps from ``start_step``, evaluate, checkpoint, write ``final/`` and summary.json;
        SIGTERM / Ctrl-C stop at the end of the current step with a checkpoint (``run_state.StopSignals``)."""
        if self.finished is not None:
            self.log(f"{self.run_dir}: the run already finished at step {self.total}: nothing to do")
            self._lock.release()
            return self.finished
        s = self.s
        done = self.start_step
        stop = run_state.StopSignals()
        every = max(1, self.total // 10)
        try:
            with stop:
                run_state.clear_status(self.run_dir)
                if self.eval_before is None:
                    self.eval_before = self._eval("before", 0)
                saved = self.start_step
                for step in range(self.start_step, self.total):
                    m = self.train_step(step)
                    with open(self.run_dir / "metrics.jsonl", "a") as fh:
                        fh.write(json.dumps(m) + "\n")
                    done = step + 1
                    if done % every == 0 or done == 1:
                        self.log(f"step {done}/{self.total}  loss {m['loss']:.4f}  rewards/accuracies "
                                 f"{m['rewards/accuracies']:.3f}  rewards/margins {m['rewards/margins']:.4f}")
                    if s.eval_every and done % s.eval_every == 0 and done < self.total:
                        self._eval("periodic", done)
                    if s.save_every and done % s.save_every == 0 and done < self.total:
                        self.save(done)
                        saved = done
                    if stop.signum:
                        if saved != done:
                            self.save(done)
                        raise stop.stop(self.run_dir, done, stop.signum, True,
                                        resume=f"postrl dpo --resume {self.run_dir}")
                after = self._eval("after", self.total)
                if saved != self.total:
                    self.save(self.total)
                final = ckpt.save_final_model(self.run_dir, self.policy, self.tokenizer, self.cfg.model.lora.save)
                summary = {"steps": self.total, "epochs": s.epochs, "pairs": len(self.train_pairs),
                           "held_out": len(self.held_pairs), "loss": s.loss, "before": self.eval_before,
                           "after": after, "final_model": str(final), "run_dir": str(self.run_dir)}
                run_state.write_json_atomic(self.run_dir / "summary.json", summary)
        except BaseException as exc:
            if run_state.read_status(self.run_dir) is None:
                run_state.record_end(self.run_dir, done, exc, stop)
            raise
        finally:
            self._lock.release()
        return summary


# ---------------------------------------------------------------------------------------------- pairs from a policy


def best_worst_pairs(batch: RolloutBatch) -> list[dict]:
    """Per group of a scored batch: the completion with the highest scalar reward as ``chosen``, the lowest as
    ``rejected`` (the first of equals), ``margin`` their reward gap; a group whose best and worst tie (or have the
    same text), or with fewer than two valid completions, gives no pair."""
    out = []
    reward = batch.reward
    valid = batch.valid if batch.valid is not None else torch.isfinite(reward)
    for g in batch.group_order():
        rows = [i for i in torch.nonzero(batch.group_ids == g).flatten().tolist()
                if bool(valid[i]) and math.isfinite(float(reward[i]))]
        if len(rows) < 2:
            continue
        best = max(rows, key=lambda i: float(reward[i]))
        worst = min(rows, key=lambda i: float(reward[i]))
        if float(reward[best]) == float(reward[worst]) or batch.completions[best] == batch.completions[worst]:
            continue
        out.append({"prompt": batch.prompts[best], "chosen": batch.completions[best],
                    "rejected": batch.completions[worst], "margin": float(reward[best]) - float(reward[worst]),
                    "chosen_reward": float(reward[best]), "rejected_reward": float(reward[worst])})
    return out


def _policy_batches(cfg, prompts: int, log: Callable[[str], None]):
    """(generation backend, the step, batch source, rounds, tokenizer) for sampling ``prompts`` prompts of the
    config's task from ``model.path``, G = ``rollout.group_size`` completions each, scored by the config's rewards
    and shaping (through the step's :class:`~postrl.step.sampling.BatchSource`)."""
    if cfg.rollout.group_size < 2:
        raise ConfigError("rollout.group_size: a pair needs at least 2 completions per prompt, got "
                          f"{cfg.rollout.group_size}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok, _ = load_policy(cfg, device, log)
    model.to(device).eval()
    acc = accel.prepare(model, cfg.accel, device)
    backend = acc.generator(model, tok, batch_size=cfg.rollout.batch_size)
    step = Step(cfg, context=RewardContext(model=model, tokenizer=tok, device=device,
                                           chat_template=cfg.model.chat_template), tokenizer=tok, log=log)
    r = cfg.rollout
    ctx = ModelContext(model, tok, device, temperature=r.temperature or 1.0,
                       micro_batch_size=cfg.train.micro_batch_size, chat_template=cfg.model.chat_template,
                       sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                               top_p=r.top_p, top_k=r.top_k, stop=list(r.stop),
                                               ignore_eos=r.ignore_eos, logprobs=r.logprobs),
                       generate=backend.generate, pad_id=backend.pad_id,
                       score=lambda b: step.score(b, observe=False), logprob_fn=acc.logprobs)
    per_round = min(cfg.train.prompts_per_step, prompts)
    source = BatchSource(step, load_source(cfg.task.model_dump()), ctx, seed=cfg.seed, prompts_per_step=per_round,
                         rollout=r, chat_template=cfg.model.chat_template, environment=cfg.environment, log=log)
    return backend, step, source, math.ceil(prompts / per_round), per_round, tok


def generate_pairs(cfg, prompts: int, *, log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """(pair rows, counts): ``prompts`` prompts of the config's task (``train.prompts_per_step`` per round), G =
    ``rollout.group_size`` completions each sampled from ``model.path``, scored by the config's rewards and
    shaping (a ``self_judge`` reward: the same policy as the judge), then :func:`best_worst_pairs`."""
    backend, _, source, rounds, per_round, _ = _policy_batches(cfg, prompts, log)
    r = cfg.rollout
    rows, failures = [], 0
    try:
        for i in range(rounds):
            with torch.no_grad():
                batch, info = source.next_batch(i, rounds)
            failures += sum(info["failures"].values())
            rows.extend(best_worst_pairs(batch))
    finally:
        backend.close()
    return rows, {"prompts": rounds * per_round, "completions": rounds * per_round * r.group_size,
                  "pairs": len(rows), "reward_failures": failures}


# ---------------------------------------------------------------------------------------------- SSB's teacher data

SSB_TEMPLATE = ("{prompt}\n\nTwo attempts at this problem follow. This attempt is correct:\n{correct}\n\nThis "
                "attempt is wrong:\n{incorrect}\n\nWrite one careful step-by-step solution that reaches the correct "
                "answer and avoids the mistake of the wrong attempt.")


def _answer_of(text: str) -> str:
    """The key incorrect rollouts are grouped by: their extracted answer as ``majority_vote`` compares answers
    (numbers by value), else the whole normalised text."""
    return _answer_key(extract_answer(text, "auto")) or f"text:{normalize_text(text)}"


def ssb_candidates(batch: RolloutBatch, verifier: str, threshold: float = 1.0) -> list[dict]:
    """Per group of a scored batch: the first correct completion (the verifier's raw value >= ``threshold``) and a
    representative of the most common wrong answer among the incorrect ones (its first completion; ties: the
    answer seen first), or nothing when the group lacks either. Rows: index, prompt, correct, incorrect."""
    names = list(batch.extra.get("raw_reward_names") or batch.reward_names)
    if verifier not in names:
        raise ConfigError(f"--verifier {verifier}: not a reward of the config (rewards: {', '.join(names)}); SSB "
                          f"labels rollouts correct or incorrect with it")
    label = batch.raw_rewards[:, names.index(verifier)]
    out = []
    for g in batch.group_order():
        rows = torch.nonzero(batch.group_ids == g).flatten().tolist()
        good = [i for i in rows if math.isfinite(float(label[i])) and float(label[i]) >= threshold]
        bad = [i for i in rows if math.isfinite(float(label[i])) and float(label[i]) < threshold]
        if not good or not bad:
            continue
        keys = {i: _answer_of(batch.completions[i]) for i in bad}
        count: dict[str, int] = {}
        for i in bad:
            count[keys[i]] = count.get(keys[i], 0) + 1
        top = max(count.values())
        wrong = next(i for i in bad if count[keys[i]] == top)
        out.append({"index": good[0], "prompt": batch.prompts[good[0]], "correct": batch.completions[good[0]],
                    "incorrect": batch.completions[wrong]})
    return out


def generate_ssb(cfg, prompts: int, *, verifier: str = "correct", threshold: float = 1.0,
                 teacher_temperature: float = 0.0, log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """(SSB rows, counts): Semantic Soft Bootstrapping's teacher data from the policy's own rollouts.

    ``prompts`` prompts of the config's task, G = ``rollout.group_size`` rollouts each from ``model.path``, scored
    by the config's rewards; per prompt with a correct and an incorrect rollout (the reward ``verifier``, before
    shaping, >= / < ``threshold``; :func:`ssb_candidates`), the same model is prompted with
    ``SSB_TEMPLATE`` (the problem, the correct rollout and the most common wrong answer's rollout) and writes a
    solution (greedy with ``teacher_temperature`` 0, ``rollout.max_new_tokens``); the solution is kept when the
    verifier scores it correct for the bare problem. Rows: ``prompt`` (the bare problem), ``chosen`` (the
    teacher's verified solution), ``rejected`` (the wrong rollout), ``ref_prompt`` (the hinted prompt the teacher
    read), ``correct`` (the correct rollout) and the prompt's columns. ``postrl dpo ROWS --loss ssb`` then
    distils the teacher's token distributions (the reference reading ``ref_prompt``) into the student reading the
    bare problem. Counts: prompts, completions, with_both (prompts with a correct and an incorrect rollout),
    teacher_verified, rows."""
    backend, step, source, rounds, per_round, tok = _policy_batches(cfg, prompts, log)
    stage = next((st for st in step.scorer.rewards if st.name == verifier), None)
    if stage is None:
        names = [st.name for st in step.scorer.rewards]
        raise ConfigError(f"--verifier {verifier}: not a reward of the config (rewards: {', '.join(names)}); SSB "
                          f"labels rollouts correct or incorrect with it")
    spec = next(sp for sp in step.scorer.specs if sp.name == verifier)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=teacher_temperature,
                            stop=list(cfg.rollout.stop))
    rows: list[dict] = []
    with_both = verified = 0
    try:
        for i in range(rounds):
            with torch.no_grad():
                batch, _ = source.next_batch(i, rounds)
            cands = ssb_candidates(batch, verifier, threshold)
            with_both += len(cands)
            if not cands:
                continue
            hinted = [SSB_TEMPLATE.format(prompt=c["prompt"], correct=c["correct"], incorrect=c["incorrect"])
                      for c in cands]
            ids = [encode_prompt(tok, h, cfg.model.chat_template) for h in hinted]
            gen = backend.generate(ids, 1, params, seed=[derive_seed(cfg.seed, "ssb", i, j) for j in range(len(ids))])
            columns = {k: [v[c["index"]] for c in cands] for k, v in batch.columns.items()}
            columns["group_ids"] = list(range(len(cands)))
            out = score_batch([c["prompt"] for c in cands], gen.texts, columns, [spec],
                              built=[(stage.fn, stage.params)], context=step.scorer.context)
            for c, h, reply, v in zip(cands, hinted, gen.texts, out.matrix[:, 0].tolist()):
                if not (math.isfinite(v) and v >= threshold) or reply == c["incorrect"]:
                    continue
                verified += 1
                extra = {k: batch.columns[k][c["index"]] for k in batch.columns
                         if k not in ("prompt", "chosen", "rejected", "ref_prompt", "correct")}
                rows.append({**extra, "prompt": c["prompt"], "chosen": reply, "rejected": c["incorrect"],
                             "ref_prompt": h, "correct": c["correct"]})
    finally:
        backend.close()
    return rows, {"prompts": rounds * per_round, "completions": rounds * per_round * cfg.rollout.group_size,
                  "with_both": with_both, "teacher_verified": verified, "rows": len(rows)}


# ---------------------------------------------------------------------------------------------- DAPO's step-level data


def _last_score(row: torch.Tensor) -> float:
    vals = [v for v in row.tolist() if v == v]
    return vals[-1] if vals else math.nan


def generate_dapo(cfg, prompts: int, prm_path: str, *, verifier: str | None = None, max_states: int = 4,
                  log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """(step-level pair rows, counts): Direct Advantage Policy Optimization's offline data from ``model.path`` (the
    reference policy) and a PRM critic.

    ``prompts`` prompts of the config's task, ``rollout.group_size`` trajectories each (the reference's); the states
    s of a prompt are the step prefixes of its trajectories (the response cut before each step, steps at the PRM's
    ``delimiter``; the first ``max_states`` distinct ones, the empty prefix first). At each state the reference
    samples two next steps (``rollout.temperature``, ``rollout.max_new_tokens``, stopping at the delimiter, which
    the step keeps; a step that ends with EOS ends the response: ``*_final``); a state where a step runs out of
    tokens is skipped. The critic V (the PRM at ``prm_path``): V(s) = its score at the end of the prefix (before any
    step: its prompt score), V(s + a) = its score at the end of a, or, when a ends the response and ``verifier``
    names a reward of the config, that reward's outcome (the true terminal value); A(s, a) = V(s + a) - V(s). Rows:
    ``prompt``, ``prefix``, ``chosen`` / ``rejected`` (the step with the larger / smaller A), ``chosen_advantage``,
    ``rejected_advantage``, ``chosen_final``, ``rejected_final``, ``value`` (V(s)), and the prompt's columns;
    ``postrl dpo ROWS --loss dapo_step`` trains on them. Counts: prompts, states, skipped (a step out of tokens or
    two equal steps), rows."""
    prm = load_reward_model(prm_path)
    if getattr(prm, "kind", None) != "prm":
        raise ConfigError(f"--dapo {prm_path}: the critic must be a process reward model (postrl prm train), got "
                          f"kind '{getattr(prm, 'kind', type(prm).__name__)}'")
    backend, step, source, rounds, per_round, tok = _policy_batches(cfg, prompts, log)
    stage = spec = None
    if verifier is not None:
        stage = next((st for st in step.scorer.rewards if st.name == verifier), None)
        if stage is None:
            names = [st.name for st in step.scorer.rewards]
            raise ConfigError(f"--verifier {verifier}: not a reward of the config (rewards: {', '.join(names)})")
        spec = next(sp for sp in step.scorer.specs if sp.name == verifier)
    delim = prm.delimiter
    r = cfg.rollout
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature or 1.0, top_p=r.top_p,
                            top_k=r.top_k, stop=[delim])
    eos = set(backend.eos_ids) if hasattr(backend, "eos_ids") else {tok.eos_token_id}
    rows: list[dict] = []
    n_states = skipped = 0
    try:
        for i in range(rounds):
            with torch.no_grad():
                batch, _ = source.next_batch(i, rounds)
            states: list[tuple[int, str]] = []  # (row of the batch, prefix)
            for g in batch.group_order():
                members = torch.nonzero(batch.group_ids == g).flatten().tolist()
                seen: list[str] = []
                for m in members:
                    pieces = step_pieces(batch.completions[m], delim)
                    for k in range(len(pieces)):
                        pre = "".join(pieces[:k])
                        if pre not in seen and len(seen) < max_states:
                            seen.append(pre)
                states += [(members[0], pre) for pre in seen]
            n_states += len(states)
            if not states:
                continue
            ids = [encode_prompt(tok, batch.prompts[m], cfg.model.chat_template)
                   + list(tok(pre, add_special_tokens=False)["input_ids"]) for m, pre in states]
            gen = backend.generate(ids, 2, params, seed=[derive_seed(cfg.seed, "dapo", i, j) for j in range(len(ids))])
            lengths = gen.completion_mask.sum(-1).long().tolist()
            actions = []
            for k in range(2 * len(states)):
                L = lengths[k]
                final = L > 0 and int(gen.completion_ids[k, L - 1]) in eos
                ok = not bool(gen.truncated[k]) and L > 0
                actions.append((gen.texts[k] if final else gen.texts[k] + delim, final, ok))
            keep = [j for j in range(len(states)) if actions[2 * j][2] and actions[2 * j + 1][2]
                    and actions[2 * j][0] != actions[2 * j + 1][0]]
            skipped += len(states) - len(keep)
            if not keep:
                continue
            prompts_k = [batch.prompts[states[j][0]] for j in keep]
            prefixes = [states[j][1] for j in keep]
            # V(s): the PRM's prompt score (empty prefix) or its score at the end of the prefix
            v_s = []
            with_prefix = [j for j, pre in enumerate(prefixes) if pre]
            ps, _ = prm.prompt_scores(prompts_k)
            sc = prm.step_scores([prompts_k[j] for j in with_prefix], [prefixes[j] for j in with_prefix]) \
                if with_prefix else None
            for j in range(len(keep)):
                v_s.append(_last_score(sc[with_prefix.index(j)]) if j in with_prefix else float(ps[j]))
            # V(s + a): the PRM at the end of the step, or the verifier's outcome after a final step
            texts = [prefixes[j] + actions[2 * keep[j] + a][0] for j in range(len(keep)) for a in (0, 1)]
            sa = prm.step_scores([p for p in prompts_k for _ in (0, 1)], texts)
            v_sa = [_last_score(sa[k]) for k in range(len(texts))]
            if stage is not None:
                finals = [k for k in range(len(texts)) if actions[2 * keep[k // 2] + k % 2][1]]
                if finals:
                    cols = {c: [v[states[keep[k // 2]][0]] for k in finals] for c, v in batch.columns.items()}
                    cols["group_ids"] = list(range(len(finals)))
                    out = score_batch([prompts_k[k // 2] for k in finals], [texts[k] for k in finals], cols, [spec],
                                      built=[(stage.fn, stage.params)], context=step.scorer.context)
                    for k, v in zip(finals, out.matrix[:, 0].tolist()):
                        if math.isfinite(v):
                            v_sa[k] = v
            for j in range(len(keep)):
                (a0, f0, _), (a1, f1, _) = actions[2 * keep[j]], actions[2 * keep[j] + 1]
                A0, A1 = v_sa[2 * j] - v_s[j], v_sa[2 * j + 1] - v_s[j]
                if not (math.isfinite(A0) and math.isfinite(A1)):
                    skipped += 1
                    continue
                if A1 > A0:
                    (a0, f0, A0), (a1, f1, A1) = (a1, f1, A1), (a0, f0, A0)
                m = states[keep[j]][0]
                extra = {c: batch.columns[c][m] for c in batch.columns
                         if c not in ("prompt", "prefix", "chosen", "rejected")}
                rows.append({**extra, "prompt": prompts_k[j], "prefix": prefixes[j], "chosen": a0, "rejected": a1,
                             "chosen_advantage": A0, "rejected_advantage": A1, "chosen_final": f0,
                             "rejected_final": f1, "value": v_s[j]})
    finally:
        backend.close()
    return rows, {"prompts": rounds * per_round, "states": n_states, "skipped": skipped, "rows": len(rows)}
