"""A trained reward model as a reward source: ``model``, and ``model/0`` .. ``model/7`` (ensemble members).

``{name: model, path: rm/}`` loads the folder written by ``postrl rm train`` / ``postrl prm train`` once per
process (:func:`~postrl.reward_models.load_reward_model`; reloaded when the folder is re-written) and scores the
batch's ``prompt + completion`` texts in batches of ``batch_size``. What it returns depends on the model:

* Bradley-Terry, one head: its score.
* ODIN: the quality head only (the length head is dropped, as the paper prescribes).
* ensemble (K heads on one backbone, or K seeds): ``aggregate`` over the K scores -- ``mean`` (default),
  ``min`` (worst-case optimisation) or ``uwo`` (mean - ``uwo_lambda`` * population variance; "Reward Model
  Ensembles Help Mitigate Overoptimization"; uwo_lambda default ``reward_models.metrics.UWO_LAMBDA``, 0.5).
* PRM: with ``reduce`` unset (default), the list of step scores sigmoid(head) of every completion -- the process
  reward convention of :mod:`postrl.rewards.core`: the reward column holds their sum and the scores go to
  ``step_rewards`` [N, S] for the step-level shaping stages. Steps are the trainer's ``steps`` column (the run's
  ``reward.step_delimiter``) when given, else the PRM's own delimiter. With ``reduce`` = ``min`` / ``last`` /
  ``mean`` / ``prod`` it returns that one scalar per completion instead.

**The K scores of an ensemble as K reward columns** (the choice made for ``ensemble_*`` shaping). A reward source
returns one value per completion, so member k of an ensemble is its own registered source ``model/k``
(k = 0..7; column k of the ensemble's K scores). Listing them with the same ``path`` gives K reward columns named
``model/0`` .. ``model/K-1``, which ``ensemble_mean`` / ``ensemble_min`` / ``ensemble_uwo`` read through their
``sources`` option; the model still runs once per batch (scores are cached per process and model for the
recent batches)::

    rewards:
      - {name: model/0, path: rm/}
      - {name: model/1, path: rm/}
      - {name: model/2, path: rm/}
    shaping:
      - {name: ensemble_min, sources: [model/0, model/1, model/2]}
      - {name: weighted_sum}

**Calibration at reward time.** ``calibrator: cal.json`` (written by ``postrl calibrate``) maps the scalar -- or,
for a PRM, every step score with the condition ``step_bucket(step index, step_buckets)`` (default 4: steps
0, 1, 2, 3, 4+) -- to a calibrated probability; with ``calibrator_features: hidden`` a ``conditional_ot``
calibrator also reads the PRM's hidden state at each step end.

**Two more sources read reward-model folders.** ``model_online`` (:class:`OnlineRewardModel`, "Cooper") is ``model``
for a Bradley-Terry model that keeps training during RL on pairs of a verifier-correct and a verifier-incorrect
completion of the same prompt, one optimizer step per RL step, its weights and optimizer in the checkpoint.
``cloud`` (:func:`cloud_reward`, "Critique-out-Loud Reward Models") scores a model trained with critiques
(``postrl rm train --critic``): the mean over ``samples`` critiques of the score of prompt + completion + critique.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from annotated_types import Ge, Gt, Le

from postrl import jsonstate
from postrl.io import load_once
from postrl.registry import register
from postrl.reward_models.metrics import UWO_LAMBDA, aggregate_ensemble
from postrl.stages import StepEnd, Stateful
from postrl.calibration import ConditionalOT, load_calibrator, step_bucket
from postrl.errors import ConfigError
from postrl.reward_models.critique import Critic, cloud_scores

MAX_MEMBERS = 8
_CACHE_SIZE = 64
_LOCK = threading.RLock()  # one model computes at a time
_LAST: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_CALIBRATORS: dict[str, Any] = {}


def _device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_cached(path: str, device: str = "cpu"):
    """The reward model / ensemble in ``path`` (loaded once per process, reloaded when re-written)."""
    # lazy: postrl.reward_models.model loads transformers, which the rewards package does not need
    from postrl.reward_models import load_reward_model

    return load_once(Path(path) / "reward_model.json", lambda: load_reward_model(path, device=_device(device)),
                     "reward_model", _device(device))


def _calibrator(path: str | None):
    if path is None:
        return None

    with _LOCK:
        if path not in _CALIBRATORS:
            _CALIBRATORS[path] = load_calibrator(path)
        return _CALIBRATORS[path]


def raw_scores(path: str, prompts, completions, *, steps=None, batch_size: int = 32, device: str = "cpu"
               ) -> torch.Tensor:
    """[N, K] scores of an outcome model / ensemble, or [N, S] step scores of a PRM (NaN padded); cached."""
    model = load_cached(path, device)
    key = (id(model), batch_size, tuple(prompts), tuple(completions),
           None if steps is None else tuple(tuple(s) for s in steps))
    with _LOCK:
        if key in _LAST:
            _LAST.move_to_end(key)
            return _LAST[key]
        if getattr(model, "kind", None) == "prm":
            out = model.step_scores(list(prompts), list(completions), batch_size, steps=steps)
        else:
            out = model.score(list(prompts), list(completions), batch_size)
        _LAST[key] = out
        while len(_LAST) > _CACHE_SIZE:
            _LAST.popitem(last=False)
    return out


def step_scores_hidden(path: str, prompts, completions, *, steps=None, batch_size: int = 32, device: str = "cpu"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A PRM's ([N, S] step scores, [N, S, hidden] hidden states at the step ends), NaN padded; cached."""
    model = load_cached(path, device)
    key = ("hidden", id(model), batch_size, tuple(prompts), tuple(completions),
           None if steps is None else tuple(tuple(s) for s in steps))
    with _LOCK:
        if key in _LAST:
            _LAST.move_to_end(key)
            return _LAST[key]
        out = model.step_scores(list(prompts), list(completions), batch_size, steps=steps, return_hidden=True)
        _LAST[key] = out
        while len(_LAST) > _CACHE_SIZE:
            _LAST.popitem(last=False)
    return out


def _calibrate_steps(steps: torch.Tensor, cal, step_buckets: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
    s = steps.numpy().astype(np.float64)
    ok = ~np.isnan(s)
    if ok.any():
        cond = np.array([[step_bucket(j, step_buckets) for j in range(s.shape[1])]] * s.shape[0])
        extra = {} if hidden is None else {"features": hidden.numpy().astype(np.float64)[ok]}
        s[ok] = cal.apply(s[ok], cond[ok], **extra)
    return torch.from_numpy(s).float()


def _check_feature_calibrator(cal, path: str, calibrator: str, width: int) -> None:
    """``calibrator_features: hidden`` needs a conditional_ot calibrator fitted on as many features as the PRM's
    hidden state has."""
    if not isinstance(cal, ConditionalOT):
        raise ConfigError(f"rewards.model.calibrator_features: hidden needs a conditional_ot calibrator (postrl "
                          f"calibrate --method conditional_ot --features-field features), '{calibrator}' is "
                          f"{getattr(cal, 'method', type(cal).__name__)}")
    if cal.n_features != width:
        raise ConfigError(f"rewards.model.calibrator_features: '{calibrator}' was fitted on {cal.n_features} "
                          f"features per row, the PRM '{path}' has a hidden state of {width} (write the rows with "
                          f"postrl prm train --calibration-out ... --calibration-features)")


def _score(path, prompts, completions, steps, *, member, aggregate, uwo_lambda, reduce, calibrator, step_buckets,
           batch_size, device, calibrator_features: str = "none") -> list:
    # lazy: postrl.reward_models.model loads transformers
    from postrl.reward_models import reduce_steps

    model = load_cached(path, device)
    if (getattr(model, "meta", None) or {}).get("critique"):
        raise ConfigError(f"rewards.model.path: '{path}' was trained on critiques (postrl rm train --critic): it "
                          f"reads prompt + response + critique; score with the reward 'cloud'")
    cal = _calibrator(calibrator)
    if calibrator_features == "hidden" and (cal is None or getattr(model, "kind", None) != "prm"):
        raise ConfigError("rewards.model.calibrator_features: hidden needs a PRM (postrl prm train) and a "
                          "'calibrator'")
    if getattr(model, "kind", None) == "prm":
        if calibrator_features == "hidden":
            sc, hid = step_scores_hidden(path, prompts, completions, steps=steps, batch_size=batch_size,
                                         device=device)
            _check_feature_calibrator(cal, path, calibrator, hid.shape[-1])
            sc = _calibrate_steps(sc, cal, step_buckets, hid)
        else:
            sc = raw_scores(path, prompts, completions, steps=steps, batch_size=batch_size, device=device)
        if cal is not None and calibrator_features != "hidden":
            sc = _calibrate_steps(sc, cal, step_buckets)
        if reduce is not None:
            return reduce_steps(sc, reduce).tolist()
        return [[v for v in row if v == v] or None for row in sc.tolist()]  # no step -> None (a failed entry)
    sc = raw_scores(path, prompts, completions, batch_size=batch_size, device=device)
    if member is not None:
        if not 0 <= member < sc.shape[1]:
            raise ValueError(f"reward model '{path}' has {sc.shape[1]} scores; member {member} does not exist")
        out = sc[:, member]
    else:
        out = aggregate_ensemble(sc, aggregate, uwo_lambda) if sc.shape[1] > 1 else sc[:, 0]
    if cal is not None:
        out = torch.from_numpy(np.asarray(cal.apply(out.numpy()), dtype=np.float32))
    return out.tolist()


@register("reward", "model", source="a trained reward model (postrl rm train / prm train)")
def model_reward(prompts, completions, steps=None, *, path: str, aggregate: Literal["mean", "min", "uwo"] = "mean",
                 uwo_lambda: Annotated[float, Ge(0)] = UWO_LAMBDA, member: Annotated[int, Ge(0)] | None = None,
                 reduce: Literal["min", "last", "mean", "prod"] | None = None, calibrator: str | None = None,
                 step_buckets: Annotated[int, Ge(1)] = 4, batch_size: Annotated[int, Ge(1)] = 32,
                 device: str = "cpu", calibrator_features: Literal["none", "hidden"] = "none"):
    """Score of a trained reward model, ensemble (aggregate mean|min|uwo) or PRM (step scores, or reduce).

    See the module docstring for what is returned per model kind. Defaults: aggregate 'mean', uwo_lambda UWO_LAMBDA (0.5),
    member None (aggregate all), reduce None (PRM: step scores), calibrator None, step_buckets 4,
    batch_size 32, device 'cpu' ('auto': CUDA when available).
    ``calibrator_features: hidden`` (a PRM with a ``conditional_ot`` calibrator): each step score is calibrated
    conditioned on the PRM's hidden state at that step's end as well as its step bucket, what "Distributional
    Process Reward Models" conditions its quantile function on (the calibrator must be fitted with those
    features: ``postrl prm train --calibration-out rows.jsonl --calibration-features`` then ``postrl calibrate
    rows.jsonl --method conditional_ot --features-field features``); the calibrated value is the conditional
    mean. Default 'none': score and step bucket only.
    """
    return _score(path, prompts, completions, steps, member=member, aggregate=aggregate, uwo_lambda=uwo_lambda,
                  reduce=reduce, calibrator=calibrator, step_buckets=step_buckets, batch_size=batch_size,
                  device=device, calibrator_features=calibrator_features)


def _member_source(k: int):
    def member_reward(prompts, completions, *, path: str, calibrator: str | None = None,
                      batch_size: Annotated[int, Ge(1)] = 32, device: str = "cpu"):
        return _score(path, prompts, completions, None, member=k, aggregate="mean", uwo_lambda=1.0, reduce=None,
                      calibrator=calibrator, step_buckets=4, batch_size=batch_size, device=device)

    member_reward.__doc__ = (f"Member {k} of a reward-model ensemble (column {k} of its K scores); list "
                             f"model/0..model/K-1 to get K reward columns for ensemble_* shaping.")
    member_reward.__qualname__ = f"member_reward_{k}"
    return member_reward


for _k in range(MAX_MEMBERS):
    register("reward", f"model/{_k}", source="Reward Model Ensembles Help Mitigate Overoptimization (one member)")(
        _member_source(_k))


# ================================================================================================ model_online (Cooper)

def _folder_kind(path: str) -> str | None:
    """The ``kind`` in a reward-model folder's reward_model.json (None when it cannot be read)."""
    import json

    try:
        return json.loads((Path(path) / "reward_model.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def _online_check(params: dict, run, where: str) -> dict:
    """The run must have the verifier that labels the pairs, and the folder must hold an outcome model."""
    verifier = params.get("verifier", "correct")
    if run is not None:
        names = [r.name for r in run.rewards]
        if verifier not in names or verifier == "model_online":
            raise ConfigError(
                f"{where}: model_online cannot train its reward model online: no verifier to label the pairs "
                f"('{verifier}' is not a reward source of this run; rewards: {', '.join(names)}); add "
                f"{{name: {verifier}, weight: 0}} to rewards (weight 0 labels pairs without entering the reward) or "
                f"set verifier to the run's verifiable reward")
    kind = _folder_kind(str(params.get("path", "")))
    if kind in ("prm", "seed_ensemble"):
        what = "a process reward model (postrl prm train)" if kind == "prm" else "an ensemble of seeds"
        raise ConfigError(f"{where}.path: '{params.get('path')}' is {what}; model_online continues Bradley-Terry "
                          f"training of one outcome model (postrl rm train, optionally --heads K or --odin)")
    return params


@register("reward", "model_online", source="Cooper: Co-Optimizing Policy and Reward Models in Reinforcement "
          "Learning for Large Language Models", check=_online_check)
class OnlineRewardModel(Stateful):
    """The ``model`` reward whose reward model keeps training during RL on verifier-labelled pairs (Cooper).

    Scoring: as ``model`` for a Bradley-Terry model (K heads aggregated by ``aggregate``; ODIN's quality head),
    with the weights as they are at the start of the step. Learning, once per training step:

    * ``observe`` (each batch that trains): per prompt (``group_ids``), the completions the verifier (the reward
      column ``verifier``, default ``correct``, before shaping) scores >= ``threshold`` are correct (set C), those
      below it incorrect (set W); a NaN verifier value labels nothing. Of the pairs C x W, the ``max_pairs``
      (default 1) with the largest r(w) - r(c) under the current model are recorded as (prompt, chosen = c,
      rejected = w): the pairs the reward model ranks worst, where the policy's wrong answers fool it (ties: batch
      order of c, then of w). A prompt without both a correct and an incorrect completion gives none.
    * ``end_step``: the pairs of every process (gathered, in rank order) make one AdamW step (``lr`` 1e-5,
      ``weight_decay`` 0, gradient norm clipped to ``max_grad_norm`` 1.0) on the mean Bradley-Terry loss
          L = (1 / P) sum_i -log sigma(r(c_i) - r(w_i))         (mean over heads; ODIN: r = Q + L plus its
                                                               length and orthogonality terms, weights 1.0)
      (:func:`postrl.reward_models.train.online_step`, micro-batches of ``batch_size`` pairs), so every process
      holds the same weights. Metrics ``reward/model_online/{pairs, loss, pair_accuracy, grad_norm, updates}``
      (loss and accuracy before the step). A step without pairs changes nothing.

    The reward model is loaded from ``path`` (a folder of ``postrl rm train``) into this stage alone (never the
    shared cache of ``model``); its weights and AdamW state are the stage's checkpoint state (``state_dict``,
    tensors through :mod:`postrl.jsonstate`), so a resumed run continues with the co-trained model exactly.

    After "Cooper" (abstract: it "leverages the high precision of rule-based rewards when identifying correct
    responses, and dynamically constructs and selects positive-negative sample pairs for continued training the
    reward model"). Assumed where the abstract is silent or postrl differs: the negatives are the policy's own
    verifier-incorrect completions of the same prompt (the paper has an assistant LLM write them), selected as the
    pairs the current model ranks worst; the update is the Bradley-Terry loss, one optimizer step per RL step; the
    reward model reads prompt + completion (the paper's VerifyRM also reads the reference answer: put it in the
    prompt to match). Needs a verifier among the run's rewards (give it weight 0 to use it only for labelling):
    without one the config is refused in one line naming this entry.
    Shapes: prompts / completions [N] texts -> [N] scores; observe reads group_ids [N], raw_rewards [N, K0] and
    raw_reward_names (K0 names).
    """

    def __init__(self, *, path: str, verifier: str = "correct", threshold: float = 1.0,
                 max_pairs: Annotated[int, Ge(1)] = 1, lr: Annotated[float, Gt(0)] = 1e-5,
                 weight_decay: Annotated[float, Ge(0)] = 0.0, max_grad_norm: Annotated[float, Gt(0)] | None = 1.0,
                 aggregate: Literal["mean", "min", "uwo"] = "mean", uwo_lambda: Annotated[float, Ge(0)] = UWO_LAMBDA,
                 batch_size: Annotated[int, Ge(1)] = 32, device: str = "cpu"):
        self.path, self.verifier, self.threshold, self.max_pairs = str(path), verifier, float(threshold), max_pairs
        self.lr, self.weight_decay, self.max_grad_norm = lr, weight_decay, max_grad_norm
        self.aggregate, self.uwo_lambda, self.batch_size, self.device = aggregate, uwo_lambda, batch_size, device
        self.model = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.updates = 0
        self._scores: dict[tuple[str, str], float] = {}  # (prompt, completion) -> score under the current weights
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------------------------ the model
    def _ensure(self) -> None:
        # lazy: postrl.reward_models.model loads transformers
        from postrl.reward_models import RewardModel, load_reward_model

        if self.model is not None:
            return
        model = load_reward_model(self.path, device=_device(self.device))
        if (model.meta or {}).get("critique"):
            raise ConfigError(f"rewards.model_online.path: '{self.path}' reads critiques (postrl rm train --critic); "
                              f"model_online trains a reward model on prompt + completion")
        if not isinstance(model, RewardModel) or model.kind not in ("bt", "odin"):
            kind = getattr(model, "kind", type(model).__name__)
            raise ConfigError(f"rewards.model_online.path: '{self.path}' is a '{kind}' model; model_online continues "
                              f"Bradley-Terry training of one outcome model (postrl rm train)")
        body = [p for n, p in model.named_parameters() if not n.startswith("beta_raw") and p.requires_grad]
        self.model = model.eval()
        self.optimizer = torch.optim.AdamW(body, lr=self.lr, weight_decay=self.weight_decay)

    def scores(self, prompts, completions) -> torch.Tensor:
        """[N] scores under the current weights (a K-head model aggregated; cached until the next update)."""
        with self._lock:
            self._ensure()
            keys = list(zip(prompts, completions))
            todo = list(dict.fromkeys(k for k in keys if k not in self._scores))
            if todo:
                sc = self.model.score([p for p, _ in todo], [c for _, c in todo], self.batch_size)
                agg = aggregate_ensemble(sc, self.aggregate, self.uwo_lambda) if sc.shape[1] > 1 else sc[:, 0]
                self._scores.update(zip(todo, agg.tolist()))
            return torch.tensor([self._scores[k] for k in keys], dtype=torch.float32)

    def __call__(self, prompts, completions):
        return self.scores(prompts, completions).tolist()

    # ------------------------------------------------------------------------------------------------ learning
    def pairs(self, prompts, completions, group_ids, label: torch.Tensor) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) of each group: see the class docstring (``label``: the verifier's values)."""
        s = self.scores(prompts, completions)
        out = []
        gids = [int(g) for g in torch.as_tensor(group_ids).tolist()]
        for g in dict.fromkeys(gids):
            rows = [i for i, x in enumerate(gids) if x == g]
            good = [i for i in rows if math.isfinite(float(label[i])) and float(label[i]) >= self.threshold]
            bad = [i for i in rows if math.isfinite(float(label[i])) and float(label[i]) < self.threshold]
            cand = sorted(((float(s[w] - s[c]), -ci, -wi, c, w) for ci, c in enumerate(good)
                           for wi, w in enumerate(bad)), reverse=True)
            out += [(prompts[c], completions[c], completions[w]) for *_, c, w in cand[:self.max_pairs]]
        return out

    def observe(self, prompts, completions, group_ids, raw_rewards, raw_reward_names) -> None:
        """Record the step's (prompt, correct, incorrect) pairs of a batch that trains."""
        names = list(raw_reward_names)
        if self.verifier not in names:
            raise ConfigError(f"rewards.model_online: no verifier to label pairs: the batch has no reward column "
                              f"'{self.verifier}' (columns: {', '.join(names)})")
        label = raw_rewards[:, names.index(self.verifier)]
        for pair in self.pairs(list(prompts), list(completions), group_ids, label):
            self.record(pair)

    def end_step(self, step: StepEnd) -> dict:
        """One Bradley-Terry step on every process's pairs of this step (see the class docstring)."""
        # lazy: postrl.reward_models.train loads transformers
        from postrl.reward_models.train import online_step

        pairs = list(self.observed)
        if not pairs:
            with self._lock:
                self._scores = {}  # (the cache holds one step's texts at most)
            return {"pairs": 0.0, "updates": float(self.updates)}
        with self._lock:
            self._ensure()
            cfg = (self.model.meta.get("train") or {}).get("config") or {}
            m = online_step(self.model, self.optimizer, [p for p, _, _ in pairs], [c for _, c, _ in pairs],
                            [r for _, _, r in pairs], batch_size=self.batch_size, max_grad_norm=self.max_grad_norm,
                            odin_length_weight=float(cfg.get("odin_length_weight", 1.0)),
                            odin_ortho_weight=float(cfg.get("odin_ortho_weight", 1.0)))
            self.updates += 1
            self._scores = {}
        return {"pairs": float(len(pairs)), **m, "updates": float(self.updates)}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        if self.model is None:
            return {}
        return jsonstate.encode({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                                 "updates": self.updates})

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        st = jsonstate.decode(state)
        with self._lock:
            self._ensure()
            self.model.load_state_dict(st["model"])
            self.optimizer.load_state_dict(st["optimizer"])
            self.updates = int(st["updates"])
            self._scores = {}


# ================================================================================================ cloud (CLoud)

_CRITICS: dict[tuple, Any] = {}


def _cloud_check(params: dict, run, where: str) -> dict:
    k, t = int(params.get("samples", 1)), float(params.get("temperature", 0.0))
    if k > 1 and t <= 0:
        raise ConfigError(f"{where}.temperature: samples={k} critiques need temperature > 0 (greedy decoding writes "
                          f"{k} identical critiques)")
    return params


@register("reward", "cloud", source="Critique-out-Loud Reward Models", check=_cloud_check)
def cloud_reward(prompts, completions, *, path: str, critic: str | None = None, samples: Annotated[int, Ge(1)] = 1,
                 temperature: Annotated[float, Ge(0)] = 0.0, top_p: Annotated[float, Gt(0), Le(1)] = 1.0,
                 max_new_tokens: Annotated[int, Ge(1)] | None = None, seed: int = 0,
                 batch_size: Annotated[int, Ge(1)] = 32, device: str = "cpu"):
    """Critique-out-Loud reward: a critic writes K critiques of the completion, the reward model scores prompt +
    completion + each critique, and the K scores are averaged (self-consistency).

    r(x, y) = (1 / K) sum_k RM(x, y + "\\n\\nCritique:\\n" + z_k), z_k ~ critic(. | request(x, y)), K = ``samples``
    (:mod:`postrl.reward_models.critique`, formula, paper and assumptions there). ``path``: a reward-model folder
    trained with critiques (``postrl rm train --critic SPEC``); ``critic``: a causal-LM folder or
    ``module:function`` (default: the one the folder was trained with); ``max_new_tokens``: critique length
    (default: the training one, else 128); ``temperature`` 0 (greedy; ``samples`` > 1 needs > 0, checked with the
    config), ``top_p`` 1.0, ``seed`` 0 (row i's critiques are seeded by (seed, x_i, y_i): a completion's reward does
    not depend on its batch); a K-head model's heads are averaged. "Critique-out-Loud Reward Models" (CLoud).
    Shapes: prompts / completions [N] -> [N] scores.
    """
    model = load_cached(path, device)
    meta = (getattr(model, "meta", None) or {}).get("critique") or {}
    spec = critic or meta.get("critic")
    if spec is None:
        raise ConfigError(f"rewards.cloud.critic: '{path}' records no critic (it was not trained with postrl rm train "
                          f"--critic); name one: a causal-LM folder or module:function")
    n_new = int(max_new_tokens or meta.get("max_new_tokens") or 128)
    key = (str(spec), n_new, float(temperature), float(top_p), _device(device))
    with _LOCK:
        if key not in _CRITICS:
            _CRITICS[key] = Critic(str(spec), max_new_tokens=n_new, temperature=temperature, top_p=top_p,
                                   chat_template=meta.get("chat_template", "auto"), device=_device(device))
        crit = _CRITICS[key]
        out, _, _ = cloud_scores(model, crit, list(prompts), list(completions), samples=samples, seed=seed,
                                 batch_size=batch_size)
    return out.tolist()
