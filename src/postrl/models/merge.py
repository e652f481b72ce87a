"""Model merging: the per-tensor merge rules and the folder-to-folder merge behind ``postrl merge``.

Per tensor (every function takes float tensors of one shape, computes in float32 and returns float32):

* :func:`linear`: ``theta = sum_i w_i theta_i`` (a weighted average when the weights sum to 1; Wortsman et al.
  2022, "Model soups").
* The task-vector methods work on ``tau_i = theta_i - theta_base`` and return ``theta_base + lambda * merge(tau)``,
  ``merge`` being peft's function of the same name (``peft.utils.merge_utils``, per tensor):
  :func:`task_arithmetic` (Ilharco et al. 2023, "Editing Models with Task Arithmetic"), :func:`ties` (Yadav et
  al. 2023, "TIES-Merging: Resolving Interference When Merging Models"), :func:`dare` (Yu et al. 2024, "Language
  Models are Super Mario: Absorbing Abilities from Homologous Models as a Free Lunch": ``dare_linear``, or
  ``dare_ties`` with TIES's sign election).
* :func:`update_selective`: after DLER (Liu et al. 2025, "DLER: Doing Length pEnalty Right"), the RL model's
  value where RL changed the weights most, the base model's elsewhere.

:func:`merge_folders` applies one of them to every tensor of several ``from_pretrained`` folders of one
architecture (safetensors weights, read one tensor at a time, written shard by shard in the first model's layout)
and writes a ``from_pretrained`` folder: the merged weights, the first model's ``config.json`` /
``generation_config.json`` and tokenizer, and ``postrl_merge.json`` (what was merged, and how). Tied embeddings
stay tied: a tied model's safetensors hold the shared tensor once and its config says ``tie_word_embeddings``,
both of which the merged folder keeps. Writing it atomically is the caller's part (``postrl merge`` writes into a
temporary folder and renames it, as :mod:`postrl.train.checkpoint` does).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from postrl.errors import ConfigError, PostrlError

METHODS = ("linear", "task_arithmetic", "ties", "dare", "dare_ties", "update_selective")
BASE_METHODS = ("task_arithmetic", "ties", "dare", "dare_ties", "update_selective")  # need --base
DENSITY_METHODS = ("ties", "dare", "dare_ties")  # need --density
RANDOM_METHODS = ("dare", "dare_ties")  # draw a random mask: --seed
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
RECORD_FILE = "postrl_merge.json"
COPIED_FILES = ("config.json", "generation_config.json")


# --------------------------------------------------------------------------------------------------- per tensor


def _merge_utils():
    try:
        from peft.utils import merge_utils
    except ImportError:
        raise ConfigError("postrl merge: the task-vector methods use peft's merge utilities: "
                          "pip install 'postrl[merge]'") from None
    return merge_utils


def _task_vectors(base: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    b = base.float()
    return [t.float() - b for t in tensors]


def _weights(weights: Sequence[float]) -> torch.Tensor:
    return torch.tensor([float(w) for w in weights], dtype=torch.float32)


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i theta_i`` over the models' tensors (weights as given: ``merge_folders`` normalises them to
    sum 1 by default, which makes this the weighted average)."""
    out = torch.zeros(tensors[0].shape, dtype=torch.float32)
    for w, t in zip(weights, tensors):
        out += float(w) * t.float()
    return out


def task_arithmetic(base: torch.Tensor, tensors: Sequence[torch.Tensor], weights: Sequence[float], *,
                    lam: float = 1.0) -> torch.Tensor:
    """Task arithmetic: ``theta_base + lam * sum_i w_i tau_i``, ``tau_i = theta_i - theta_base`` (peft
    ``task_arithmetic``). With ``w_i = 1`` it is Ilharco et al.'s ``theta_base + lam * sum_i tau_i``."""
    tau = _merge_utils().task_arithmetic(_task_vectors(base, tensors), _weights(weights))
    return base.float() + lam * tau


def ties(base: torch.Tensor, tensors: Sequence[torch.Tensor], weights: Sequence[float], *, density: float,
         lam: float = 1.0) -> torch.Tensor:
    """TIES-merging: ``theta_base + lam * tau_m`` (peft ``ties``, majority sign by total mass).

    1. trim: each ``tau_i`` keeps its ``floor(density * numel)`` entries of largest ``|tau_i|``, the rest 0;
    2. elect: per entry, the sign ``s = sign(sum_i trimmed tau_i)`` (+1 where the sum is 0);
    3. disjoint merge: ``tau_m = sum_{i: sign(tau_i) = s} w_i tau_i / #{i: sign(tau_i) = s}`` (0 where none agrees).

    With ``w_i = 1`` and ``lam = 1`` this is the paper's merge (the mean of the agreeing trimmed entries)."""
    with warnings.catch_warnings():  # density 1: "no pruning will be performed", once per tensor
        warnings.filterwarnings("ignore", message="The density .* no pruning")
        tau = _merge_utils().ties(_task_vectors(base, tensors), _weights(weights), density)
    return base.float() + lam * tau


def dare(base: torch.Tensor, tensors: Sequence[torch.Tensor], weights: Sequence[float], *, density: float,
         lam: float = 1.0, seed: int = 0, sign_election: bool = False) -> torch.Tensor:
    """DARE (drop and rescale): ``theta_base + lam * sum_i w_i m_i * tau_i / density`` (peft ``dare_linear``), each
    ``m_i`` a Bernoulli(``density``) mask drawn from ``torch.manual_seed(seed)`` (the global generator is restored
    afterwards), so one seed gives one merge. ``sign_election``: peft ``dare_ties``, the rescaled ``tau_i`` merged
    by TIES's sign election and disjoint mean (steps 2-3 of :func:`ties`) instead of the weighted sum."""
    mu = _merge_utils()
    fn = mu.dare_ties if sign_election else mu.dare_linear
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The density .* no pruning")
        torch.manual_seed(seed)
        tau = fn(_task_vectors(base, tensors), _weights(weights), density)
    return base.float() + lam * tau


def update_selective(base: torch.Tensor, tuned: torch.Tensor, *, top: float, lam: float = 1.0) -> torch.Tensor:
    """Update-selective merge, after DLER: the ``k = floor(top * numel)`` entries of the tensor with the largest
    ``|theta_rl - theta_base|`` take ``theta_base + lam * (theta_rl - theta_base)`` (with ``lam = 1``: exactly the
    RL model's value), every other entry the base model's value. The selection is peft's magnitude trim
    (``prune(tau, top, "magnitude")``, TIES's step 1), per tensor.

    DLER's abstract says only that the method "preserves baseline accuracy while retaining the concise reasoning
    ability of the DLER model"; the rule above (keep the RL weights RL changed most) is our reading of it, with
    the selection made per tensor (every tensor keeps the same fraction of its own updates) and ``lam`` an optional
    scale of the kept updates (1: none)."""
    b, t = base.float(), tuned.float()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The density .* no pruning")
        kept = _merge_utils().prune(t - b, top, "magnitude")
    mask = kept != 0  # an entry RL left unchanged is the same in both models, kept or not
    return torch.where(mask, t if lam == 1.0 else b + lam * (t - b), b)


# --------------------------------------------------------------------------------------------------- folders


@dataclass(frozen=True)
class ModelFiles:
    """A ``from_pretrained`` folder's weights: tensor name -> safetensors file and shape (read from the headers;
    no tensor is loaded)."""

    path: Path
    model_type: str | None
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]


def read_model_files(path: str | Path) -> ModelFiles:
    """The weights index of a model folder; one-line :class:`PostrlError` for a missing folder, a folder without
    ``config.json`` or without safetensors weights."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_dir():
        raise PostrlError(f"'{p}': no such model folder")
    if not (p / "config.json").is_file():
        raise PostrlError(f"'{p}': no config.json in it (expected a folder written by save_pretrained)")
    try:
        config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PostrlError(f"'{p}': cannot read config.json ({e})") from None
    if not isinstance(config, dict):
        raise PostrlError(f"'{p}': config.json must hold a JSON object")
    if (p / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((p / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PostrlError(f"'{p}': cannot read {INDEX_FILE} ({type(e).__name__}: {e})") from None
        shards = sorted(set(weight_map.values()))
    elif (p / WEIGHTS_FILE).is_file():
        shards = [WEIGHTS_FILE]
    else:
        raise PostrlError(f"'{p}': no {WEIGHTS_FILE} (or {INDEX_FILE}): postrl merge reads safetensors weights")
    files, shapes = {}, {}
    for shard in shards:
        f_path = p / shard
        try:
            with safe_open(str(f_path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    files[name], shapes[name] = f_path, tuple(f.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a missing / damaged file
            raise PostrlError(f"'{p}': cannot read {shard} ({type(e).__name__}: {e})") from None
    return ModelFiles(p, config.get("model_type"), files, shapes)


def architecture_mismatch(a: ModelFiles, b: ModelFiles) -> str | None:
    """One line naming both folders and the first difference (config ``model_type``, then parameter names and
    shapes in name order), or None when ``b`` has ``a``'s architecture."""
    if a.model_type != b.model_type:
        return (f"models '{a.path}' and '{b.path}' have different architectures: config model_type "
                f"{a.model_type!r} vs {b.model_type!r}")
    for name in sorted(set(a.shapes) | set(b.shapes)):
        if name not in b.shapes:
            return f"models '{a.path}' and '{b.path}' have different architectures: parameter '{name}' is missing " \
                   f"in '{b.path}'"
        if name not in a.shapes:
            return f"models '{a.path}' and '{b.path}' have different architectures: parameter '{name}' is missing " \
                   f"in '{a.path}'"
        if a.shapes[name] != b.shapes[name]:
            return (f"models '{a.path}' and '{b.path}' have different architectures: parameter '{name}' has shape "
                    f"{list(a.shapes[name])} vs {list(b.shapes[name])}")
    return None


def check_options(n_models: int, method: str, *, weights: Sequence[float] | None, base: object, density: float | None,
                  lam: float | None, top: float | None, seed: int | None, normalize: bool | None) -> None:
    """The rules between ``postrl merge``'s options (one-line :class:`ConfigError` naming the option)."""
    if method not in METHODS:
        raise ConfigError(f"--method: unknown method {method!r}; valid: {', '.join(METHODS)}")
    if method in BASE_METHODS and base is None:
        raise ConfigError(f"--method {method} works on task vectors theta_i - theta_base: give --base")
    if method not in BASE_METHODS and base is not None:
        raise ConfigError(f"--base: --method {method} uses no base model (the methods with one: "
                          f"{', '.join(BASE_METHODS)})")
    if method in DENSITY_METHODS and density is None:
        raise ConfigError(f"--method {method} needs --density (the fraction of each task vector kept, in (0, 1])")
    if method not in DENSITY_METHODS and density is not None:
        raise ConfigError(f"--density applies to {', '.join(DENSITY_METHODS)}, not --method {method}")
    if density is not None and not 0.0 < density <= 1.0:
        raise ConfigError(f"--density must be in (0, 1], got {density}")
    if method == "update_selective":
        if top is None:
            raise ConfigError("--method update_selective needs --top (the fraction of each tensor's entries, with "
                              "the largest |theta_rl - theta_base|, that take the RL model's value), in (0, 1]")
        if n_models != 1:
            raise ConfigError(f"--method update_selective merges one RL model into --base; got {n_models} models")
        if weights is not None or normalize is not None:
            raise ConfigError("--weights / --normalize: --method update_selective takes no weights")
    elif top is not None:
        raise ConfigError(f"--top applies to --method update_selective, not {method}")
    if top is not None and not 0.0 < top <= 1.0:
        raise ConfigError(f"--top must be in (0, 1], got {top}")
    if method == "linear" and lam is not None:
        raise ConfigError("--lambda scales the merged task vector: --method linear has none")
    if lam is not None and not (math.isfinite(lam) and lam > 0):
        raise ConfigError(f"--lambda must be a positive number, got {lam}")
    if method not in RANDOM_METHODS and seed is not None:
        raise ConfigError(f"--seed applies to the random drop of {', '.join(RANDOM_METHODS)}, not --method {method}")
    if weights is not None:
        if len(weights) != n_models:
            raise ConfigError(f"--weights: {len(weights)} given for {n_models} models (one per MODEL)")
        if any(not math.isfinite(w) or w < 0 for w in weights):
            raise ConfigError(f"--weights must be finite and >= 0, got {' '.join(map(str, weights))}")
        if not any(w > 0 for w in weights):
            raise ConfigError("--weights are all 0: at least one model must have a positive weight")


def resolve_weights(n_models: int, method: str, weights: Sequence[float] | None,
                    normalize: bool | None) -> list[float]:
    """The weights a merge uses: as given, or 1 per model; divided by their sum when ``normalize`` (default: on
    for ``linear``, which is then a weighted average, off for the task-vector methods, whose papers sum the task
    vectors with weight 1 and scale them by lambda)."""
    w = [1.0] * n_models if weights is None else [float(x) for x in weights]
    if (method == "linear") if normalize is None else normalize:
        total = sum(w)
        w = [x / total for x in w]
    return w


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed per (seed, tensor name): a tensor's random mask depends on neither the order nor the other
    tensors."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big") >> 1


def merge_folders(models: Sequence[str | Path], out_dir: str | Path, *, method: str = "linear",
                  weights: Sequence[float] | None = None, normalize: bool | None = None,
                  base: str | Path | None = None, density: float | None = None, lam: float | None = None,
                  top: float | None = None, seed: int | None = None) -> dict:
    """Merge the ``from_pretrained`` folders ``models`` into the existing folder ``out_dir`` (``postrl merge``'s
    options; see :func:`check_options`, :func:`resolve_weights`) and return the record written to
    ``postrl_merge.json``.

    Every model (and ``base``) must have the first model's architecture: config ``model_type``, parameter names
    and shapes (else one line naming the two folders and the first differing parameter). Each tensor is merged in
    float32 and stored in the first model's dtype for it; tensors that are not floating point (integer buffers)
    are the first model's. DARE's masks come from one seed per tensor, derived from ``seed`` (default 0) and the
    tensor's name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    models = [Path(m) for m in models]
    if not models:
        raise ConfigError("give at least one MODEL folder")
    check_options(len(models), method, weights=weights, base=base, density=density, lam=lam, top=top, seed=seed,
                  normalize=normalize)
    w = resolve_weights(len(models), method, weights, normalize)
    lam = 1.0 if lam is None else float(lam)
    seed = 0 if seed is None else int(seed)
    infos = [read_model_files(m) for m in models]
    base_info = read_model_files(base) if base is not None else None
    first = infos[0]
    for other in infos[1:] + ([base_info] if base_info is not None else []):
        problem = architecture_mismatch(first, other)
        if problem:
            raise PostrlError(problem)
    tokenizer = _first_tokenizer(first.path)

    out = Path(out_dir)
    by_file: dict[Path, list[str]] = {}
    for name, f in first.files.items():
        by_file.setdefault(f, []).append(name)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def tensor(info: ModelFiles, name: str) -> torch.Tensor:
            f = info.files[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return handles[f].get_tensor(name)

        for shard, names in sorted(by_file.items()):
            merged = {}
            for name in names:
                own = tensor(first, name)
                if not own.is_floating_point():
                    merged[name] = own.contiguous()
                    continue
                thetas = [own] + [tensor(i, name) for i in infos[1:]]
                b = tensor(base_info, name) if base_info is not None else None
                if method == "linear":
                    value = linear(thetas, w)
                elif method == "task_arithmetic":
                    value = task_arithmetic(b, thetas, w, lam=lam)
                elif method == "ties":
                    value = ties(b, thetas, w, density=density, lam=lam)
                elif method in RANDOM_METHODS:
                    value = dare(b, thetas, w, density=density, lam=lam, seed=_tensor_seed(seed, name),
                                 sign_election=method == "dare_ties")
                else:  # update_selective
                    value = update_selective(b, thetas[0], top=top, lam=lam)
                merged[name] = value.to(own.dtype).contiguous()
            save_file(merged, str(out / shard.name), metadata={"format": "pt"})
    if (first.path / INDEX_FILE).is_file():
        shutil.copyfile(first.path / INDEX_FILE, out / INDEX_FILE)
    for fname in COPIED_FILES:
        if (first.path / fname).is_file():
            shutil.copyfile(first.path / fname, out / fname)
    tokenizer.save_pretrained(str(out))
    record = {"method": method, "models": [str(m.resolve()) for m in models],
              "weights": None if method == "update_selective" else w,
              "base": None if base is None else str(Path(base).resolve()), "density": density,
              "lambda": None if method == "linear" else lam, "top": top,
              "seed": seed if method in RANDOM_METHODS else None}
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def _first_tokenizer(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a folder without a tokenizer
        raise PostrlError(f"'{path}': cannot load its tokenizer ({type(e).__name__}); the merged folder takes the "
                          f"first model's tokenizer") from None
