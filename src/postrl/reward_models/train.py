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

* ``lm_reg`` (``lm_reg=alpha``, ``postrl rm train --lm-reg``): the backbone keeps its language-model head and a
  text-generation loss on the chosen responses regularises the hidden states the reward head reads:
      L = (1 - alpha) L_rank + alpha L_reg,   L_reg = mean_i -log sigma(beta_reg * log pi(y_c,i | x_i))
  with log pi(y_c | x) = sum_t log softmax(lm_head(h_{t-1}))[y_t] over the chosen completion's tokens
  (:func:`completion_logps`); ``lm_reg_form='nll'`` uses L_reg = mean_i -log pi(y_c,i | x_i) instead. Defaults
  (GRM's code): alpha 0.01 (``weight_ratio``), beta_reg 0.1, the log-sigmoid form ("SFT regularization").
  "Regularizing Hidden States Enables Learning Generalizable Reward Model for LLMs" (GRM; abstract: "we retain the
  base model's language model head and incorporate a suite of text-generation losses to preserve the hidden
  states' text generation capabilities, while concurrently learning a reward head behind the same hidden
  states"). Of its suite (DPO, DPO without reference, SFT) postrl implements the SFT regulariser, the one the
  issue names; the LM head trains with the body and is not saved (scoring never reads it). Assumed: the
  reward head is postrl's linear head on the last hidden state (GRM's code also offers an MLP head).

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
           "preference_groups", "comparison_betas", "pair_loss", "completion_logps", "lm_regularizer", "online_step"]

LM_REG_FORMS = ("logsigmoid", "nll")
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
    odin_ortho_weight [1.0], smoothing [None: hard labels], lm_reg [None: no text-generation loss; alpha in
    (0, 1) with the LM head kept, GRM's weight_ratio, 0.01 suggested], lm_reg_form ['logsigmoid' | 'nll'],
    lm_reg_beta [0.1], seed [0]."""

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
    lm_reg: float | None = None
    lm_reg_form: str = "logsigmoid"
    lm_reg_beta: float = 0.1
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
        if self.lm_reg is not None and not (math.isfinite(self.lm_reg) and 0.0 < self.lm_reg < 1.0):
            raise ConfigError(f"rm train: lm_reg (the text-generation loss weight alpha) must be in (0, 1), got "
                              f"{self.lm_reg}")
        if self.lm_reg_form not in LM_REG_FORMS:
            raise ConfigError(f"rm train: lm_reg_form '{self.lm_reg_form}': valid: {', '.join(LM_REG_FORMS)}")
        if not (math.isfinite(self.lm_reg_beta) and self.lm_reg_beta > 0):
            raise ConfigError(f"rm train: lm_reg_beta must be a finite number > 0, got {self.lm_reg_beta}")


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


def pair_loss(model: RewardModel, out: torch.Tensor, *, beta: torch.Tensor | float = 1.0,
              margin: torch.Tensor | float = 0.0, target: torch.Tensor | None = None,
              lengths: torch.Tensor | None = None, odin_length_weight: float = 1.0,
              odin_ortho_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, detached logits) of B pairs from the heads ``out`` [2B, H] of [chosen_1..B, rejected_1..B].

    ``bt``: the loss of the module docstring averaged over pairs and heads, logits [B, H]; ``odin``: the ranking loss
    on r = Q + L plus ``odin_length_weight * L_len + odin_ortho_weight * L_orth`` (``lengths`` [2B]: the completions'
    token counts), logits [B]."""
    B = out.shape[0] // 2
    r_c, r_r = out[:B], out[B:]
    if model.kind == "odin":
        rank_c, rank_r = r_c.sum(-1), r_r.sum(-1)
        loss = bt_loss(rank_c, rank_r, beta=beta, margin=margin, target=target).mean()
        l_len, l_orth = odin_penalties(out[:, 0], out[:, 1], lengths, model.heads.weight[0], model.heads.weight[1])
        loss = loss + odin_length_weight * l_len + odin_ortho_weight * l_orth
        return loss, (beta * (rank_c - rank_r) - margin).detach()
    loss = bt_loss(r_c, r_r, beta=beta, margin=margin, target=target).mean()
    b = beta[:, None] if isinstance(beta, torch.Tensor) else beta
    m = margin[:, None] if isinstance(margin, torch.Tensor) else margin
    return loss, (b * (r_c - r_r) - m).detach()


def completion_logps(model: RewardModel, hidden: torch.Tensor, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, completion_lengths: torch.Tensor) -> torch.Tensor:
    """sum_t log pi(y_t | x, y_<t) of each row's completion through the model's LM head: [B].

    Rows are right-padded ``prompt + completion`` sequences (``RewardModel.encode``) with L = mask.sum() real
    tokens, the completion their last min(c, L) tokens (c = ``completion_lengths``); token j is predicted by the
    LM head on the hidden state at j - 1, so a completion token at position 0 (no prompt left after truncation)
    is not counted. Equal to the causal LM's own log-probs of those tokens (its logits are
    ``lm_head(last_hidden_state)``). Shapes: hidden [B, T, h], input_ids / attention_mask [B, T], lengths [B]."""
    logits = model.lm_head(hidden[:, :-1].to(model.lm_head.weight.dtype)).float()  # position p predicts p + 1
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    L = attention_mask.sum(-1)
    c = torch.minimum(completion_lengths.to(L.dtype), L)
    p = torch.arange(logp.shape[1], device=logp.device)[None, :]
    first = (L - c - 1).clamp(min=0)[:, None]  # the position predicting the first completion token
    keep = (p >= first) & (p < (L - 1)[:, None])
    return (logp * keep).sum(-1)


def lm_regularizer(logps: torch.Tensor, *, form: str = "logsigmoid", beta: float = 0.1) -> torch.Tensor:
    """The text-generation loss on chosen responses, mean over the batch: ``logsigmoid`` (GRM's SFT regulariser,
    its default): -log sigma(beta * log pi(y_c | x)); ``nll``: -log pi(y_c | x). ``logps`` [B]: summed log-probs."""
    if form == "nll":
        return -logps.mean()
    return -F.logsigmoid(beta * logps).mean()


def online_step(model: RewardModel, optimizer: torch.optim.Optimizer, prompts: Sequence[str],
                chosen: Sequence[str], rejected: Sequence[str], *, batch_size: int = 32,
                max_grad_norm: float | None = 1.0, odin_length_weight: float = 1.0,
                odin_ortho_weight: float = 1.0) -> dict:
    """One optimizer step of Bradley-Terry training on P pairs (chosen_i preferred to rejected_i).

    L = (1 / P) sum_i l_i with l_i the per-pair loss of :func:`pair_loss` (beta 1, no margin, hard labels), its
    gradient accumulated over micro-batches of ``batch_size`` pairs (each adds sum_i l_i / P, so the step does not
    depend on ``batch_size`` beyond float rounding; for ODIN the length-correlation term is computed per
    micro-batch and weighted by its share B / P), the body's gradient norm clipped to ``max_grad_norm``, then one
    ``optimizer.step()``. Returns ``loss`` (L before the step), ``pair_accuracy`` (fraction with logit > 0 before
    the step, mean over heads), ``grad_norm``. The model is left in eval mode."""
    P = len(prompts)
    if P == 0:
        return {}
    model.train()
    body = [p for n, p in model.named_parameters() if not n.startswith("beta_raw") and p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    enc_c = model.encode_many(prompts, chosen)
    enc_r = model.encode_many(prompts, rejected)
    total, correct = 0.0, 0.0
    for s in range(0, P, batch_size):
        part = range(s, min(s + batch_size, P))
        B = len(part)
        ids, mask = model.collate([enc_c[i][0] for i in part] + [enc_r[i][0] for i in part])
        lengths = torch.tensor([enc_c[i][1] for i in part] + [enc_r[i][1] for i in part], device=model.device)
        loss, logit = pair_loss(model, model(ids, mask), lengths=lengths, odin_length_weight=odin_length_weight,
                                odin_ortho_weight=odin_ortho_weight)
        if not math.isfinite(float(loss.detach())):
            model.eval()
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError("reward model online step: non-finite Bradley-Terry loss")
        (loss * (B / P)).backward()
        total += float(loss.detach()) * B
        correct += float((logit > 0).float().mean(-1).sum()) if logit.dim() == 2 else float((logit > 0).sum())
    gn = torch.nn.utils.clip_grad_norm_(body, max_grad_norm if max_grad_norm else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return {"loss": total / P, "pair_accuracy": correct / P, "grad_norm": float(gn)}


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
    lm = cfg.lm_reg is not None
    if lm and model.lm_head is None:
        raise ConfigError("rm train: --lm-reg needs the backbone's LM head: a causal-LM folder or tiny:<size> "
                          "loaded with lm_head=True (bag:<dim> has none)")
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
    reg_history: list[float] = []
    for epoch in range(cfg.epochs):
        rng.shuffle(order)
        total, count, reg_total = 0.0, 0, 0.0
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s:s + cfg.batch_size]
            B = len(idx)
            ids, mask = model.collate([enc_c[i][0] for i in idx] + [enc_r[i][0] for i in idx])
            out, hidden = model.forward_hidden(ids, mask) if lm else (model(ids, mask), None)  # [2B, H]
            it = torch.as_tensor(idx, device=dev)
            beta = model.betas()[gidx_t[it]] if learned else judged[it] if judged is not None else 1.0
            target = labels[it] if cfg.smoothing is not None else None
            lengths = torch.tensor([enc_c[i][1] for i in idx] + [enc_r[i][1] for i in idx], device=dev)
            loss, logit = pair_loss(model, out, beta=beta, margin=margins[it], target=target, lengths=lengths,
                                    odin_length_weight=cfg.odin_length_weight,
                                    odin_ortho_weight=cfg.odin_ortho_weight)
            if lm:
                logps = completion_logps(model, hidden[:B], ids[:B], mask[:B], lengths[:B])
                reg = lm_regularizer(logps, form=cfg.lm_reg_form, beta=cfg.lm_reg_beta)
                loss = (1.0 - cfg.lm_reg) * loss + cfg.lm_reg * reg
                reg_total += float(reg.detach()) * B
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
        if lm:
            reg_history.append(reg_total / max(count, 1))
        if log:
            extra = f"  lm_reg {reg_history[-1]:.4f}" if lm else ""
            if learned:
                bt = model.rationality_table()
                extra += "  betas " + " ".join(f"{g}={b:.2f}" for g, b in list(bt.items())[:8])
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
    if lm:
        summary["lm_reg_loss"] = reg_history
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
        loaded = load_backbone(backbone, seed=c.seed, lm_head=c.lm_reg is not None)
        bb, tok = loaded[:2]
        m = RewardModel(bb, tok, kind=kind, num_heads=num_heads, max_length=max_length, chat_template=chat_template,
                        seed=c.seed, meta={"backbone": str(backbone)},
                        lm_head=loaded[2] if len(loaded) > 2 else None).to(device)
        if log and seeds > 1:
            log(f"member {k + 1}/{seeds} (seed {c.seed})")
        train_reward_model(m, pairs, c, log=log)
        members.append(m)
    return members[0] if seeds == 1 else RewardEnsemble(members, meta={"backbone": str(backbone), "seeds": seeds})
