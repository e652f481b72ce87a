"""Recipes: YAML presets that name the stages of a published method (``postrl train --recipe NAME``).

A recipe is a base config: the embedded defaults, then the recipe, then the user's YAML file, then KEY=VALUE
overrides (``load_config(path, overrides, base=recipe)``). Recipes set only what defines the method (advantage,
loss and its aggregation, KL, filters, shaping); model, task, lengths and budgets stay the user's. Each file's
header says which paper defines it and what it sets. Copies for reading live in ``examples/recipes/``.
"""

from __future__ import annotations

from importlib import resources

from postrl.errors import ConfigError
from postrl.config import yaml_load


def names() -> list[str]:
    """Sorted names of the bundled recipes."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".yaml"))


def path(name: str):
    """The bundled file of recipe ``name`` (ConfigError listing the valid names when unknown)."""
    f = resources.files(__name__) / f"{name}.yaml"
    if not name or "/" in name or not f.is_file():
        raise ConfigError(f"unknown recipe '{name}'; valid: {', '.join(names())}")
    return f


def load(name: str) -> dict:
    """The recipe as a config mapping."""
    data = yaml_load(path(name).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe '{name}': expected a mapping at the top level")
    return data
