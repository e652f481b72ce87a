"""CPU (or any single-device) generation backend for any Hugging Face causal LM.

:class:`HFGenerator` samples with the model's KV cache: one forward over the left-padded prompts (with an
explicit attention mask and position ids), then one token per step, feeding only the new token. Rows that
finish (EOS or a stop string) are dropped from the running batch and its cache, so a long straggler does not
pay for the rows that are already done. The steps run through the model's own ``forward`` with a
``DynamicCache``, unless a ``decoder`` is given: the CPU speed layer (:mod:`postrl.accel`) passes its
:class:`~postrl.accel.decoder.StaticDecoder` for Llama-family models, the same function with fused projections and a
KV cache allocated once for the whole generation.

Sampling draws only from a ``torch.Generator`` seeded with ``seed``: one uniform number per (row, step), turned
into a token by the inverse CDF of that row's (top-k / top-p filtered) distribution. So the same seed gives the
same output, and a row's sample does not depend on ``batch_size`` or on which other rows have finished.
The log-prob of each sampled token is ``log_softmax(logits / temperature)`` of the *unfiltered* distribution
(temperature 1 when greedy), which is what a full forward recompute in the trainer gives; with
``SamplingParams.logprobs='filtered'`` it is of the renormalised top-p / top-k filtered distribution the token was
drawn from (the trainer then filters the same way). With a filter, the kept log-mass of every sampled position
is returned as ``Generation.kept_logmass``.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import numpy as np
import torch

from postrl.models import cache_keyword, output_cache
from postrl.logprobs import filter_logits
from postrl.generation import Generation, GenerationBackend, SamplingParams, left_pad

__all__ = ["HFGenerator", "left_pad"]


def _sample(logits: torch.Tensor, params: SamplingParams,
            u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row from float32 ``logits`` [B, V]; return (tokens [B], their log-probs [B], the kept
    log-mass [B]).

    ``u`` [B] holds one uniform draw in [0, 1) per row (unused when greedy). A row's token is the inverse CDF of
    its filtered distribution (:func:`postrl.models.filter_logits`) at ``u``, so a row's sample depends only on its
    own logits and its own draw, not on which other rows share the batch. kept log-mass log M = logsumexp over the
    kept tokens - logsumexp over all (0 without a filter); the log-prob is log_softmax(logits / T) at the token
    (``params.logprobs='full'``) or that minus log M (``'filtered'``: the distribution the token was drawn from).
    """
    if params.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1), torch.zeros(len(tokens), device=logits.device)

    if logits.device.type == "cpu" and not params.filters:
        tokens, logp = _sample_plain(logits, params.temperature, u)
        return tokens, logp, torch.zeros(len(tokens))
    scaled = logits if params.temperature == 1.0 else logits / params.temperature
    logz = torch.logsumexp(scaled, dim=-1)
    filtered = filter_logits(scaled, params.top_p, params.top_k)
    vocab = scaled.shape[-1]
    cdf = torch.softmax(filtered, dim=-1).double().cumsum(dim=-1)
    # First token whose CDF exceeds u * total: never a zero-probability token (its CDF does not rise).
    target = u.double()[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    kept = torch.logsumexp(filtered, dim=-1) - logz if filtered is not scaled else torch.zeros_like(logz)
    logp = scaled.gather(1, tokens[:, None]).squeeze(1) - logz
    return tokens, (logp - kept if params.logprobs == "filtered" else logp), kept


def _sample_plain(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sample` with neither top-k nor top-p, for CPU logits, in numpy: the same draw (the first token whose
    cumulative probability, summed in float64, exceeds ``u`` times the total) and the same log-prob
    (``log_softmax(logits / temperature)`` at the token), at a fraction of the cost of a dozen torch operators
    (8 x 88 logits: 15 vs 35-95 us a step)."""
    x = logits.numpy()
    if temperature != 1.0:
        x = x / np.float32(temperature)
    z = x - x.max(-1, keepdims=True)
    e = np.exp(z)
    cdf = np.cumsum(e, axis=-1, dtype=np.float64)  # unnormalised: the target is scaled by the total instead
    target = u.numpy().astype(np.float64) * cdf[:, -1]
    tokens = np.minimum((cdf <= target[:, None]).sum(-1), x.shape[-1] - 1)  # searchsorted(right=True)
    logp = z[np.arange(len(z)), tokens] - np.log(e.sum(-1))
    return torch.from_numpy(tokens), torch.from_numpy(logp)


class _HFStepper:
    """Incremental decoding through the model's own forward with a transformers ``DynamicCache``."""

    compact_below = 1.0  # drop finished rows as soon as any finishes (the cache is re-sliced, not copied in full)

    def __init__(self, gen: HFGenerator, ids: torch.Tensor, mask: torch.Tensor, max_new: int):
        self.gen = gen
        self.width = ids.shape[1]
        # The attention mask for the whole run, filled in one column per step.
        self.attn = torch.zeros((ids.shape[0], self.width + max_new), dtype=torch.long, device=ids.device)
        self.attn[:, : self.width] = mask
        self.t = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.first_logits, self.cache = gen._forward(ids, mask, positions, gen._new_cache())
        self.can_compact = self._can_compact(self.cache)

    @staticmethod
    def _can_compact(cache) -> bool:
        """Finished rows can be dropped from caches whose every layer is a plain (or sliding) dynamic KV layer."""
        try:
            from transformers.cache_utils import DynamicLayer
        except ImportError:  # pragma: no cover - older transformers
            return False
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(isinstance(layer, DynamicLayer) for layer in layers)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        col = self.width + self.t
        self.t += 1
        self.attn[:, col] = live.long()
        logits, self.cache = self.gen._forward(tokens[:, None], self.attn[:, : col + 1], positions[:, None], self.cache)
        return logits

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.attn = self.attn[idx]


class HFGenerator(GenerationBackend):
    """Generate with a Hugging Face causal LM (``model(input_ids, attention_mask, position_ids, cache)``, the
    cache named ``past_key_values`` before transformers 5.24).

    ``batch_size`` caps the rows (prompts x n) run through the model at once; ``None`` runs all rows together.
    Results depend on ``seed`` but not on ``batch_size`` (up to float noise in batched matmuls).

    ``decoder``: ``decoder(model)`` builds, once per :meth:`generate` call, the object that runs the prefill and
    decode steps instead of the model's forward (the speed layer's
    :class:`~postrl.accel.decoder.StaticDecoder`): it has ``stepper(rows, ids, mask, max_new)`` (an object like
    ``_HFStepper``) and ``threads(n)`` (a context for the body's thread count). ``None``: the model's own forward
    with a ``DynamicCache``. Both compute the same tokens and log-probs up to float rounding.
    ``threads``: an object whose ``use("generation", rows=, work=)`` context sets the torch threads while generating
    (:class:`~postrl.accel.cpu.ThreadPolicy`), or ``None`` to leave the current setting.
    Without ``decoder`` and ``threads`` this is plain Hugging Face decoding.
    """

    def __init__(self, model, tokenizer, batch_size: int | None = None, *, decoder=None, threads=None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        self.eos_ids = self._eos_ids(model, tokenizer)
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
            params = {}
        self._logits_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._cache_kw = cache_keyword(model) or "past_key_values"
        self.decoder = decoder
        self.threads = threads

    @staticmethod
    def _eos_ids(model, tokenizer) -> list[int]:
        """The tokenizer's EOS plus any EOS ids in the model's generation config (as ``model.generate`` uses)."""
        ids: list[int] = []
        for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
            if source is None:
                continue
            for i in source if isinstance(source, (list, tuple)) else [source]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    def sync_weights(self, model: torch.nn.Module) -> None:
        """No-op: the generator shares the training module, so it always sees the current weights."""

    # ------------------------------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams,
                 seed: int | list[int]) -> Generation:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if params.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if params.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {params.top_k}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        return self._generate(prompt_ids, n, params, seed)

    def _generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, seed: int | list[int]) -> Generation:
        rows = [list(p) for p in prompt_ids for _ in range(n)]
        num_rows = len(rows)
        all_prompt_ids, all_prompt_mask = left_pad(rows, self.pad_id)
        max_new = params.max_new_tokens
        comp_ids = torch.full((num_rows, max(max_new, 1)), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((num_rows, max(max_new, 1)), dtype=torch.float32)
        kept = torch.zeros((num_rows, max(max_new, 1)), dtype=torch.float32)
        lengths = torch.zeros(num_rows, dtype=torch.long)
        ended = torch.zeros(num_rows, dtype=torch.bool)

        model = self.model
        device = self._device()
        chunk = self.batch_size or max(num_rows, 1)
        was_training = model.training
        threads = self.threads.use("generation", rows=chunk, work=num_rows * max(max_new, 1)) \
            if self.threads is not None else nullcontext()
        try:
            decoder = self.decoder(model) if self.decoder is not None and max_new > 0 else None
            if decoder is None:  # the model's forward runs: eval mode (no dropout); the static decoder has none
                model.eval()
            with torch.inference_mode(), threads as n_threads, \
                    decoder.threads(n_threads or torch.get_num_threads()) if decoder is not None else nullcontext():
                # One uniform draw per (row, step), taken up front: a row's samples depend on the seed and its own
                # logits only, not on batch_size or on which rows have already finished.
                noise = None
                if params.temperature > 0 and max_new > 0:
                    seeds = [int(s) for s in seed] if isinstance(seed, (list, tuple)) else [int(seed)]
                    if len(seeds) > 1 and len(seeds) != len(prompt_ids):
                        raise ValueError(f"got {len(seeds)} seeds for {len(prompt_ids)} prompts")
                    blocks = []
                    for s in seeds:  # one seed per prompt: its samples do not depend on the other prompts
                        gen = torch.Generator(device=device)
                        gen.manual_seed(s)
                        blocks.append(torch.rand((num_rows // len(seeds), max_new), generator=gen, device=device))
                    noise = torch.cat(blocks)
                for start in range(0, num_rows, chunk):
                    end = min(start + chunk, num_rows)
                    c_ids, c_lp, c_km, c_len, c_end = self._generate_chunk(
                        rows[start:end], params, None if noise is None else noise[start:end], device, decoder
                    )
                    comp_ids[start:end] = c_ids
                    logprobs[start:end] = c_lp
                    kept[start:end] = c_km
                    lengths[start:end] = c_len
                    ended[start:end] = c_end
        finally:
            if model.training != was_training:
                model.train(was_training)

        width = max(int(lengths.max()) if num_rows else 0, 1)
        comp_ids = comp_ids[:, :width].clone()
        logprobs = logprobs[:, :width].clone()
        kept = kept[:, :width].clone() if params.filters else None
        completion_mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
        texts = [self._text(comp_ids[i, : int(lengths[i])].tolist(), params.stop) for i in range(num_rows)]
        return Generation(
            prompt_ids=all_prompt_ids,
            prompt_mask=all_prompt_mask,
            completion_ids=comp_ids,
            completion_mask=completion_mask,
            logprobs=logprobs,
            truncated=~ended,
            texts=texts,
            kept_logmass=kept,
        )

    # ------------------------------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        dev = getattr(self.model, "device", None)
        if isinstance(dev, torch.device):
            return dev
        try:
            return next(self.model.parameters()).device
        except StopIteration:  # pragma: no cover - a model without parameters
            return torch.device("cpu")

    def _text(self, tokens: list[int], stop: list[str]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

    def _hit_stop(self, tokens: list[int], stop: list[str]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in stop if s)

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_kw: cache},
            **self._logits_kw,
        )
        return out.logits[:, -1, :].float(), output_cache(out)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _generate_chunk(self, rows: list[list[int]], params: SamplingParams, noise: torch.Tensor | None, device,
                        decoder=None):
        """Generate for one chunk of rows; returns (ids [B, M], logprobs [B, M], kept log-mass [B, M], lengths [B],
        ended [B]) on CPU."""
        num = len(rows)
        max_new = params.max_new_tokens
        out_ids = torch.full((num, max(max_new, 1)), self.pad_id, dtype=torch.long)
        out_lp = torch.zeros((num, max(max_new, 1)), dtype=torch.float32)
        out_km = torch.zeros((num, max(max_new, 1)), dtype=torch.float32)
        ended = torch.zeros(num, dtype=torch.bool)
        if max_new == 0 or num == 0:
            return out_ids, out_lp, out_km, torch.zeros(num, dtype=torch.long), ended

        ids, mask = left_pad(rows, self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        stepper = decoder.stepper(rows, ids, mask, max_new) if decoder is not None \
            else _HFStepper(self, ids, mask, max_new)
        logits = stepper.first_logits
        compact = stepper.can_compact
        next_pos = mask.sum(-1)  # position of the next token in each row
        rows_idx: torch.Tensor | None = None  # original row of each running row (None: all rows, in order)
        live = torch.ones(num, dtype=torch.bool, device=device)  # rows still generating in the running batch
        all_live = True
        eos = torch.tensor([] if params.ignore_eos else self.eos_ids, dtype=torch.long, device=device)
        stops = [s for s in params.stop if s]
        # Host-side copy of every row's sampled tokens, for stop-string checks.
        history: list[list[int]] = [[] for _ in range(num)]
        # Sampled tokens / log-probs by (original row, step), on the device; cut to each row's length at the end.
        tok_buf = torch.full((num, max_new), self.pad_id, dtype=torch.long, device=device)
        lp_buf = torch.zeros((num, max_new), dtype=torch.float32, device=device)
        km_buf = torch.zeros((num, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((num,), max_new, dtype=torch.long)  # rows that never finish run to max_new

        for t in range(max_new):
            u = None if noise is None else (noise[:, t] if rows_idx is None else noise[rows_idx, t])
            tokens, lp, kept = _sample(logits, params, u)
            if rows_idx is None:
                tok_buf[:, t] = tokens
                lp_buf[:, t] = lp.float()
                km_buf[:, t] = kept.float()
            else:
                tok_buf[rows_idx, t] = tokens
                lp_buf[rows_idx, t] = lp.float()
                km_buf[rows_idx, t] = kept.float()

            done = torch.isin(tokens, eos) & live if eos.numel() else None
            if stops:
                done = torch.zeros_like(live) if done is None else done
                done_cpu = done.cpu()
                tok_cpu = tokens.cpu().tolist()
                sel = live.nonzero().squeeze(1).tolist()
                orig = sel if rows_idx is None else rows_idx[sel].tolist()
                for k, r in zip(sel, orig):
                    history[r].append(tok_cpu[k])
                    if not done_cpu[k] and self._hit_stop(history[r], stops):
                        done[k] = True
            if done is None or not bool(done.any()):
                if t == max_new - 1:
                    break
                logits = stepper.decode(tokens if all_live else torch.where(live, tokens, self.pad_id), next_pos,
                                        live)
                next_pos = next_pos + 1
                continue

            finished = done.nonzero().squeeze(1)
            orig = (finished if rows_idx is None else rows_idx[finished]).cpu()
            lengths[orig] = t + 1
            ended[orig] = True
            keep = live & ~done
            n_keep = int(keep.sum())
            if t == max_new - 1 or n_keep == 0:
                break
            if compact and n_keep <= stepper.compact_below * len(keep):
                idx = keep.nonzero().squeeze(1)
                stepper.select(idx)
                base = torch.arange(num, device=device) if rows_idx is None else rows_idx
                rows_idx, tokens, next_pos = base[idx], tokens[idx], next_pos[idx]
                live = torch.ones(len(idx), dtype=torch.bool, device=device)
                all_live = True
            else:
                live, all_live = keep, False
            logits = stepper.decode(tokens if all_live else torch.where(live, tokens, self.pad_id), next_pos, live)
            next_pos = next_pos + 1

        keep_col = torch.arange(max_new)[None, :] < lengths[:, None]
        out_ids[:, :max_new] = torch.where(keep_col, tok_buf.cpu(), self.pad_id)
        out_lp[:, :max_new] = torch.where(keep_col, lp_buf.cpu(), 0.0)
        out_km[:, :max_new] = torch.where(keep_col, km_buf.cpu(), 0.0)
        return out_ids, out_lp, out_km, lengths, ended
