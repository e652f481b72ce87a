"""postrl: reinforcement-learning post-training of language models as a pipeline of named, tested stages.

The public API (``__all__``, documented in docs/api.md). ``import postrl`` is light: the registry and the errors
load at once; the names that need torch, transformers or pydantic (``Trainer``, ``RolloutBatch``, ``Config``,
``score_batch``...) and the stage subpackages (``postrl.advantages``, ``postrl.losses``...) load on first access.
"""

import importlib as _importlib

from postrl import registry
from postrl.errors import ConfigError, DataError, PostrlError, RewardError
from postrl.registry import register

__version__ = "0.1.0"

# name -> (module, attribute): loaded on first access (module __getattr__, PEP 562). No name here may be that of a
# submodule (``train``, ``evaluate``): importing the submodule would rebind the package attribute to it.
_LAZY = {
    "Config": ("postrl.config", "Config"),
    "RewardSpec": ("postrl.config", "RewardSpec"),
    "StageSpec": ("postrl.config", "StageSpec"),
    "load_config": ("postrl.config", "load_config"),
    "Trainer": ("postrl.train.trainer", "Trainer"),
    "RolloutBatch": ("postrl.batch", "RolloutBatch"),
    "score_batch": ("postrl.rewards", "score_batch"),
    "RewardContext": ("postrl.rewards", "RewardContext"),
    "RewardOutcome": ("postrl.rewards", "RewardOutcome"),
    "load_source": ("postrl.data", "load_source"),
    "load_model_and_tokenizer": ("postrl.models", "load_model_and_tokenizer"),
    "pass_at_k": ("postrl.evaluate", "pass_at_k"),
}
# stage and tool subpackages, imported on first access as attributes (``postrl.losses.ppo_clip``)
_SUBPACKAGES = ("advantages", "losses", "shaping", "rewards", "data", "diagnostics", "reward_models", "calibration",
                "sandbox", "config", "batch")

__all__ = ["__version__", "registry", "register", "PostrlError", "ConfigError", "DataError", "RewardError",
           *_LAZY, *_SUBPACKAGES]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(_importlib.import_module(module), attr)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"postrl.{name}")
    else:
        raise AttributeError(f"module 'postrl' has no attribute '{name}'")
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
