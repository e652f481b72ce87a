"""Critique-out-Loud reward models: a critique is generated first, the reward head reads prompt + response +
critique, and several sampled critiques' rewards are averaged (self-consistency).

"Critique-out-Loud Reward Models" (CLoud; abstract: CLoud reward models "operate by first generating a natural
language critique of the assistant's response that is then used to predict a scalar reward for the quality of
the response", and the paper explores "self-consistency decoding for reward prediction"). For prompt x,
response y and a critic c(. | x, y):

    z_1..z_K ~ c(. | request(x, y))                           (K = ``samples``; K = 1 and temperature 0: greedy)
    r_k = RM(x, y + MARKER + z_k)                               (the reward head at the last token of the critique)
    r(x, y) = (1 / K) sum_k r_k                                 (self-consistency: the mean over the K critiques)

where ``request(x, y)`` (:func:`critique_request`) asks for a critique of y as an answer to x and ``MARKER`` =
``"\\n\\nCritique:\\n"`` (:func:`with_critique`) joins the response and its critique in the text the reward model
reads. Training (``postrl rm train --critic SPEC``, :func:`attach_critiques`): every chosen and rejected response
of the pair file gets one critique from the critic (greedy by default) and the Bradley-Terry model is trained on
prompt + response + critique; the folder records the critic and its settings (``meta['critique']``), which the
reward ``cloud`` (:mod:`postrl.rewards.model`) reads back, so a reward model trained with critiques is scored with
them (the plain ``model`` reward refuses it).

The critic (``SPEC``): a causal-LM folder (sampled with postrl's HF generator; the request is encoded as a
policy's prompt, with the chat template when the tokenizer has one) or an import path ``module:function`` to
``fn(requests: list[str], n: int, seeds: list[int]) -> list[list[str]]`` (n critiques per request). Row i's
critiques are drawn with seed ``derive_seed(seed, x_i, y_i)``, so a response's critiques, hence its reward, do not
depend on the batch it is scored in.

Assumed where postrl differs from the paper: the paper's critic is the reward model's own LM (fine-tuned on oracle
critiques, then on its own), one network with an LM head and a reward head; here the critic is a separate model
(give the reward model's base model fine-tuned on critiques with ``postrl sft`` to match it), the request
template and marker are postrl's, and the self-consistency aggregate is the mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from postrl.errors import ConfigError
from postrl.generation import SamplingParams, encode_prompt
from postrl.io import load_object
from postrl.models import check_model_folder, load_model_and_tokenizer
from postrl.rollout.hf import HFGenerator
from postrl.seeding import derive_seed

__all__ = ["CRITIQUE_MARKER", "critique_request", "with_critique", "Critic", "attach_critiques", "cloud_scores"]

CRITIQUE_MARKER = "\n\nCritique:\n"
CRITIQUE_INSTRUCTION = "Critique the response above: say what is correct and what is wrong in it, step by step."


def critique_request(prompt: str, response: str) -> str:
    """The critic's prompt: the task, the response, and the instruction to critique it."""
    return f"{prompt}\n\nResponse:\n{response}\n\n{CRITIQUE_INSTRUCTION}"


def with_critique(response: str, critique: str) -> str:
    """The text the reward head reads after the prompt: the response, ``CRITIQUE_MARKER``, the critique."""
    return f"{response}{CRITIQUE_MARKER}{critique}"


class Critic:
    """Generates critiques (see the module docstring): ``critic(prompts, responses, n, seed) -> [N][n] texts``.

    ``spec``: a causal-LM folder or ``module:function``; ``max_new_tokens`` [128], ``temperature`` [0: greedy],
    ``top_p`` [1.0], ``chat_template`` ['auto'], ``batch_size`` [None: all rows at once], ``device`` ['cpu']."""

    def __init__(self, spec: str, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 chat_template: str = "auto", batch_size: int | None = None, device: str = "cpu"):
        self.spec = str(spec)
        self.max_new_tokens, self.temperature, self.top_p = int(max_new_tokens), float(temperature), float(top_p)
        self.chat_template, self.batch_size, self.device = chat_template, batch_size, device
        self._fn: Callable | None = None
        self._gen = None

    def _load(self) -> None:
        if self._fn is not None or self._gen is not None:
            return
        if ":" in self.spec and not Path(self.spec).is_dir():
            self._fn = load_object(self.spec, "critic")
            return

        folder = check_model_folder(self.spec, "critic")
        model, tok = load_model_and_tokenizer(folder, "float32")
        model.to(self.device).eval()
        self._gen = (HFGenerator(model, tok, batch_size=self.batch_size), tok)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], n: int = 1, seed: int = 0) -> list[list[str]]:
        self._load()
        requests = [critique_request(p, r) for p, r in zip(prompts, responses)]
        seeds = [derive_seed(seed, p, r) for p, r in zip(prompts, responses)]
        if not requests:
            return []
        if self._fn is not None:
            out = self._fn(requests, n, seeds)
            if not isinstance(out, list) or len(out) != len(requests) or not all(
                    isinstance(row, list) and len(row) == n and all(isinstance(t, str) for t in row) for row in out):
                raise ConfigError(f"critic '{self.spec}': expected a list of {len(requests)} lists of {n} critique "
                                  f"texts (one list per request)")
            return out

        gen, tok = self._gen
        ids = [encode_prompt(tok, q, self.chat_template) for q in requests]
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)
        res = gen.generate(ids, n, params, seed=seeds)
        return [res.texts[i * n:(i + 1) * n] for i in range(len(requests))]


def attach_critiques(pairs, critic: Critic, *, seed: int = 0, log: Callable[[str], None] | None = None) -> None:
    """Give every pair's chosen and rejected response one critique (in place): ``p.chosen`` becomes
    ``with_critique(chosen, z_c)``, ``p.rejected`` ``with_critique(rejected, z_r)`` (:meth:`Critic.__call__` with
    n = 1, so the critic's own temperature decides greedy or sampled)."""
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    crit = critic(prompts, responses, 1, seed)
    n = len(pairs)
    for i, p in enumerate(pairs):
        p.chosen = with_critique(p.chosen, crit[i][0])
        p.rejected = with_critique(p.rejected, crit[n + i][0])
    if log:
        log(f"critic {critic.spec}: {2 * n} critiques")


def cloud_scores(model, critic: Critic, prompts: Sequence[str], responses: Sequence[str], *, samples: int = 1,
                 seed: int = 0, batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    """(r [N], r_k [N, K], the critiques): the reward head (a K-head model: the mean of its heads; ODIN: the quality
    head) on prompt + response + each of K = ``samples`` critiques, and their mean."""
    crit = critic(prompts, responses, samples, seed)
    flat_p = [p for p, cs in zip(prompts, crit) for _ in cs]
    flat_t = [with_critique(r, c) for r, cs in zip(responses, crit) for c in cs]
    s = model.score(flat_p, flat_t, batch_size) if flat_t else torch.zeros(0, 1)
    per = s.mean(-1).reshape(len(prompts), samples)
    return per.mean(-1), per, crit
