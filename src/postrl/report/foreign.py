"""Reading runs postrl did not train, for ``postrl doctor`` and ``postrl report`` (through
:func:`postrl.report.rundir.load_run`).

* A TRL / transformers ``Trainer`` output folder: ``trainer_state.json`` (its ``log_history``) in the folder itself
  or in its ``checkpoint-*`` folders, whichever has the most steps (a path to a ``trainer_state.json`` or to one
  checkpoint works too). The run's settings (``max_completion_length``, ``num_generations``, ``beta`` ...) come from
  ``training_args.bin`` beside it (or in the output folder), read without executing it: a restricted unpickler
  that builds only plain values (a class it names becomes a plain record of its fields; nothing is imported or
  called).
* verl's metrics as its file logger writes them (``trainer.logger=[file]``: ``$VERL_FILE_LOGGER_PATH``, or
  ``<root>/<project>/<experiment>.jsonl``): one JSON line ``{"step": N, "data": {...}}`` per step; orjson writes NaN
  as null, read back as NaN. A folder holding exactly one such file works too. The file logger records no config,
  so the alarms name verl's options without their values.
* A W&B offline run folder (``wandb/offline-run-*``, a ``run-*.wandb`` file, or a ``wandb`` folder: its latest run),
  read by the wandb package itself offline (``wandb leet inspect --json``; tested with wandb 0.31); its config gives the
  settings. The engine is recognised from the config and the metric names: TRL (transformers' W&B callback logs
  ``train/<name>`` and the ``GRPOConfig``), verl (its config's ``actor_rollout_ref``) or postrl's own W&B sink.

:class:`Foreign` holds the rows in the engine's own names; ``load_run`` translates them to postrl's
(:func:`postrl.diagnostics.engines.translate`).
"""

from __future__ import annotations

import json
import math
import pickle
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from postrl.errors import PostrlError
from postrl.diagnostics.engines import flatten


@dataclass
class Foreign:
    engine: str  # trl | verl | postrl
    source: Path  # the file the metrics were read from
    settings: dict  # the engine's own settings, flat (verl: dotted keys)
    rows: list[dict]  # per logged step, the engine's names, with "step"
    evals: list[dict] = field(default_factory=list)
    finished: bool | None = None  # None: the logs do not say
    steps_planned: int | None = None
    detail: str | None = None  # how the run ended / stands, as the logs say
    notes: list[str] = field(default_factory=list)
    checkpoints: list[tuple[int, Path]] = field(default_factory=list)
    kind: str = ""  # what was read, e.g. "trainer_state.json"


def read(path: str | Path) -> Foreign | None:
    """The run at ``path`` if it is a TRL / transformers, verl file-logger or W&B offline run; None otherwise."""
    p = Path(path)
    for reader in (_trainer_state_file, _wandb_run, _verl_file):
        got = reader(p)
        if got is not None:
            return got
    return None


# ------------------------------------------------------------------------------------------------ TRL / transformers


def _state_files(p: Path) -> list[Path]:
    if p.is_file():
        return [p] if p.name == "trainer_state.json" else []
    if not p.is_dir():
        return []
    out = [p / "trainer_state.json"] if (p / "trainer_state.json").is_file() else []
    out += [d / "trainer_state.json" for d in p.glob("checkpoint-*") if (d / "trainer_state.json").is_file()]
    return out


def _trainer_state_file(p: Path) -> Foreign | None:
    files = _state_files(p)
    if not files:
        return None
    states = []
    for f in files:
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise PostrlError(f"'{f}': not a readable trainer_state.json ({e})") from None
        if not isinstance(s, dict) or not isinstance(s.get("log_history"), list):
            raise PostrlError(f"'{f}': a trainer_state.json without a log_history list")
        states.append((int(s.get("global_step") or 0), f != p / "trainer_state.json", f, s))
    step, _, f, state = max(states, key=lambda x: (x[0], not x[1]))  # most steps; the folder's own on a tie
    out_dir = p if p.is_dir() else f.parent
    settings, how = {}, "no training_args.bin: option values unknown"
    for args_file in (f.parent / "training_args.bin", out_dir / "training_args.bin"):
        if args_file.is_file():
            try:
                settings = read_training_args(args_file)
                how = f"settings from {args_file.parent.name}/{args_file.name}"
            except PostrlError as e:
                how = str(e)
            break
    rows, evals = [], []
    for entry in state["log_history"]:
        if not isinstance(entry, dict) or "step" not in entry:
            continue
        if any(k.startswith("eval_") for k in entry):
            evals.append({"step": entry["step"], **{k[5:]: v for k, v in entry.items() if k.startswith("eval_")}})
        elif not any(k in entry for k in ("train_runtime", "train_loss")):
            rows.append({k: v for k, v in entry.items() if k != "epoch"})
    max_steps = state.get("max_steps")
    planned = int(max_steps) if isinstance(max_steps, int) and max_steps > 0 else None
    finished = planned is not None and step >= planned
    cks = []
    root = out_dir.parent if out_dir.name.startswith("checkpoint-") else out_dir
    for d in root.glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", d.name)
        if m and (d / "trainer_state.json").is_file():
            cks.append((int(m.group(1)), d))
    where = f.parent.name if f.parent.name.startswith("checkpoint-") else "the output folder"
    return Foreign("trl", f, settings, rows, evals, finished=finished, steps_planned=planned,
                   detail=None if finished else f"trainer_state.json ({where}) is at step {step} of "
                   f"{planned if planned is not None else '?'}; the Trainer writes it with each checkpoint",
                   notes=[how] if not settings else [], checkpoints=sorted(cks),
                   kind=f"trainer_state.json of {where}; {how}")


class _Record:
    """What a class named in the pickle becomes: its fields (``__dict__``), never its code."""

    def __new__(cls, *args):  # called for REDUCE (an enum's value) and NEWOBJ
        if args:
            return args[0] if len(args) == 1 else list(args)
        return object.__new__(cls)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


_SAFE = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "list"): list,
         ("builtins", "dict"): dict, ("builtins", "tuple"): tuple, ("collections", "OrderedDict"): dict,
         ("copyreg", "_reconstructor"): lambda cls, base, state: cls()}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE:
            return _SAFE[(module, name)]
        return type(name, (_Record,), {"__module__": "postrl.report.foreign.record"})

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("tensor data in training_args.bin")


def _plain(x):
    if isinstance(x, _Record):
        return {k: _plain(v) for k, v in vars(x).items()}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_plain(v) for v in x]
    return x


def read_training_args(path: str | Path) -> dict:
    """The fields of a ``TrainingArguments`` / ``GRPOConfig`` saved by ``torch.save`` (``training_args.bin``), as
    plain values, without importing or calling anything the file names (:class:`_Unpickler`)."""
    p = Path(path)
    try:
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                if name is None:
                    raise PostrlError(f"'{p}': no data.pkl in the archive")
                data = z.read(name)
        else:
            data = p.read_bytes()
        import io

        obj = _Unpickler(io.BytesIO(data)).load()
    except PostrlError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed file: settings unknown, said in one line
        raise PostrlError(f"'{p}': unreadable training arguments ({type(e).__name__}: {e}); option values "
                          "unknown") from None
    out = _plain(obj)
    if not isinstance(out, dict):
        raise PostrlError(f"'{p}': not a saved TrainingArguments")
    return out


# ------------------------------------------------------------------------------------------------ verl


def _verl_lines(f: Path, first_only: bool = False) -> list[dict] | None:
    """The ``{"step", "data"}`` lines of ``f``, or None if its first JSON line is not one (a line cut by a writer
    in progress is skipped)."""
    rows = []
    try:
        with f.open("rb") as fh:
            for raw in fh:
                raw = raw.strip()
                if not raw:
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if not (isinstance(rec, dict) and isinstance(rec.get("data"), dict) and "step" in rec):
                    if not rows:
                        return None
                    continue
                rows.append(rec)
                if first_only:
                    break
    except OSError:
        return None
    return rows or None


def _verl_file(p: Path) -> Foreign | None:
    if p.is_dir():
        files = [f for f in sorted(p.glob("*.jsonl")) if _verl_lines(f, first_only=True)]
        if not files:
            return None
        if len(files) > 1:
            raise PostrlError(f"'{p}' holds {len(files)} verl metric files ({', '.join(f.name for f in files[:4])}"
                              f"{' ...' if len(files) > 4 else ''}); name one")
        p = files[0]
    if not (p.is_file() and p.suffix in (".jsonl", ".json", ".log")):
        return None
    recs = _verl_lines(p)
    if recs is None:
        return None
    rows = []
    for rec in recs:
        data = {k: (math.nan if v is None else v) for k, v in rec["data"].items()}  # orjson writes NaN as null
        rows.append({**data, "step": rec["step"]})
    return Foreign("verl", p, {}, rows, finished=None, detail="verl's file logger does not record the end of a run",
                   notes=["verl's file logger records no config: its options are named without their values"],
                   kind="file logger JSON lines")


# ------------------------------------------------------------------------------------------------ W&B


def _wandb_target(p: Path) -> Path | None:
    if p.is_file() and p.suffix == ".wandb":
        return p
    if not p.is_dir():
        return None
    if list(p.glob("run-*.wandb")):
        return p
    latest = p / "latest-run"
    if latest.exists() and list(latest.resolve().glob("run-*.wandb")):
        return latest.resolve()
    if (p / "wandb").is_dir():
        return _wandb_target(p / "wandb") if not (p / "config.yaml").is_file() else None
    return None


def _wandb_records(target: Path) -> list[dict]:
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise PostrlError(f"'{target}' is a W&B run: reading it needs the wandb package (pip install wandb)")
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", str(target), "--json"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise PostrlError(f"'{target}': wandb leet inspect did not finish in 300 s") from None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise PostrlError(f"'{target}': the wandb package could not read this run offline (wandb leet inspect: "
                          f"{last}); a wandb version with `wandb leet inspect` (0.31 has it) reads offline runs")
    out = []
    for line in res.stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _wandb_value(v):
    if isinstance(v, dict) and set(v) == {"value"}:
        return v["value"]
    return v


def _wandb_run(p: Path) -> Foreign | None:
    target = _wandb_target(p)
    if target is None:
        return None
    config: dict = {}
    hist: list[dict] = []
    exit_code = None
    source = target if target.is_file() else next(iter(sorted(target.glob("run-*.wandb"))))
    for rec in _wandb_records(target):
        kind = rec.get("type")
        if kind == "run":
            config.update((rec.get("run", {}).get("config") or {}).get("update") or {})
        elif kind == "config":
            config.update((rec.get("config") or {}).get("update") or {})
        elif kind == "history":
            h = rec.get("history") or {}
            item = dict(h.get("item") or {})
            item["_step"] = (h.get("step") or {}).get("num", item.get("_step"))
            hist.append(item)
        elif kind == "exit":
            exit_code = (rec.get("exit") or {}).get("exit_code", 0)
    config = {k: _wandb_value(v) for k, v in config.items() if k != "_wandb"}
    keys = {k for h in hist for k in h}
    if not hist and not config:
        raise PostrlError(f"'{target}': the W&B run has logged nothing yet (a run still open in its process is "
                          "written when it finishes)")

    if "actor_rollout_ref" in config or any(k.startswith(("critic/", "actor/", "response_length/")) for k in keys):
        engine, settings = "verl", flatten(config)
    elif "num_generations" in config or "max_completion_length" in config or "train/global_step" in keys:
        engine, settings = "trl", config
    elif "rollout" in config or "advantage" in config or "reward/mean" in keys:
        engine, settings = "postrl", config
    else:
        raise PostrlError(f"'{target}': a W&B run neither of TRL, verl nor postrl (config keys: "
                          f"{', '.join(sorted(config)[:6]) or 'none'})")
    rows, evals = [], []
    for h in hist:
        metrics = {k: v for k, v in h.items() if not k.startswith("_")}
        if engine == "trl":
            step = metrics.pop("train/global_step", h.get("_step"))
            train = {k[6:]: v for k, v in metrics.items() if k.startswith("train/")}
            ev = {k[5:]: v for k, v in metrics.items() if k.startswith("eval/")}
            if ev:
                evals.append({"step": step, **ev})
            if any(k not in ("epoch", "train_runtime", "train_loss", "train_samples_per_second",
                             "train_steps_per_second", "total_flos") for k in train):
                rows.append({**{k: v for k, v in train.items() if k != "epoch"}, "step": step})
        else:
            rows.append({**metrics, "step": h.get("_step")})
    rows = [r for r in rows if isinstance(r.get("step"), (int, float))]
    for r in rows:
        r["step"] = int(r["step"])
    planned = None
    for k in ("max_steps", "trainer.total_training_steps"):
        if isinstance(settings.get(k), int) and settings[k] > 0:
            planned = settings[k]
    done = max((r["step"] for r in rows), default=0)
    finished = (done >= planned) if planned is not None else (exit_code == 0 if exit_code is not None else None)
    detail = None
    if not finished and exit_code is not None:
        detail = f"the W&B run exited with code {exit_code}" if exit_code else "the W&B run ended before max_steps"
    return Foreign(engine, source, settings, rows, evals, finished=finished, steps_planned=planned, detail=detail,
                   kind=f"W&B offline run ({source.name}, read by wandb leet inspect)")
