"""Training outcome reward models on preference pairs: Bradley-Terry and its variants.

One loss covers every variant. For pair i (chosen c, rejected r) and head k, with r_k(.) the head's score:

    logit_ik = beta_{g(i)} * (r_k(c_i) - r_k(r_i)) - m_i
    L_rank   = mean_{i,k} BCE(logit_ik, y_i) = -mean_{i,k} [ y_i log sigmoid(logit_ik) + (1 - y_i) log sigmoid(-logit_ik) ]

* ``bradley_terry`` (default): beta = 1, m = 0, y = 1: L = -log sigmoid(r(c) - r(r)) (TRL ``RewardTrainer``
  without ``center_rewards_coefficient``; OpenRLHF ``PairWiseLoss``).
* margin (``margin=True``): m_i = the row's ``margin`` column, L = -log sigmoid(r(c) - r(r) - m) -- "Llama 2: Open
  Foundation and Fine-Tuned Chat Models" (TRL: a ``margin`` column; OpenRLHF ``--margin_loss``).
* ``bt_rationality`` (``rationality='judged'``): beta set *per comparison* from the probability p_i in [0, 1]
  that a cognitive bias shaped comparison i (the pair's ``bias`` score: precomputed in the data, or asked of an
  LLM judge by ``postrl rm train --bias-judge``, :func:`postrl.rewards.judge.bias_judge`), fixed during training:
      beta_i = beta_max - (beta_max - beta_min) p_i        (:func:`comparison_betas`; defaults 1.0 and 0.1)
  so an unbiased comparison keeps the plain Bradley-Terry rationality and a surely biased one weighs beta_min /
  beta_max of it: the gradient of -log sigmoid(beta_i d) in d is -beta_i sigmoid(-beta_i d), so at d = 0 a
  comparison pulls with beta_i / 2 (down-weighted), and a large difference d saturates its loss later.
  "Mitigating Cognitive Bias in RLHF by Altering Rationality" (arXiv 2605.06895): an LLM-as-judge assesses the
  likely presence of cognitive biases and beta is adjusted per comparison, down-weighting likely biased ones.
  Assumed where the abstract is silent: the judge returns a probability, the map from it to beta is linear
  between ``beta_max`` and ``beta_min`` (beta_min = 0 drops a surely biased comparison), betas are fixed before
  training (not learned).
* learned per-label rationality (``rationality='annotator' | 'context'``, postrl's own, not the paper's):
  beta_g = softplus(rho_g + ln(e-1)), one per annotator or context label, learned jointly with the reward (beta = 1
  at init, ``rationality_lr`` default 1e-2, no weight decay). beta and the reward scale are identifiable only
  jointly (beta * r), so compare betas across labels, not to 1 (which is why a single global beta is not offered:
  it only rescales the reward).
* ``rm_ensemble`` with K heads (``num_heads=K``): the loss above averaged over heads (heads differ by their
  initialisation; one backbone); K seeds: :func:`fit_reward_model` with ``seeds=K`` trains K separate models.
* ``odin`` (kind ``odin``): heads (length L_theta, quality Q_theta); the ranking loss uses r = Q + L and is joined by
  L_len = |rho(Q, len)| - rho(L_theta, len) (Pearson correlations over the 2B completions of the batch, len = the
  completion's token count) and L_orth = |w_Q . w_L| (the two heads' weight vectors):
  L = L_rank + length_weight * L_len + ortho_weight * L_orth (defaults 1.0, 1.0). After "ODIN: Disentangled Reward
  Mitigates Hacking in RLHF" (its ``correlation_with_length`` and ``otho_reg`` options); only Q is used downstream.
* ``data_smoothing`` (``smoothing=beta_s``): soft labels y_i start at 1; every time pair i is in a batch, after
  the update, y_i <- (1 - beta_s) y_i + beta_s * sigmoid(logit_i) (logit before the update, mean over heads).
  After "Iterative Data Smoothing: Mitigating Reward Overfitting and Overoptimization in RLHF" (IDS); assumed:
  beta_s given by the user (0.5 suggested), the model's prediction taken from the training forward pass.

Optimizer: AdamW (``lr`` default 1e-5, ``weight_decay`` 0.0, grad-norm clip 1.0), ``epochs`` passes over the pairs
in a seeded random order, ``batch_size`` pairs (2 * batch_size sequences) per step.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from postrl.errors import ConfigError, DataError
from postrl.reward_models.data import PreferencePair
from postrl.reward_models.model import RewardEnsemble, RewardModel
from postrl.reward_models.backbones import load_backbone

__all__ = ["RMTrainConfig", "bt_loss", "pearson", "odin_penalties", "train_reward_model", "fit_reward_model",
           "preference_groups", "comparison_betas"]

LEARNED = ("annotator", "context")  # one learned beta per label of this column
RATIONALITY = (None, "judged", *LEARNED)


MAX_LR = 1.0  # as the config's optim.lr: an AdamW step moves each weight by about lr


def check_margins(pairs: Sequence[PreferencePair], source: str = "preferences") -> None:
    """The margin loss (``margin=True``) needs each pair's preference strength m >= 0 (Llama 2's margin: a
    negative one asks the chosen completion to score below the rejected one); else one DataError line naming
    the row."""
    for p in pairs:
        if p.margin < 0:
            raise DataError(f"{source}: row {p.row}: field 'margin' is {p.margin:g}; the margin loss (--margin) "
                            f"needs a preference strength >= 0")


@dataclass
class RMTrainConfig:
    """Settings of :func:`train_reward_model` (defaults in brackets): epochs [1], batch_size [32] pairs, lr [1e-5],
    weight_decay [0.0], max_grad_norm [1.0], margin [False: ignore the margin column], rationality [None:
    beta = 1; 'judged': per-comparison beta from the pairs' bias scores; 'annotator' / 'context': learned per
    label], beta_max [1.0], beta_min [0.1] ('judged'), rationality_lr [1e-2] (learned), odin_length_weight [1.0],
    odin_ortho_weight [1.0], smoothing [None: hard labels], seed [0]."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    margin: bool = False
    rationality: str | None = None
    beta_max: float = 1.0
    beta_min: float = 0.1
    rationality_lr: float = 1e-2
    odin_length_weight: float = 1.0
    odin_ortho_weight: float = 1.0
    smoothing: float | None = None
    seed: int = 0

    def check(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"rm train: epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ConfigError(f"rm train: batch_size must be >= 1, got {self.batch_size}")
        if not (math.isfinite(self.lr) and 0 < self.lr <= MAX_LR):
            raise ConfigError(f"rm train: lr must be a finite number in (0, {MAX_LR:g}], got {self.lr}")
        for key, v in (("weight_decay", self.weight_decay), ("odin_length_weight", self.odin_length_weight),
                       ("odin_ortho_weight", self.odin_ortho_weight)):
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"rm train: {key} must be a finite number >= 0, got {v}")
        if not (math.isfinite(self.rationality_lr) and self.rationality_lr > 0):
            raise ConfigError(f"rm train: rationality_lr must be a finite number > 0, got {self.rationality_lr}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError(f"rm train: max_grad_norm must be a finite number > 0 or None, got {self.max_grad_norm}")
        if not 0 <= self.seed <= 2**63 - 1:
            raise ConfigError(f"rm train: seed must be in [0, 2^63 - 1], got {self.seed}")
        if self.rationality not in RATIONALITY:
            raise ConfigError(f"rm train: rationality '{self.rationality}': valid: judged, annotator, context")
        if not (math.isfinite(self.beta_max) and 0.0 <= self.beta_min <= self.beta_max and self.beta_max > 0):
            raise ConfigError(f"rm train: expected 0 <= beta_min <= beta_max and beta_max > 0, got beta_min="
                              f"{self.beta_min}, beta_max={self.beta_max}")
        if self.smoothing is not None and not 0.0 < self.smoothing <= 1.0:
            raise ConfigError(f"rm train: smoothing (IDS beta) must be in (0, 1], got {self.smoothing}")


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, *, beta: torch.Tensor | float = 1.0,
            margin: torch.Tensor | float = 0.0, target: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair Bradley-Terry loss, shapes [B] or [B, K] (beta/margin/target broadcast from [B]).

    logit = beta * (r_c - r_r) - margin; target None: -log sigmoid(logit); else the soft-label BCE
    -(y log sigmoid(logit) + (1 - y) log sigmoid(-logit)).
    """
    def col(x):
        return x[:, None] if isinstance(x, torch.Tensor) and x.dim() == 1 and r_chosen.dim() == 2 else x

    logit = col(beta) * (r_chosen - r_rejected) - col(margin)
    if target is None:
        return -F.logsigmoid(logit)
    y = col(target)
    return -(y * F.logsigmoid(logit) + (1 - y) * F.logsigmoid(-logit))


def pearson(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Pearson correlation of two [N] tensors (0 when either is constant)."""
    xc, yc = x - x.mean(), y - y.mean()
    return (xc * yc).sum() / (xc.norm() * yc.norm() + eps)


def odin_penalties(length_head: torch.Tensor, quality_head: torch.Tensor, lengths: torch.Tensor,
                   w_length: torch.Tensor, w_quality: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ODIN's (L_len, L_orth): L_len = |rho(Q, len)| - rho(L, len); L_orth = |w_Q . w_L|. Shapes [N], [N], [N]."""
    lengths = lengths.to(quality_head.dtype)
    l_len = pearson(quality_head, lengths).abs() - pearson(length_head, lengths)
    l_orth = (w_quality * w_length).sum().abs()
    return l_len, l_orth


def comparison_betas(pairs: Sequence[PreferencePair], beta_max: float = 1.0, beta_min: float = 0.1) -> torch.Tensor:
    """beta_i = beta_max - (beta_max - beta_min) p_i [P] from each pair's bias probability p_i (``bias``); a pair
    without one -> DataError naming its row."""
    out = []
    for p in pairs:
        if p.bias is None:
            raise DataError(f"preferences: row {p.row}: no bias score (needed by rationality='judged': a 'bias' "
                            f"column in [0, 1], or --bias-judge to ask a judge)")
        out.append(beta_max - (beta_max - beta_min) * float(p.bias))
    return torch.tensor(out, dtype=torch.float32)


def preference_groups(pairs: Sequence[PreferencePair], rationality: str | None) -> tuple[list[str], list[int]]:
    """(label names, label index per pair) of a learned rationality ('annotator' / 'context'); no labels for the
    others; a pair without the needed column -> DataError."""
    if rationality not in LEARNED:
        return [], [0] * len(pairs)
    names: dict[str, int] = {}
    idx = []
    for p in pairs:
        g = getattr(p, rationality)
        if g is None:
            raise DataError(f"preferences: row {p.row}: missing field '{rationality}' (needed by "
                            f"rationality='{rationality}')")
        idx.append(names.setdefault(g, len(names)))
    return list(names), idx


def train_reward_model(model: RewardModel, pairs: Sequence[PreferencePair], cfg: RMTrainConfig | None = None, *,
                       log: Callable[[str], None] | None = None) -> dict:
    """Train ``model`` in place on ``pairs`` with the loss in the module docstring; returns a summary dict
    (mean loss per epoch, the config, learned betas with rationality, mean soft label with smoothing); the same
    summary is stored in ``model.meta['train']`` and saved with the model. A non-finite loss raises
    FloatingPointError before the step is taken."""
    cfg = cfg or RMTrainConfig()
    cfg.check()
    if model.kind == "prm":
        raise ConfigError("rm train: a PRM trains on step labels (postrl prm train), not on preference pairs")
    if not pairs:
        raise DataError("rm train: no preference pairs")
    if cfg.margin:
        check_margins(pairs)
    learned = cfg.rationality in LEARNED
    groups, gidx = preference_groups(pairs, cfg.rationality)
    if learned and model.groups != groups:
        model.set_groups(groups)
    model.rationality = cfg.rationality
    judged = comparison_betas(pairs, cfg.beta_max, cfg.beta_min) if cfg.rationality == "judged" else None
    model.train()
    dev = model.device
    enc_c = model.encode_many([p.prompt for p in pairs], [p.chosen for p in pairs])
    enc_r = model.encode_many([p.prompt for p in pairs], [p.rejected for p in pairs])
    margins = torch.tensor([p.margin if cfg.margin else 0.0 for p in pairs], dtype=torch.float32, device=dev)
    gidx_t = torch.tensor(gidx, dtype=torch.long, device=dev)
    judged = judged.to(dev) if judged is not None else None
    labels = torch.ones(len(pairs), dtype=torch.float32, device=dev)

    body = [p for n, p in model.named_parameters() if not n.startswith("beta_raw") and p.requires_grad]
    groups_opt = [{"params": body, "lr": cfg.lr, "weight_decay": cfg.weight_decay}]
    if learned:
        groups_opt.append({"params": [model.beta_raw], "lr": cfg.rationality_lr, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups_opt)
    rng = random.Random(cfg.seed)
    order = list(range(len(pairs)))
    history: list[float] = []
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        total, count = 0.0, 0
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s:s + cfg.batch_size]
            B = len(idx)
            ids, mask = model.collate([enc_c[i][0] for i in idx] + [enc_r[i][0] for i in idx])
            out = model(ids, mask)  # [2B, H]
            r_c, r_r = out[:B], out[B:]
            it = torch.as_tensor(idx, device=dev)
            beta = model.betas()[gidx_t[it]] if learned else judged[it] if judged is not None else 1.0
            target = labels[it] if cfg.smoothing is not None else None
            if model.kind == "odin":
                rank_c, rank_r = r_c.sum(-1), r_r.sum(-1)
                loss = bt_loss(rank_c, rank_r, beta=beta, margin=margins[it], target=target).mean()
                lengths = torch.tensor([enc_c[i][1] for i in idx] + [enc_r[i][1] for i in idx], device=dev)
                l_len, l_orth = odin_penalties(out[:, 0], out[:, 1], lengths, model.heads.weight[0],
                                               model.heads.weight[1])
                loss = loss + cfg.odin_length_weight * l_len + cfg.odin_ortho_weight * l_orth
                logit = (beta * (rank_c - rank_r) - margins[it]).detach()
            else:
                loss = bt_loss(r_c, r_r, beta=beta, margin=margins[it], target=target).mean()
                b = beta[:, None] if isinstance(beta, torch.Tensor) else beta
                logit = (b * (r_c - r_r) - margins[it][:, None]).detach()
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"rm train: non-finite loss at epoch {epoch + 1}, step {s // cfg.batch_size}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(body, cfg.max_grad_norm)
            opt.step()
            if cfg.smoothing is not None:
                p = torch.sigmoid(logit)
                p = p.mean(-1) if p.dim() == 2 else p
                labels[it] = (1 - cfg.smoothing) * labels[it] + cfg.smoothing * p
            total += float(loss.detach()) * B
            count += B
        history.append(total / max(count, 1))
        if log:
            extra = ""
            if learned:
                bt = model.rationality_table()
                extra = "  betas " + " ".join(f"{g}={b:.2f}" for g, b in list(bt.items())[:8])
            log(f"rm epoch {epoch + 1}/{cfg.epochs}  loss {history[-1]:.4f}{extra}")
    model.eval()
    summary = {"loss": history, "config": asdict(cfg)}
    if learned:
        summary["betas"] = model.rationality_table()
    if judged is not None:
        summary["comparison_betas"] = {"mean": float(judged.mean()), "min": float(judged.min()),
                                       "max": float(judged.max()),
                                       "likely_biased": sum(p.bias >= 0.5 for p in pairs) / len(pairs)}
    if cfg.smoothing is not None:
        summary["mean_soft_label"] = float(labels.mean())
    model.meta.update({"train": summary})
    return summary


def fit_reward_model(backbone: str, pairs: Sequence[PreferencePair], cfg: RMTrainConfig | None = None, *,
                     kind: str = "bt", num_heads: int = 1, seeds: int = 1, max_length: int = 1024,
                     chat_template: str = "auto", device: str = "cpu",
                     log: Callable[[str], None] | None = None) -> RewardModel | RewardEnsemble:
    """Build (from ``backbone``, see :func:`~postrl.reward_models.backbones.load_backbone`) and train a reward model.

    ``seeds > 1`` trains that many models, member k with seed ``cfg.seed + k`` (backbone init for ``tiny:`` /
    ``bag:`` backbones, head init, data order), and returns a :class:`RewardEnsemble`.
    """
    cfg = cfg or RMTrainConfig()
    if seeds < 1:
        raise ConfigError(f"rm train: seeds must be >= 1, got {seeds}")
    members = []
    for k in range(seeds):
        c = RMTrainConfig(**{**asdict(cfg), "seed": cfg.seed + k})
        bb, tok = load_backbone(backbone, seed=c.seed)
        m = RewardModel(bb, tok, kind=kind, num_heads=num_heads, max_length=max_length, chat_template=chat_template,
                        seed=c.seed, meta={"backbone": str(backbone)}).to(device)
        if log and seeds > 1:
            log(f"member {k + 1}/{seeds} (seed {c.seed})")
        train_reward_model(m, pairs, c, log=log)
        members.append(m)
    return members[0] if seeds == 1 else RewardEnsemble(members, meta={"backbone": str(backbone), "seeds": seeds})
