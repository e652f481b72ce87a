"""Atomic, resumable training checkpoints.

Layout of one run::

    run_dir/checkpoints/step-00000100/
        config.json, generation_config.json, model.safetensors (or shards + model.safetensors.index.json)
            (with model.lora: adapter_config.json + adapter_model.safetensors, the adapter alone)
        tokenizer.json, tokenizer_config.json, ...      (tokenizer.save_pretrained)
        optimizer.pt, scheduler.pt                      (state_dicts, torch.save)
        rng.pt                                          (python / numpy / torch CPU / torch CUDA RNG states)
        reference/                                      (only when the reference model was reset to the policy
                                                         during training: its weights, a model folder)
        trainer_state.json                              (caller's state dict + "step"; written last)

The folder is a normal Hugging Face model folder: ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it directly.

Atomicity: everything is written into a hidden sibling ``.step-NNNNNNNN.tmp-<pid>``, every file and folder is
fsynced, and only then is the folder renamed to ``step-NNNNNNNN`` (the step in 8 digits; one ``rename``). A crash
at any point leaves either the previous checkpoints untouched or the new one complete; a ``step-*`` folder is
never half written.
Re-saving an existing step swaps the two folders atomically (``renameat2(RENAME_EXCHANGE)`` on Linux); where
that is unavailable the old folder is renamed aside to ``.step-NNNNNNNN.old-<pid>`` first, and a crash in that
short window is repaired by the next :func:`latest_checkpoint` / :func:`save_checkpoint` (the aside folder is
renamed back).

Validation: a ``step-*`` folder is resumed from only when :func:`checkpoint_problem` finds nothing wrong (a
state with an integer step, whole safetensors and torch.save files); :func:`resumable_checkpoint` returns the
newest such folder and the newer ones it skipped, which the trainer moves aside (:func:`quarantine_checkpoint`).

At the end of training the policy and tokenizer also go to ``run_dir/final/`` (:func:`save_final_model`, the same
atomic write), a plain Hugging Face model folder; with LoRA the merged model there, the adapter (a
``PeftModel.from_pretrained`` folder), or the merged model with the adapter in ``final/adapter/``.

Only the process that calls :func:`save_checkpoint` has its RNG state recorded; in multi-process training call
it on the main process only.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from postrl.errors import ConfigError, PostrlError
from postrl.models import lora

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"  # peft's PeftModel.save_pretrained (model.lora)
ADAPTER_DIR = "adapter"  # final/adapter/ with model.lora.save=both
REFERENCE_DIR = "reference"  # a reference model reset to the policy during training
FINAL_DIR = "final"

# A temporary folder whose writer is still alive is left alone unless nothing in it changed for this long
# (covers a pid reused by another process, e.g. after a container restart).
STALE_TMP_SECONDS = 3600.0

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.step-(\d+)\.tmp-(\d+)$")
_OLD_RE = re.compile(r"^\.step-(\d+)\.old-(\d+)$")


# --------------------------------------------------------------------------------------------------- public API


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model,
    tokenizer,
    optimizer,
    scheduler,
    state: dict,
    keep_last: int | None = 2,
    reference=None,
) -> Path:
    """Write ``run_dir/checkpoints/step-{step:08d}/`` atomically and return its path.

    ``tokenizer``, ``optimizer`` and ``scheduler`` may be ``None`` (their files are then not written).
    ``reference``: a reference model whose weights are no longer the initial policy's (a stage reset it to the
    policy), saved in ``reference/``.
    ``state`` must be JSON-serialisable; ``step`` is added to it. After the new checkpoint is in place, all but
    the newest ``keep_last`` complete checkpoints are deleted (the one just written is always kept;
    ``keep_last=None`` keeps everything) and temporary folders left by crashed saves are removed.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint step must be a non-negative int, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last must be an int >= 1 (or None to keep all), got {keep_last!r}")
    if not isinstance(state, dict):
        raise ConfigError(f"trainer state must be a dict, got {type(state).__name__}")
    # Serialise the state first: a bad state fails before anything touches the disk.
    try:
        state_json = json.dumps({**state, "step": step}, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"trainer state for checkpoint step {step} is not JSON-serialisable: {exc}") from None

    root = Path(run_dir) / CHECKPOINTS_DIR
    created = not root.is_dir()
    root.mkdir(parents=True, exist_ok=True)
    if created:
        _fsync_dir(root.parent)

    name = _step_name(step)
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():  # our own leftover from an earlier failed attempt at this step
        shutil.rmtree(tmp)

    try:
        tmp.mkdir()
        _save_model(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        torch.save(_rng_state(), tmp / RNG_FILE)
        if reference is not None:
            (tmp / REFERENCE_DIR).mkdir()
            _save_model(reference, tmp / REFERENCE_DIR)
        # Written last: its presence marks a complete checkpoint.
        (tmp / STATE_FILE).write_text(state_json + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    _cleanup(root, keep=final, keep_last=keep_last)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest usable checkpoint (``step-*`` folder with a valid ``trainer_state.json`` and whole weight files,
    see :func:`checkpoint_problem`) under ``run_dir``, or None.

    Temporary folders of unfinished saves are ignored.
    """
    return resumable_checkpoint(run_dir, require=())[0]


def resumable_checkpoint(run_dir: str | os.PathLike,
                         require: tuple[str, ...] = (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE),
                         ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint without a problem, or None; [(newer checkpoint, its problem)] skipped on the way).

    ``require``: the files besides the state and weights that the caller will load (checked as well)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return None, []
    _recover_aside(root)
    skipped = []
    for _step, path in reversed(_complete_checkpoints(root)):
        problem = checkpoint_problem(path, require)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def checkpoint_problem(ckpt: str | os.PathLike,
                       require: tuple[str, ...] = (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE)) -> str | None:
    """Why ``ckpt`` cannot be loaded (one line naming the file), or None. Cheap: nothing is deserialised.

    - ``trainer_state.json``: a JSON object whose ``step`` is a non-negative int equal to the folder's step;
    - every weight file (``model.safetensors`` or the shards of its index): a whole safetensors file (an 8-byte
      little-endian header length n, a JSON header of n bytes, tensors whose ``data_offsets`` end exactly at the
      end of the file), which a truncated, empty or overwritten file is not;
    - each file of ``require`` (optimizer.pt, scheduler.pt, rng.pt): a readable zip archive, torch.save's format
      (a truncated one has lost its central directory).
    """
    ckpt = Path(ckpt)
    try:
        state = json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} is unreadable: {_one_line(exc)}"
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"{STATE_FILE} has no integer 'step' (got {step!r})"
    m = _STEP_RE.match(ckpt.name)
    if m and int(m.group(1)) != step:
        return f"{STATE_FILE} says step {step}, the folder is {ckpt.name}"
    try:
        files = _weight_files(ckpt)
    except PostrlError:
        return f"{WEIGHTS_INDEX_FILE} is unreadable"
    if files is None:
        return f"{WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE}) is missing"
    for f in files:
        problem = _safetensors_problem(f)
        if problem is not None:
            return f"{f.name} {problem}"
    for name in require:
        problem = _zip_problem(ckpt / name)
        if problem is not None:
            return f"{name} {problem}"
    return None


def quarantine_checkpoint(path: Path) -> Path:
    """Rename an unusable ``step-N`` folder to ``step-N.corrupt`` (kept for inspection, no longer a checkpoint:
    not resumed from, not counted by ``keep_last``, not listed by ``postrl doctor``); return the new path."""
    target = path.with_name(f"{path.name}.corrupt")
    if target.exists():
        target = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
    os.rename(path, target)
    _fsync_dir(path.parent)
    return target


def save_final_model(run_dir: str | os.PathLike, model, tokenizer, lora_save: str = "merged") -> Path:
    """Write the trained policy and its tokenizer to ``run_dir/final/`` (``save_pretrained``: loadable by
    ``from_pretrained``) atomically, like a checkpoint: into a hidden temporary folder, fsynced, then renamed
    (an existing ``final/`` is swapped out in one rename). A LoRA policy (``peft``) is written as ``lora_save``
    says: ``merged`` (adapters folded into the weights: ``AutoModelForCausalLM.from_pretrained``), ``adapter``
    (``PeftModel.from_pretrained``) or ``both`` (merged, and the adapter in ``final/adapter/``)."""
    final = Path(run_dir) / FINAL_DIR
    tmp = final.with_name(f".{FINAL_DIR}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)

        if lora.is_lora(model) and lora_save in ("merged", "both"):
            lora.save_merged(model, tmp)
        else:
            _save_model(model, tmp)
        if lora.is_lora(model) and lora_save == "both":
            _save_model(model, tmp / ADAPTER_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    model,
    optimizer=None,
    scheduler=None,
    restore_rng: bool = True,
    reference=None,
) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into already-constructed objects; return its state.

    Weights are copied into ``model`` in place (tied weights stay tied); into ``reference`` too when the checkpoint
    has a ``reference/`` folder (a reference reset during training; without one ``reference`` is left as it is). ``optimizer`` / ``scheduler`` get their
    state_dicts loaded when given; RNG states are restored when ``restore_rng``. The returned dict is the saved
    trainer state (including ``step``). Every required file is checked before anything is modified.
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise PostrlError(f"checkpoint folder {ckpt} does not exist")

    weight_files = _weight_files(ckpt)
    required = [STATE_FILE]
    if optimizer is not None:
        required.append(OPTIMIZER_FILE)
    if scheduler is not None:
        required.append(SCHEDULER_FILE)
    if restore_rng:
        required.append(RNG_FILE)
    missing = [f for f in required if not (ckpt / f).is_file()]
    if weight_files is None:
        missing.append(f"{WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE})")
    else:
        missing += [f.name for f in weight_files if not f.is_file()]
    if missing:
        raise PostrlError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")

    try:
        state = json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PostrlError(f"checkpoint {ckpt}: cannot read {STATE_FILE}: {exc}") from None
    if not isinstance(state, dict):
        raise PostrlError(f"checkpoint {ckpt}: {STATE_FILE} must hold a JSON object")

    ref_files = _weight_files(ckpt / REFERENCE_DIR) if reference is not None else None
    if ref_files is not None and not all(f.is_file() for f in ref_files):
        raise PostrlError(f"checkpoint {ckpt} is incomplete: missing weights in {REFERENCE_DIR}/")
    _load_weights(ckpt, weight_files, model)
    if ref_files is not None:
        _load_weights(ckpt / REFERENCE_DIR, ref_files, reference)
    if optimizer is not None:
        optimizer.load_state_dict(_torch_load(ckpt / OPTIMIZER_FILE))
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(ckpt / SCHEDULER_FILE))
    if restore_rng:
        _set_rng_state(_torch_load(ckpt / RNG_FILE), ckpt)
    return state


# --------------------------------------------------------------------------------------------------- saving


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _save_model(model, directory: Path) -> None:
    kwargs: dict[str, Any] = {}
    try:
        # transformers 4.x: a real parameter (default True since 4.35); 5.x always writes safetensors and
        # silently swallows unknown kwargs into **kwargs, so only pass it where it means something.
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
            kwargs["safe_serialization"] = True
    except (TypeError, ValueError):
        pass
    model.save_pretrained(str(directory), **kwargs)


def _rng_state() -> dict:
    np_state = np.random.get_state()  # ('MT19937', uint32[624], pos, has_gauss, cached_gaussian)
    state = {
        "python": random.getstate(),
        # Plain Python types so that torch.load(weights_only=True) can read it back.
        "numpy": {
            "bit_generator": str(np_state[0]),
            "key": [int(x) for x in np_state[1]],
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    if sys.platform == "win32":  # directories cannot be opened/fsynced there
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
        for fname in filenames:
            _fsync_file(Path(dirpath) / fname)
        _fsync_dir(Path(dirpath))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2). False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _publish(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` visible as ``final`` with a single rename."""
    root = final.parent
    if not final.exists():
        os.rename(tmp, final)
    elif _rename_exchange(tmp, final):
        # ``tmp`` now holds the previous checkpoint of this step.
        _fsync_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        aside = root / f".{final.name}.old-{os.getpid()}"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)  # put the previous checkpoint back
            raise
        _fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(root)


# --------------------------------------------------------------------------------------------------- cleanup


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of complete ``step-*`` folders, oldest first."""
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir() and os.path.isfile(os.path.join(entry.path, STATE_FILE)):
            out.append((int(m.group(1)), Path(entry.path)))
    out.sort()
    return out


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


def _last_modified(path: Path) -> float:
    newest = 0.0
    for dirpath, _dirnames, filenames in os.walk(path):
        for p in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
            try:
                newest = max(newest, os.stat(p).st_mtime)
            except OSError:
                pass
    return newest


def _is_stale(path: Path, pid: int) -> bool:
    """A temporary folder is stale when its writer is dead, or when nothing in it changed for a long time
    (the pid may belong to an unrelated process now, or to us after a container restart)."""
    if pid != os.getpid() and not _pid_alive(pid):
        return True
    return time.time() - _last_modified(path) > STALE_TMP_SECONDS


def _recover_aside(root: Path) -> None:
    """Rename back a ``.step-N.old-<pid>`` folder whose ``step-N`` vanished (crash during a same-step re-save)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        m = _OLD_RE.match(name)
        if not m:
            continue
        aside = root / name
        final = root / _step_name(int(m.group(1)))
        if final.exists() or not (aside / STATE_FILE).is_file() or not _is_stale(aside, int(m.group(2))):
            continue
        try:
            os.rename(aside, final)
        except OSError:
            continue  # someone else recovered it first
        _fsync_dir(root)


def _cleanup(root: Path, keep: Path, keep_last: int | None) -> None:
    _recover_aside(root)
    # Stale temporary / aside folders of crashed saves.
    for name in os.listdir(root):
        m = _TMP_RE.match(name) or _OLD_RE.match(name)
        if m and _is_stale(root / name, int(m.group(2))):
            shutil.rmtree(root / name, ignore_errors=True)
    if keep_last is None:
        return
    complete = _complete_checkpoints(root)
    others = [p for _, p in complete if p != keep]
    for path in others[: max(0, len(others) - (keep_last - 1))]:
        _remove_checkpoint(path)


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that no partially deleted ``step-*`` folder is ever visible: rename, then delete."""
    doomed = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except OSError:
        return  # already gone (another process pruned it)
    shutil.rmtree(doomed, ignore_errors=True)


# --------------------------------------------------------------------------------------------------- loading


def _weight_files(ckpt: Path) -> list[Path] | None:
    for name in (WEIGHTS_FILE, ADAPTER_FILE):
        if (ckpt / name).is_file():
            return [ckpt / name]
    index = ckpt / WEIGHTS_INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PostrlError(f"checkpoint {ckpt}: cannot read {WEIGHTS_INDEX_FILE}: {exc}") from None
    return [ckpt / n for n in names]


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None (the header and the file size are checked)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size:
                return f"is not a whole safetensors file ({size} bytes)"
            header = json.loads(f.read(n).decode("utf-8"))
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as exc:
        return f"has an unreadable header: {_one_line(exc)}"
    if not isinstance(header, dict):
        return "has an unreadable header"
    ends = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        off = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(off, list) and len(off) == 2 and all(isinstance(o, int) for o in off)
                and 0 <= off[0] <= off[1]):
            return f"has an unreadable header (tensor {name!r})"
        ends.append(off[1])
    if max(ends, default=0) != size - 8 - n:
        return f"is truncated or padded: its tensors end at byte {8 + n + max(ends, default=0)}, the file has {size}"
    return None


def _zip_problem(path: Path) -> str | None:
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except FileNotFoundError:
        return "is missing"
    except (OSError, zipfile.BadZipFile) as exc:
        return f"is not a whole torch.save file: {_one_line(exc)}"
    return None


def _tied_aliases(model) -> dict[str, set[str]]:
    """For each parameter/buffer name, the other names that refer to the same tensor (tied weights)."""
    groups: dict[tuple, list[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape)) if t.data_ptr() else (id(t),)
        groups.setdefault(key, []).append(name)
    aliases: dict[str, set[str]] = {}
    for names in groups.values():
        for n in names:
            aliases[n] = set(names) - {n}
    return aliases


def _load_weights(ckpt: Path, files: list[Path], model) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if files == [ckpt / ADAPTER_FILE]:  # model.lora: the adapter alone (the base weights are model.path's)
        lora.load_adapter_weights(model, files[0])
        return
    model_keys = set(model.state_dict().keys())
    file_keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            file_keys.update(h.keys())
    aliases = _tied_aliases(model)
    unexpected = file_keys - model_keys
    missing = {k for k in model_keys - file_keys if not (aliases.get(k, set()) & file_keys)}

    if unexpected or missing:
        # transformers >= 5 saves some architectures (e.g. MoE models with fused experts) in their original
        # checkpoint layout, whose keys differ from the in-memory state_dict; let transformers convert them.
        _load_weights_via_from_pretrained(ckpt, model, unexpected, missing)
        return

    for f in files:  # shard by shard, to keep peak memory at one shard
        sd = load_file(str(f), device="cpu")
        try:
            model.load_state_dict(sd, strict=False)
        except RuntimeError as exc:  # shape mismatch
            raise PostrlError(f"checkpoint {ckpt} does not fit this model: {_one_line(exc)}") from None
        del sd


def _load_weights_via_from_pretrained(ckpt: Path, model, unexpected: set[str], missing: set[str]) -> None:
    def mismatch() -> PostrlError:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} weights (e.g. {sorted(missing)[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown weights (e.g. {sorted(unexpected)[0]})")
        return PostrlError(f"checkpoint {ckpt} does not match this model: {'; '.join(parts)}")

    if not hasattr(type(model), "from_pretrained") or getattr(model, "config", None) is None:
        raise mismatch()
    try:
        loaded = type(model).from_pretrained(str(ckpt), config=model.config, dtype=model.dtype)
    except Exception:
        raise mismatch() from None
    sd = loaded.state_dict()
    del loaded
    aliases = _tied_aliases(model)
    model_keys = set(model.state_dict().keys())
    still_missing = {k for k in model_keys - set(sd) if not (aliases.get(k, set()) & set(sd))}
    if still_missing or set(sd) - model_keys:
        raise mismatch()
    try:
        model.load_state_dict(sd, strict=False)
    except RuntimeError as exc:
        raise PostrlError(f"checkpoint {ckpt} does not fit this model: {_one_line(exc)}") from None


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PostrlError(f"cannot read {path}: {_one_line(exc)}") from None


def _set_rng_state(rng: dict, ckpt: Path) -> None:
    try:
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        n = rng["numpy"]
        np.random.set_state(
            (n["bit_generator"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        torch.set_rng_state(rng["torch"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise PostrlError(f"checkpoint {ckpt}: {RNG_FILE} is malformed: {_one_line(exc)}") from None
    cuda_states = rng.get("torch_cuda")
    if cuda_states and torch.cuda.is_available():
        n_dev = torch.cuda.device_count()
        for i, s in enumerate(cuda_states[:n_dev]):
            torch.cuda.set_rng_state(s, i)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
