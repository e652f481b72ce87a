"""Adapter for reasoning-gym's procedural datasets (``pip install 'postrl[reasoning]'``).

``reasoning_gym.create_dataset(dataset, size=size, seed=...)`` builds ``size`` problems; the ~10% whose
question hashes to ``stable_hash(question) % 10 == 0`` are the evaluation split, the rest are trained on in a
seeded permutation per epoch (as for files). Rows carry the entry as JSON (``rg_entry``) so that the static
``verify`` can call the dataset's own ``score_answer(answer, entry)`` without keeping the dataset object.

``reasoning_gym`` is imported on first use, never when postrl is imported.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Annotated, Any

from annotated_types import Ge, MinLen
from pydantic import AfterValidator

from postrl.data.base import PromptSource
from postrl.seeding import stable_hash
from postrl.data.tasks import is_held_out
from postrl.errors import ConfigError, DataError
from postrl.registry import register


def _import_rg() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(
            "task 'reasoning_gym' needs the reasoning-gym package; pip install 'postrl[reasoning]'"
        ) from None
    return reasoning_gym


def _dataset_names(rg: Any) -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _create(dataset: str, config: dict, size: int, seed: int) -> Any:
    rg = _import_rg()
    valid = _dataset_names(rg)
    if dataset not in valid:
        few = ", ".join(valid[:12])
        raise DataError(
            f"task 'reasoning_gym': unknown dataset '{dataset}'; valid include: {few} ... ({len(valid)} in all)"
        )
    try:
        return rg.create_dataset(dataset, **config, size=size, seed=seed)
    except (TypeError, AssertionError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"task 'reasoning_gym': invalid config {config} for dataset '{dataset}' ({msg})") from None


def _encode(obj: Any) -> Any:
    """``obj`` as plain JSON data; tuples, sets and non-string-keyed dicts are tagged so they come back as such.

    Scorers compare metadata with ``==`` (e.g. ARC boards are tuples of tuples), so a plain JSON round trip,
    which turns tuples into lists, would mark correct answers wrong.
    """
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x) for x in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"__set__": [_encode(x) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x) for x in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _decode_hook(d: dict) -> Any:
    if len(d) == 1:
        if "__tuple__" in d:
            return tuple(d["__tuple__"])
        if "__set__" in d:
            return set(d["__set__"])
        if "__dict__" in d:
            return {(tuple(k) if isinstance(k, list) else k): v for k, v in d["__dict__"]}
    return d


def entry_to_json(entry: dict) -> str:
    """A reasoning-gym entry as a JSON string that :func:`entry_from_json` restores (tuples included)."""
    return json.dumps(_encode(entry))


def entry_from_json(text: str) -> dict:
    return json.loads(text, object_hook=_decode_hook)


@functools.lru_cache(maxsize=64)
def _score_fn(dataset: str, config_json: str) -> Any:
    """The ``score_answer`` of a dataset built with the run's config (some scorers read their config)."""
    return _create(dataset, json.loads(config_json), size=1, seed=0).score_answer


def _dataset_options(config: dict) -> dict:
    """the dataset's options, without size and seed (task parameters)"""
    for key in ("size", "seed"):
        if key in config:
            raise ValueError(f"set '{key}' as a task parameter, not inside config")
    return config


@register("task", "reasoning_gym", source="reasoning-gym (Stojanovski et al. 2025)")
class ReasoningGymSource(PromptSource):
    """Problems from a reasoning-gym dataset, scored by that dataset's score_answer."""

    name = "reasoning_gym"

    def __init__(self, *, dataset: Annotated[str, MinLen(1)], size: Annotated[int, Ge(1)] = 1000, seed_offset: int = 0,
                 config: Annotated[dict[str, Any], AfterValidator(_dataset_options)] | None = None):
        config = dict(config or {})
        self.dataset, self.size, self.seed_offset, self.config = dataset, size, seed_offset, config
        self._config_json = json.dumps(config, sort_keys=True)
        _create(dataset, config, size=1, seed=0)  # fail early on unknown datasets / bad config
        self._splits: dict[int, tuple[list[dict], list[dict]]] = {}
        self._perms: dict[tuple[int, int], list[int]] = {}

    def _rows(self, seed: int) -> tuple[list[dict], list[dict]]:
        """(train, eval) rows of the dataset generated for ``seed``."""
        if seed not in self._splits:
            rg_seed = stable_hash("reasoning_gym", self.dataset, self._config_json, seed + self.seed_offset) % 2**31
            ds = _create(self.dataset, self.config, size=self.size, seed=rg_seed)
            train, held, seen = [], [], set()
            for i in range(self.size):
                row = self._row(ds[i])
                if is_held_out(row["prompt"]):
                    if row["prompt"] not in seen:
                        seen.add(row["prompt"])
                        held.append(row)
                else:
                    train.append(row)
            if not train:
                raise DataError(
                    f"task 'reasoning_gym': dataset '{self.dataset}' size {self.size} left no training rows"
                )
            self._splits = {seed: (train, held)}  # one seed per run; keep memory bounded
            self._perms = {}
        return self._splits[seed]

    def _row(self, entry: dict) -> dict:
        return {
            "prompt": entry["question"],
            "answer": entry["answer"],
            "task": self.name,
            "rg_dataset": self.dataset,
            "rg_config": self._config_json,
            "rg_entry": entry_to_json(entry),
        }

    def train_rows(self, step: int, n: int, seed: int) -> list[dict]:
        train, _ = self._rows(seed)
        out = []
        for pos in range(step * n, step * n + n):
            epoch, i = divmod(pos, len(train))
            perm = self._perms.get((seed, epoch))
            if perm is None:
                perm = list(range(len(train)))
                random.Random(stable_hash(seed, epoch)).shuffle(perm)
                self._perms = {(seed, epoch): perm}
            out.append(dict(train[perm[i]]))
        return out

    def eval_rows(self, n: int, seed: int) -> list[dict]:
        _, held = self._rows(seed)
        return [dict(r) for r in held[:n]]

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        try:
            dataset = row["rg_dataset"]
            entry = entry_from_json(row["rg_entry"])
        except (KeyError, TypeError, ValueError):
            return None
        score = _score_fn(dataset, row.get("rg_config") or "{}")
        try:
            return float(score(completion.strip(), entry))
        except Exception:  # a scorer choking on a malformed answer counts as wrong
            return 0.0
