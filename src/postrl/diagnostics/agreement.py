"""Sampler / trainer log-prob agreement, before a run (``postrl check-logprobs``).

An importance ratio pi_theta / pi_old is only as good as the agreement of the two programs that compute its two
sides: the sampler (KV-cache decoding, with top-p / top-k) and the trainer's forward (whole sequences, in
micro-batches, padded). :func:`check_agreement` generates with the configured sampler, recomputes the log-probs of
the sampled tokens with the trainer's one log-prob function (:meth:`postrl.context.ModelContext.token_logprobs`)
and measures, per completion token, the log-ratio d = log p_trainer - log p_sampler: its mean, spread and largest
value, and the fraction of tokens whose probability ratio exp(d) lies outside [0.9, 1.1] (TRL issue 6789: 8% of
tokens from the trainer's chunking alone on GPU). Three sets of rows (:class:`Row`):

* ``configured``: the trainer as configured (``train.micro_batch_size``, the batch as sampled, ``model.dtype``,
  ``rollout.logprobs``) against the distribution the tokens were drawn from (with a top-p / top-k filter the
  renormalised one, q = pi / M: what vLLM's processed log-probs report). The command's exit status reads this row.
* ``micro-batch``: the same distribution as the sampler reports (so a filter's kept mass does not hide the
  numerics), recomputed in micro-batches of several sizes and three padding layouts: ``as sampled`` (the
  generation's own padding, as postrl's trainer feeds it), ``per micro-batch`` (each micro-batch cut to its own
  longest prompt and completion, as trainers that re-pad do) and ``extra padding`` (:data:`EXTRA_PAD` more pad
  columns left of the prompts and right of the completions).
* ``top-p / top-k``: a filter (the configured one, else the probe's) sampled, the trainer's log-probs of the full
  distribution (uncorrected, ``rollout.logprobs=full``: the ratio is off by the kept mass M per token) and of the
  renormalised one (corrected, ``filtered``), both against q.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from postrl.context import ModelContext
from postrl.generation import Generation, SamplingParams, encode_prompt, fit_prompts
from postrl.data import load_source

BAND = 0.1
"""A token is outside when its probability ratio exp(d) is below 1 - BAND or above 1 + BAND."""
EXTRA_PAD = (7, 5)
"""``extra padding`` layout: pad columns added left of the prompts and right of the completions."""
LAYOUTS = ("as sampled", "per micro-batch", "extra padding")


@dataclass
class Row:
    """One comparison: ``check`` (configured / micro-batch / top-p / top-k), ``setting`` (what was varied),
    ``tokens`` compared, the log-ratio d = log p_trainer - log p_sampler per token (``mean``, ``std``, ``max_abs``,
    ``p99_abs``), ``outside``: the fraction of tokens with exp(d) outside [0.9, 1.1], ``kept_mass``: the mean
    probability mass the sampler's filter kept (None without a filter)."""

    check: str
    setting: str
    tokens: int
    mean: float
    std: float
    max_abs: float
    p99_abs: float
    outside: float
    kept_mass: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def ratio_stats(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Statistics of d = trainer - sampler over the tokens where ``mask`` is set (all [N, T])."""
    d = (trainer.double() - sampler.double())[mask.bool()]
    if d.numel() == 0:
        nan = float("nan")
        return {"tokens": 0, "mean": nan, "std": nan, "max_abs": nan, "p99_abs": nan, "outside": nan}
    r = d.exp()
    return {"tokens": int(d.numel()), "mean": float(d.mean()), "std": float(d.std()) if d.numel() > 1 else 0.0,
            "max_abs": float(d.abs().max()), "p99_abs": float(torch.quantile(d.abs(), 0.99)),
            "outside": float(((r < 1 - BAND) | (r > 1 + BAND)).double().mean())}


def _layout(gen: Generation, rows: torch.Tensor, layout: str, pad_id: int) -> SimpleNamespace:
    p_ids, p_mask = gen.prompt_ids[rows], gen.prompt_mask[rows]
    c_ids, c_mask = gen.completion_ids[rows], gen.completion_mask[rows]
    if layout == "per micro-batch":
        first = int(p_mask.any(0).float().argmax())  # left padding: the first column any row uses
        width = max(int(c_mask.sum(-1).max()), 1)
        p_ids, p_mask, c_ids = p_ids[:, first:], p_mask[:, first:], c_ids[:, :width]
    elif layout == "extra padding":
        left, right = EXTRA_PAD
        p_ids, p_mask = F.pad(p_ids, (left, 0), value=pad_id), F.pad(p_mask, (left, 0), value=0)
        c_ids = F.pad(c_ids, (0, right), value=pad_id)
    elif layout != "as sampled":
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return SimpleNamespace(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids)


@torch.no_grad()
def recompute(ctx: ModelContext, gen: Generation, micro_batch_size: int, layout: str = "as sampled") -> torch.Tensor:
    """The trainer's log-probs [N, T] of ``gen``'s completion tokens (:meth:`ModelContext.token_logprobs`, the
    distribution ``ctx.sampling`` names), in micro-batches of ``micro_batch_size`` rows laid out as ``layout``."""
    N, T = gen.completion_ids.shape
    out = torch.zeros(N, T)
    for i in range(0, N, micro_batch_size):
        rows = torch.arange(i, min(i + micro_batch_size, N))
        sub = _layout(gen, rows, layout, ctx.pad_id)
        lp = ctx.token_logprobs(sub, torch.arange(len(rows)))[0].float().cpu()
        w = min(lp.shape[1], T)
        out[rows, :w] = lp[:, :w]
    return out


def _kept_mass(gen: Generation) -> float | None:
    if gen.kept_logmass is None:
        return None
    m = gen.completion_mask.bool()
    return float(gen.kept_logmass[m].exp().mean()) if m.any() else None


def _row(check: str, setting: str, trainer: torch.Tensor, sampler: torch.Tensor, gen: Generation,
         kept: bool = True) -> Row:
    return Row(check, setting, **ratio_stats(trainer, sampler, gen.completion_mask),
               kept_mass=_kept_mass(gen) if kept else None)


def _filter_text(p: SamplingParams) -> str:
    parts = ([f"top_p={p.top_p:g}"] if p.top_p < 1.0 else []) + ([f"top_k={p.top_k}"] if p.top_k > 0 else [])
    return ", ".join(parts)


@dataclass
class Agreement:
    """What :func:`check_agreement` measured: ``rows`` (the configured row first), the sampling it used."""

    rows: list[Row]
    configured: Row
    sampling: SamplingParams
    probe: SamplingParams
    prompts: int
    completions: int

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "configured": self.configured.to_dict(),
                "prompts": self.prompts, "completions": self.completions,
                "sampling": {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                             "top_k": self.sampling.top_k, "logprobs": self.sampling.logprobs},
                "probe": {"top_p": self.probe.top_p, "top_k": self.probe.top_k}}


def check_agreement(model: Any, tokenizer: Any, cfg: Any, *, generator: Any, logprob_fn: Any, device: Any = "cpu",
                    prompts: int = 8, micro_batch_sizes: list[int] | None = None, probe_top_p: float | None = None,
                    probe_top_k: int | None = None) -> Agreement:
    """Generate ``prompts`` x ``rollout.group_size`` completions of the config's task with ``generator`` (the
    run's backend, :meth:`postrl.accel.Accel.generator`) and compare the sampler's log-probs with the trainer's
    (``logprob_fn``: the run's, :meth:`postrl.accel.Accel.logprobs`), as the module docstring describes.

    ``micro_batch_sizes``: default 1, 4, ``train.micro_batch_size`` and all rows at once. The filter rows use the
    configured top-p / top-k when the config has one, else ``probe_top_p`` (default 0.9) / ``probe_top_k``
    (default off); given explicitly they override the config's. With temperature 0 (greedy) no filter applies and
    the filter rows are left out."""
    r = cfg.rollout
    model.train()  # the update's forward (dropout included, if the model has any); the generator samples in eval
    rows = load_source(cfg.task.model_dump()).eval_rows(prompts, cfg.seed)
    ids, _ = fit_prompts([encode_prompt(tokenizer, row["prompt"], cfg.model.chat_template) for row in rows],
                         r.max_prompt_length)
    G = r.group_size
    # the distribution the tokens are drawn from (renormalised with a filter) and the trainer's, as configured
    drawn = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                           stop=list(r.stop), ignore_eos=r.ignore_eos, logprobs="filtered")
    trained = replace(drawn, logprobs=r.logprobs)
    ctx = ModelContext(model, tokenizer, device, temperature=r.temperature or 1.0,
                       micro_batch_size=cfg.train.micro_batch_size, chat_template=cfg.model.chat_template,
                       sampling=trained, pad_id=generator.pad_id, logprob_fn=logprob_fn,
                       autocast=cfg.model.dtype == "bfloat16")
    seeds = [cfg.seed * 1000 + i for i in range(len(ids))]
    gen = generator.generate(ids, G, drawn, seeds)
    N = len(gen.completion_ids)
    mb = cfg.train.micro_batch_size
    out = []
    configured = _row("configured", f"micro_batch_size={mb}, {r.logprobs} log-probs"
                      + (f", {_filter_text(drawn)}" if drawn.filters else "")
                      + (", bf16" if ctx.autocast else ""), recompute(ctx, gen, mb), gen.logprobs, gen)
    out.append(configured)
    # micro-batch size and padding: against what the sampler reports of the trainer's own distribution
    own = gen.logprobs if trained.logprob_filter() or gen.kept_logmass is None else \
        (gen.logprobs + gen.kept_logmass) * gen.completion_mask
    sizes = sorted({max(1, int(s)) for s in (micro_batch_sizes or [1, 4, mb, N])})
    for size in sizes:
        for layout in LAYOUTS:
            out.append(_row("micro-batch", f"{size} row{'s' * (size > 1)}, {layout}",
                            recompute(ctx, gen, size, layout), own, gen,
                            kept=False))
    # top-p / top-k with and without the correction
    probe = drawn
    if probe_top_p is not None or probe_top_k is not None or not drawn.filters:
        top_p = probe_top_p if probe_top_p is not None else (r.top_p if drawn.filters else 0.9)
        top_k = probe_top_k if probe_top_k is not None else (r.top_k if drawn.filters else 0)
        probe = replace(drawn, top_p=top_p, top_k=top_k)
    if probe.filters:
        pgen = gen if probe == drawn else generator.generate(ids, G, probe, seeds)
        for label, logprobs in (("uncorrected", "full"), ("corrected", "filtered")):
            ctx.sampling = replace(probe, logprobs=logprobs)
            out.append(_row("top-p/top-k", f"{_filter_text(probe)}, {label} ({logprobs} log-probs)",
                            recompute(ctx, pgen, mb), pgen.logprobs, pgen))
        ctx.sampling = trained
    return Agreement(out, configured, trained, probe, len(ids), N)


def render(res: Agreement, max_outside: float | None = None, console: Any = None) -> None:
    """The rows as a rich table, with the verdict on the configured row when ``max_outside`` is given."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    s = res.sampling
    t = Table(title=f"sampler vs trainer log-probs: {res.prompts} prompts x {res.completions // max(res.prompts, 1)}"
                    f" completions, temperature {s.temperature:g}; d = log p_trainer - log p_sampler per token",
              title_justify="left")
    for col, kw in (("check", {}), ("setting", {}), ("tokens", {"justify": "right"}),
                    ("mean d", {"justify": "right"}), ("std d", {"justify": "right"}),
                    ("max |d|", {"justify": "right"}), ("p99 |d|", {"justify": "right"}),
                    (f"outside [{1 - BAND:g}, {1 + BAND:g}]", {"justify": "right"}),
                    ("kept mass", {"justify": "right"})):
        t.add_column(col, **kw)

    def num(x: float) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}" if x and abs(x) < 1e-3 \
            else f"{x:.4f}"

    previous = None
    for row in res.rows:
        t.add_row(row.check if row.check != previous else "", row.setting, str(row.tokens), num(row.mean),
                  num(row.std), num(row.max_abs), num(row.p99_abs), f"{row.outside:.2%}", num(row.kept_mass),
                  end_section=False)
        previous = row.check
    console.print(t)
    if max_outside is not None:
        c = res.configured
        verdict = "ok" if c.outside <= max_outside else "FAIL"
        console.print(f"configured: {c.outside:.2%} of tokens outside [{1 - BAND:g}, {1 + BAND:g}] "
                      f"(--max-outside {max_outside:.2%}): {verdict}")
    c = res.configured
    if abs(c.mean) > 0.01:  # a systematic shift can stay inside the band (top-p keeps at least top_p of the mass)
        cause = ("the kept mass of the top-p / top-k filter: set rollout.logprobs=filtered"
                 if res.sampling.filters and not res.sampling.logprob_filter() else "a systematic difference")
        console.print(f"note: the configured row's mean log-ratio is {c.mean:+.4f} (ratio {math.exp(c.mean):.3f} on "
                      f"average): {cause}")
