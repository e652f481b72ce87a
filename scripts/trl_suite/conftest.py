"""Run TRL's own tests/test_grpo_trainer.py offline: local stand-ins for the hub (build_standins.py, HF_HOME=./hf_home)
and for the zen dataset; ``--postrl`` puts postrl's adapter (postrl.integrations.trl.GRPOTrainer) behind TRL's
constructor, the way a TRL user swaps the import."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("HF_HOME", str(HERE / "hf_home"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import datasets  # noqa: E402
import trl.import_utils as _iu  # noqa: E402

for _name in ("is_joblib_available",):  # names the newer test utilities import that this TRL lacks
    if not hasattr(_iu, _name):
        setattr(_iu, _name, lambda *a, **k: False)

_PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
            "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
            "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse",
            "There should be one-- and preferably", "Although that way may not be obvious at first unless you're",
            "Now is", "Although never is often", "If the implementation is hard to explain,",
            "If the implementation is easy", "Namespaces are one honking great"]
_QUESTIONS = ["What is better than ugly?", "What is better than implicit?", "What is better than complex?",
              "What is better than complicated?", "What is better than nested?", "What is better than dense?",
              "What counts?", "Are special cases enough to break the rules?", "What beats purity?",
              "What should never pass silently?", "When can errors pass silently?",
              "What should you do in the face of ambiguity?", "How many ways should there be to do it?",
              "For whom may the way not be obvious at first?", "What is better than never?",
              "Is never better than *right* now?", "What does it mean if the implementation is hard to explain?",
              "What does it mean if the implementation is easy to explain?", "Any great ideas?"]
_real_load_dataset = datasets.load_dataset


def _zen(name: str | None, split: str | None = None, streaming: bool = False, **kwargs):
    if name == "standard_prompt_only":
        ds = datasets.Dataset.from_dict({"prompt": _PROMPTS})
    elif name == "conversational_prompt_only":
        ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in _QUESTIONS]})
    else:
        raise FileNotFoundError(f"no local stand-in for trl-internal-testing/zen {name}")
    dd = ds.train_test_split(test_size=0.1, shuffle=False)
    if streaming:
        dd = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dd.items()})
    return dd[split] if split else dd


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if path == "trl-internal-testing/zen":
        return _zen(name, split=split, streaming=streaming)
    if str(path).startswith("trl-internal-testing/"):
        raise FileNotFoundError(f"no local stand-in for {path}")
    return _real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)


datasets.load_dataset = load_dataset


def pytest_addoption(parser):
    parser.addoption("--postrl", action="store_true", help="substitute postrl's TRL adapter for TRL's GRPOTrainer")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--postrl"):
        return
    from postrl.integrations.trl import GRPOTrainer

    for item in items:
        mod = item.module
        if getattr(mod, "GRPOTrainer", None) is not None and mod.GRPOTrainer is not GRPOTrainer:
            mod.GRPOTrainer = GRPOTrainer
