"""Reward models: a Hugging Face backbone + linear heads read at the last token (or at step ends for a PRM).

:class:`RewardModel` = ``backbone`` (any ``AutoModel``: ``backbone(input_ids, attention_mask).last_hidden_state``)
+ ``heads`` (``nn.Linear(hidden, H)``). The text scored is ``encode_prompt(prompt) + tokens(completion)``
(the policy's own prompt encoding, completion tokenised without special tokens), right-padded, truncated from
the left to ``max_length`` tokens. Pooling reads the hidden state of the last real token (TRL
``AutoModelForSequenceClassification`` / OpenRLHF reward-model convention).

``kind`` decides what the heads mean and what :meth:`RewardModel.score` returns:

========  ======  ==========================================================================================
kind      H       score(prompts, completions) -> [N, K]
========  ======  ==========================================================================================
``bt``    K >= 1  every head (K = 1: plain Bradley-Terry; K > 1: an ensemble of K heads on one backbone)
``odin``  2       the quality head only (head 0 = length head, head 1 = quality head; ODIN)
``prm``   1       one score per completion, reduced over its step scores (``min`` by default; see
                  :meth:`RewardModel.step_scores` for the [N, S] step scores)
========  ======  ==========================================================================================

:class:`RewardEnsemble` holds K independently trained members (K seeds); its ``score`` concatenates theirs.
``load_reward_model(folder)`` loads either.

Folder layout written by ``save_pretrained`` (single model)::

    config.json, model.safetensors   the backbone (backbone.save_pretrained; loadable by AutoModel)
    tokenizer files                  tokenizer.save_pretrained
    reward_head.safetensors          heads.weight [H, hidden], heads.bias [H], beta_raw [G] (rationality)
    reward_model.json                postrl's config: kind, heads, groups, max_length, training summary

and for an ensemble of seeds: ``reward_model.json`` (``kind: seed_ensemble``) + ``member_0 .. member_{K-1}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from postrl.errors import PostrlError
from postrl.reward_models.backbones import hidden_size, load_backbone
from postrl.generation import encode_prompt
from postrl.reasoning_steps import step_spans

__all__ = ["RewardModel", "RewardEnsemble", "load_reward_model", "step_pieces", "reduce_steps", "CONFIG_NAME"]

CONFIG_NAME = "reward_model.json"
HEAD_NAME = "reward_head.safetensors"
KINDS = ("bt", "odin", "prm")
REDUCES = ("min", "last", "mean", "prod")
_BETA_SHIFT = math.log(math.e - 1.0)  # softplus(0 + shift) = 1: every rationality starts at beta = 1


def step_pieces(text: str, delimiter: str = "\n\n", steps: Sequence[str] | None = None) -> list[str]:
    """The completion cut at its step ends: piece i runs from the end of step i-1 to the end of step i, trailing
    delimiter included, so ``"".join(pieces) == text`` whenever there is a step.

    Steps are those of :func:`postrl.reasoning_steps.step_spans` (a step ends at each ``delimiter``; blank steps are
    merged into the one before; default ``"\n\n"``, the run's ``reward.step_delimiter``). When ``steps`` (the
    run's step texts, e.g. the trainer's ``steps`` column) is given, they are located in order in ``text``
    instead; a step that cannot be found raises ValueError.
    """
    if steps is None:
        bounds = [end for _, _, end in step_spans(text, delimiter)]
    else:
        starts, pos = [], 0
        for st in steps:
            j = text.find(st, pos)
            if j < 0:
                raise ValueError(f"step {st!r} not found in the completion")
            starts.append(j)
            pos = j + len(st)
        bounds = starts[1:] + ([len(text)] if starts else [])
    if not bounds:
        return []
    bounds[-1] = len(text)
    pieces, prev = [], 0
    for b in bounds:
        pieces.append(text[prev:b])
        prev = b
    return pieces


class RewardModel(nn.Module):
    """Backbone + ``num_heads`` linear heads; see the module docstring for ``kind``.

    Defaults: kind 'bt', num_heads 1, max_length 1024 tokens, chat_template 'auto', delimiter "\\n\\n" (PRM
    steps), reduce 'min' (PRM scalar), head weights ~ N(0, 1/hidden) from ``seed`` (distinct per head), biases 0.

    Rationality (``groups``): ``beta_raw`` [G] learnable, beta_g = softplus(beta_raw_g + ln(e - 1)) > 0 (1 at
    init); group names in ``groups`` (``["*"]`` for one global beta). Only training uses it.
    """

    def __init__(self, backbone, tokenizer, *, kind: str = "bt", num_heads: int = 1, max_length: int = 1024,
                 chat_template: str = "auto", groups: Sequence[str] | None = None, rationality: str | None = None,
                 delimiter: str = "\n\n", reduce: str = "min", meta: dict | None = None, seed: int = 0,
                 lm_head: nn.Module | None = None):
        super().__init__()
        if kind not in KINDS:
            raise PostrlError(f"reward model kind '{kind}': valid kinds: {', '.join(KINDS)}")
        if kind == "odin":
            num_heads = 2
        if kind == "prm":
            num_heads = 1
        if num_heads < 1:
            raise PostrlError(f"reward model: num_heads must be >= 1, got {num_heads}")
        if reduce not in REDUCES:
            raise PostrlError(f"reward model: reduce '{reduce}': valid: {', '.join(REDUCES)}")
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.kind = kind
        self.max_length = int(max_length)
        self.chat_template = chat_template
        self.delimiter = delimiter
        self.reduce = reduce
        self.rationality = rationality
        self.groups = list(groups) if groups else []
        self.meta = dict(meta or {})
        h = hidden_size(backbone)
        gen = torch.Generator().manual_seed(int(seed))
        self.heads = nn.Linear(h, num_heads)
        with torch.no_grad():  # distinct heads start distinct (ensemble members); std 1/sqrt(hidden)
            self.heads.weight.copy_(torch.randn(num_heads, h, generator=gen) / math.sqrt(h))
            self.heads.bias.zero_()
        self.beta_raw = nn.Parameter(torch.zeros(len(self.groups)))
        self.lm_head = lm_head  # the backbone's LM head, kept for a text-generation loss (rm train --lm-reg)
        self._prompt_cache: dict[str, list[int]] = {}
        self._use_cache_kw = _accepts_use_cache(backbone)

    # ------------------------------------------------------------------------------------------------ basics
    @property
    def num_heads(self) -> int:
        return self.heads.out_features

    @property
    def num_scores(self) -> int:
        """K, the number of columns :meth:`score` returns."""
        return self.num_heads if self.kind == "bt" else 1

    @property
    def device(self) -> torch.device:
        return self.heads.weight.device

    def betas(self) -> torch.Tensor:
        """beta_g = softplus(beta_raw_g + ln(e - 1)), shape [G]."""
        return F.softplus(self.beta_raw + _BETA_SHIFT)

    def set_groups(self, groups: Sequence[str]) -> None:
        """(Re)create the rationality parameters for ``groups`` (every beta back to 1)."""
        self.groups = list(groups)
        self.beta_raw = nn.Parameter(torch.zeros(len(self.groups), device=self.device))

    def rationality_table(self) -> dict[str, float]:
        """{group: beta} of the learned rationality (empty without rationality)."""
        return {g: float(b) for g, b in zip(self.groups, self.betas().tolist())}

    # ------------------------------------------------------------------------------------------------ encoding
    def _prompt_ids(self, prompt: str) -> list[int]:
        ids = self._prompt_cache.get(prompt)
        if ids is None:
            ids = encode_prompt(self.tokenizer, prompt, self.chat_template) if prompt else []
            if len(self._prompt_cache) < 100_000:
                self._prompt_cache[prompt] = ids
        return ids

    def _text_ids(self, text: str) -> list[int]:
        return self._texts_ids([text])[0] if text else []

    def _texts_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of every text (no special tokens), in one batched tokenizer call; '' -> []."""
        nonempty = [t for t in texts if t]
        if not nonempty:
            return [[] for _ in texts]
        toks = iter(self.tokenizer(nonempty, add_special_tokens=False, return_attention_mask=False,
                                   return_token_type_ids=False)["input_ids"])
        return [list(next(toks)) if t else [] for t in texts]

    def encode(self, prompt: str, completion: str) -> tuple[list[int], int]:
        """(token ids of prompt + completion truncated from the left to max_length, completion length)."""
        return self.encode_many([prompt], [completion])[0]

    def encode_many(self, prompts: Sequence[str], completions: Sequence[str]) -> list[tuple[list[int], int]]:
        """:meth:`encode` of every pair (the completions tokenised in one batched tokenizer call)."""
        out = []
        for p, cid in zip(prompts, self._texts_ids(completions)):
            ids = (self._prompt_ids(p) + cid) or [self._fallback_id()]
            out.append((ids[-self.max_length:], len(cid)))
        return out

    def encode_steps(self, prompt: str, completion: str, steps: Sequence[str] | None = None
                     ) -> tuple[list[int], list[int]]:
        """(token ids, index of the last token of every step) for a PRM; steps from :func:`step_pieces`
        (``self.delimiter``, or the given ``steps``).

        Each piece is tokenised on its own (so a step end is always a token boundary); an index that falls off
        by left truncation is -1.
        """
        ids = list(self._prompt_ids(prompt))
        ends = []
        for piece in self._texts_ids(step_pieces(completion, self.delimiter, steps)):
            ids += piece
            ends.append(len(ids) - 1)
        if not ids:
            ids = [self._fallback_id()]
        cut = max(0, len(ids) - self.max_length)
        return ids[cut:], [e - cut if e - cut >= 0 else -1 for e in ends]

    def _fallback_id(self) -> int:
        tok = self.tokenizer
        for t in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id):
            if t is not None:
                return int(t)
        return 0

    def collate(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad token lists into (input_ids, attention_mask) [B, T] on the model's device."""
        width = max(len(s) for s in seqs)
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
        return ids.to(self.device), mask.to(self.device)

    # ------------------------------------------------------------------------------------------------ forward
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Backbone hidden states [B, T, hidden] (float32)."""
        kw = {"use_cache": False} if self._use_cache_kw else {}
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kw)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return h.float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Every head at the last real token: [B, H] (right padding: position = mask.sum - 1)."""
        return self.forward_hidden(input_ids, attention_mask)[0]

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(every head at the last real token [B, H], the backbone's hidden states [B, T, hidden])."""
        h = self.hidden(input_ids, attention_mask)
        last = (attention_mask.sum(-1) - 1).clamp(min=0)
        pooled = h[torch.arange(h.shape[0], device=h.device), last]
        return self.heads(pooled), h

    def head_outputs(self, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 32,
                     seqs: list[list[int]] | None = None) -> torch.Tensor:
        """All heads for every (prompt, completion), no grad: [N, H] on CPU (``seqs``: already encoded)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        if seqs is None:
            seqs = [x for x, _ in self.encode_many(prompts, completions)]
        outs = []
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                for s in range(0, len(seqs), batch_size):
                    outs.append(self(*self.collate(seqs[s:s + batch_size])).cpu())
        finally:
            self.train(was)
        return torch.cat(outs) if outs else torch.zeros(0, self.num_heads)

    def step_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, ends: torch.Tensor,
                    return_hidden: bool = False):
        """Head 0 at the given positions: ends [B, S] long (-1 = none) -> logits [B, S] (NaN where none); with
        ``return_hidden`` also the backbone's hidden state there, [B, S, hidden] (NaN where none)."""
        h = self.hidden(input_ids, attention_mask)
        idx = ends.clamp(min=0)
        g = h[torch.arange(h.shape[0], device=h.device)[:, None], idx]  # [B, S, hidden]
        logits = self.heads(g)[..., 0]
        logits = torch.where(ends >= 0, logits, torch.full_like(logits, float("nan")))
        if not return_hidden:
            return logits
        return logits, torch.where((ends >= 0)[..., None], g, torch.full_like(g, float("nan")))

    def step_scores(self, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 32,
                    steps: Sequence[Sequence[str]] | None = None, return_hidden: bool = False):
        """PRM step scores sigma(head) at every step end: [N, S_max], NaN beyond a completion's own S steps.

        Steps: :func:`step_pieces` of each completion (at ``self.delimiter``, or located from ``steps[i]``);
        S_max is the most steps of any completion in the call (at least 1 column). ``return_hidden``: also the
        PRM's hidden state at each step end, [N, S_max, hidden] (NaN padded), what a conditional calibrator
        (``postrl.calibration.ConditionalOT``, "Distributional Process Reward Models") conditions on.
        """
        rows, hid = [], []
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                for s in range(0, len(completions), batch_size):
                    enc = [self.encode_steps(prompts[i], completions[i], None if steps is None else steps[i])
                           for i in range(s, min(s + batch_size, len(completions)))]
                    width = max(1, max(len(e) for _, e in enc))
                    ends = torch.full((len(enc), width), -1, dtype=torch.long)
                    for i, (_, e) in enumerate(enc):
                        ends[i, : len(e)] = torch.as_tensor(e, dtype=torch.long)
                    ids, mask = self.collate([x for x, _ in enc])
                    out = self.step_logits(ids, mask, ends.to(self.device), return_hidden=return_hidden)
                    logits, h = out if return_hidden else (out, None)
                    rows.extend(torch.sigmoid(logits).cpu().unbind(0))
                    if h is not None:
                        hid.extend(h.float().cpu().unbind(0))
        finally:
            self.train(was)
        width = max([r.numel() for r in rows], default=1)
        out = torch.full((len(rows), width), float("nan"))
        for i, r in enumerate(rows):
            out[i, : r.numel()] = r
        if not return_hidden:
            return out
        H = hidden_size(self.backbone)
        hidden = torch.full((len(rows), width, H), float("nan"))
        for i, h in enumerate(hid):
            hidden[i, : h.shape[0]] = h
        return out, hidden

    def prompt_scores(self, prompts: Sequence[str], batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma(head 0) [N], hidden state [N, hidden]) at the last token of each encoded prompt: the PRM's
        reading of the problem before any step (the prefix an instance-adaptive Best-of-N budget is decided at)."""
        scores, hidden = [], []
        was = self.training
        self.eval()
        try:
            with torch.no_grad():
                for s in range(0, len(prompts), batch_size):
                    seqs = [(self._prompt_ids(p) or [self._fallback_id()])[-self.max_length:]
                            for p in prompts[s:s + batch_size]]
                    ids, mask = self.collate(seqs)
                    ends = (mask.sum(-1) - 1).clamp(min=0)[:, None]
                    logits, h = self.step_logits(ids, mask, ends, return_hidden=True)
                    scores.append(torch.sigmoid(logits[:, 0]).cpu())
                    hidden.append(h[:, 0].float().cpu())
        finally:
            self.train(was)
        if not scores:
            return torch.zeros(0), torch.zeros(0, hidden_size(self.backbone))
        return torch.cat(scores), torch.cat(hidden)

    def score(self, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 32,
              seqs: list[list[int]] | None = None) -> torch.Tensor:
        """Downstream scores [N, K] (see the kind table in the module docstring)."""
        if self.kind == "prm":
            return reduce_steps(self.step_scores(prompts, completions, batch_size), self.reduce)[:, None]
        out = self.head_outputs(prompts, completions, batch_size, seqs)
        return out[:, 1:2] if self.kind == "odin" else out

    # ------------------------------------------------------------------------------------------------ save / load
    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_heads": self.num_heads, "max_length": self.max_length,
                "chat_template": self.chat_template, "groups": self.groups, "rationality": self.rationality,
                "delimiter": self.delimiter, "reduce": self.reduce,
                "head_names": (["length", "quality"] if self.kind == "odin" else
                               [f"head_{k}" for k in range(self.num_heads)]),
                "rationality_betas": self.rationality_table(), "meta": self.meta, "format": 1}

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write the folder described in the module docstring; returns its path."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        save_file({"heads.weight": self.heads.weight.detach().cpu().contiguous(),
                   "heads.bias": self.heads.bias.detach().cpu().contiguous(),
                   "beta_raw": self.beta_raw.detach().cpu().contiguous()}, str(folder / HEAD_NAME))
        (folder / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=1))
        return folder

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu") -> "RewardModel":
        """Load a folder written by :meth:`save_pretrained` (backbone through ``AutoModel``)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = _read_config(folder)
        if cfg.get("kind") == "seed_ensemble":
            raise PostrlError(f"reward model '{folder}': an ensemble of seeds; load it with load_reward_model")
        if not (folder / HEAD_NAME).is_file():
            raise PostrlError(f"reward model '{folder}': no {HEAD_NAME} in it")
        backbone, tok = load_backbone(folder)
        model = cls(backbone, tok, kind=cfg["kind"], num_heads=int(cfg["num_heads"]),
                    max_length=int(cfg.get("max_length", 1024)), chat_template=cfg.get("chat_template", "auto"),
                    groups=cfg.get("groups") or None, rationality=cfg.get("rationality"),
                    delimiter=cfg.get("delimiter", "\n\n"), reduce=cfg.get("reduce", "min"), meta=cfg.get("meta"))
        state = load_file(str(folder / HEAD_NAME))
        with torch.no_grad():
            model.heads.weight.copy_(state["heads.weight"])
            model.heads.bias.copy_(state["heads.bias"])
            model.beta_raw.copy_(state["beta_raw"])
        return model.to(device).eval()


class RewardEnsemble(nn.Module):
    """K independently trained reward models (K seeds); ``score`` -> [N, sum of members' K] (one per member)."""

    def __init__(self, members: Sequence[RewardModel], meta: dict | None = None):
        super().__init__()
        if not members:
            raise PostrlError("reward ensemble: needs at least one member")
        self.members = nn.ModuleList(members)
        self.kind = "seed_ensemble"
        self.meta = dict(meta or {})

    @property
    def num_scores(self) -> int:
        return sum(m.num_scores for m in self.members)

    def _shared_encoding(self) -> bool:
        """True when every member encodes text identically (same vocab, max_length, chat template): the texts
        are then tokenised once for all members."""
        if not hasattr(self, "_shared"):
            m0 = self.members[0]
            same = all(m.kind != "prm" and m.max_length == m0.max_length and m.chat_template == m0.chat_template
                       and type(m.tokenizer) is type(m0.tokenizer) and m.tokenizer.get_vocab() == m0.tokenizer.get_vocab()
                       for m in self.members)
            self._shared = same
        return self._shared

    def score(self, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        seqs = None
        if self._shared_encoding():
            seqs = [x for x, _ in self.members[0].encode_many(prompts, completions)]
        return torch.cat([m.score(prompts, completions, batch_size, seqs=seqs) if m.kind != "prm"
                          else m.score(prompts, completions, batch_size) for m in self.members], dim=1)

    def save_pretrained(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        names = []
        for k, m in enumerate(self.members):
            m.save_pretrained(folder / f"member_{k}")
            names.append(f"member_{k}")
        (folder / CONFIG_NAME).write_text(json.dumps({"kind": "seed_ensemble", "members": names, "meta": self.meta,
                                                      "format": 1}, indent=1))
        return folder

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu") -> "RewardEnsemble":
        folder = Path(folder)
        cfg = _read_config(folder)
        if cfg.get("kind") != "seed_ensemble":
            raise PostrlError(f"reward model '{folder}': not an ensemble of seeds (kind {cfg.get('kind')!r})")
        return cls([RewardModel.from_pretrained(folder / m, device) for m in cfg["members"]], cfg.get("meta"))


def load_reward_model(folder: str | Path, device: str | torch.device = "cpu") -> RewardModel | RewardEnsemble:
    """A :class:`RewardModel` or :class:`RewardEnsemble` from a folder written by ``save_pretrained``."""
    cfg = _read_config(Path(folder))
    if cfg.get("kind") == "seed_ensemble":
        return RewardEnsemble.from_pretrained(folder, device)
    return RewardModel.from_pretrained(folder, device)


def reduce_steps(steps: torch.Tensor, how: str = "min") -> torch.Tensor:
    """Per-completion score from step scores [N, S] (NaN = no step): min / last / mean / prod over real steps.

    A completion without steps gets NaN (a failed reward, never 0).
    """
    ok = ~torch.isnan(steps)
    n = ok.sum(-1)
    if how == "min":
        out = torch.where(ok, steps, torch.full_like(steps, math.inf)).min(-1).values
    elif how == "mean":
        out = torch.where(ok, steps, torch.zeros_like(steps)).sum(-1) / n.clamp(min=1)
    elif how == "prod":
        out = torch.where(ok, steps, torch.ones_like(steps)).prod(-1)
    elif how == "last":
        out = steps.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
    else:
        raise PostrlError(f"reduce '{how}': valid: {', '.join(REDUCES)}")
    return torch.where(n > 0, out, torch.full_like(out, math.nan))


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise PostrlError(f"reward model '{folder}': no such folder")
    f = folder / CONFIG_NAME
    if not f.is_file():
        raise PostrlError(f"reward model '{folder}': no {CONFIG_NAME} in it (expected a folder written by "
                          f"postrl rm train / RewardModel.save_pretrained)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise PostrlError(f"reward model '{folder}': {CONFIG_NAME} is not valid JSON ({e.msg})") from None


def _accepts_use_cache(backbone) -> bool:
    import inspect

    try:
        params = inspect.signature(backbone.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params
