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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from annotated_types import Ge

from postrl.registry import register
from postrl.reward_models.metrics import UWO_LAMBDA

MAX_MEMBERS = 8
_CACHE_SIZE = 64
_LOCK = threading.RLock()  # one model computes at a time; a concurrent caller waits and then hits the cache
_MODELS: dict[tuple, Any] = {}
_LAST: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_CALIBRATORS: dict[str, Any] = {}


def _device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_cached(path: str, device: str = "cpu"):
    """The reward model / ensemble in ``path`` (loaded once per process, reloaded when re-written)."""
    from postrl.reward_models import load_reward_model

    cfg = Path(path) / "reward_model.json"
    key = (str(path), _device(device), cfg.stat().st_mtime_ns if cfg.is_file() else 0)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_reward_model(path, device=_device(device))
        return _MODELS[key]


def _calibrator(path: str | None):
    if path is None:
        return None
    from postrl.calibration import load_calibrator

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
    from postrl.calibration import step_bucket

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
    from postrl.calibration import ConditionalOT
    from postrl.errors import ConfigError

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
    from postrl.reward_models import aggregate_ensemble, reduce_steps

    model = load_cached(path, device)
    cal = _calibrator(calibrator)
    if calibrator_features == "hidden" and (cal is None or getattr(model, "kind", None) != "prm"):
        from postrl.errors import ConfigError

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
