"""The ``tool_calls`` task: short requests the model answers with one tool call (ToolRL-style call prediction).

Three tools (Python-call form, which the built-in character-level tokenizer can write):
``weather(city, unit)`` ("weather oslo f:"), ``convert(value, src, dst)`` ("convert 12 km mi:") and
``timer(minutes)`` ("timer 25:"). A row holds the gold call in ``tool_calls`` (a list with one
``{"name", "arguments"}``) for the ``tool_call`` reward, and a ``solution`` for the SFT warm start: the gold call as
``<tool_call>weather(city="oslo", unit="f")</tool_call>``, except that a fraction ``noise`` of them comes from a
careless teacher who makes one mistake (a wrong tool name, a dropped argument, a wrong value or a wrong parameter
name), so a model warm-started on them calls the tool right only part of the time and RL with the ``tool_call``
reward can raise its success rate. ``verify``: 1.0 when the completion's calls are exactly the gold call.
"""

from __future__ import annotations

import random

from postrl.data.tasks import ProceduralTask
from postrl.environments.toolrl import CallParseError, bind, gold_calls, predicted_calls
from postrl.errors import ConfigError
from postrl.registry import register

CITIES = ("paris", "rome", "oslo", "lima", "cairo", "tokyo", "dubai", "quito")
UNITS = ("km", "mi", "kg", "lb")
_WRONG_NAMES = {"weather": "forecast", "convert": "conv", "timer": "alarm"}
_WRONG_KEYS = {"city": "town", "unit": "scale", "value": "amount", "src": "from_unit", "dst": "to_unit",
               "minutes": "mins"}


def render(name: str, arguments: dict) -> str:
    """``<tool_call>name(key=value, ...)</tool_call>`` with Python literals (strings double-quoted)."""
    args = ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in arguments.items())
    return f"<tool_call>{name}({args})</tool_call>"


@register("task", "tool_calls", source="ToolRL: Reward is All Tool Learning Needs (call prediction, procedural)")
class ToolCallsTask(ProceduralTask):
    """Requests answered by one call of ``weather``, ``convert`` or ``timer``; gold in ``tool_calls``.

    ``noise``: the fraction of demonstrations (``solution``) with one mistake (default 0: a perfect teacher).
    ``verify``: 1.0 when the completion's calls equal the gold call exactly (name and every argument), else 0.0.
    """

    name = "tool_calls"

    def __init__(self, *, noise: float = 0.0):
        if not isinstance(noise, (int, float)) or not 0.0 <= noise <= 1.0:
            raise ConfigError(f"task 'tool_calls': noise must be a fraction in [0, 1], got {noise!r}")
        self.noise = float(noise)
        self.params = {"noise": self.noise}

    def sample(self, rng: random.Random) -> dict:
        kind = rng.choice(("weather", "convert", "timer"))
        if kind == "weather":
            args: dict = {"city": rng.choice(CITIES), "unit": rng.choice("cf")}
            prompt = f"weather {args['city']} {args['unit']}:"
        elif kind == "convert":
            src, dst = rng.sample(UNITS, 2)
            args = {"value": rng.randint(1, 99), "src": src, "dst": dst}
            prompt = f"convert {args['value']} {src} {dst}:"
        else:
            args = {"minutes": rng.randint(1, 99)}
            prompt = f"timer {args['minutes']}:"
        name, shown = kind, dict(args)
        if self.noise and rng.random() < self.noise:
            mistake = rng.choice(("name", "drop", "value", "key"))
            key = rng.choice(list(shown))
            if mistake == "name":
                name = _WRONG_NAMES[kind]
            elif mistake == "drop" and len(shown) > 1:
                del shown[key]
            elif mistake == "key":
                shown = {(_WRONG_KEYS[k] if k == key else k): v for k, v in shown.items()}
            else:  # a wrong value of the same type
                v = shown[key]
                pool = CITIES if key == "city" else "cf" if key == "unit" else UNITS if key in ("src", "dst") else None
                shown[key] = rng.choice([x for x in pool if x != v]) if pool else (v % 99) + 1
        return {"prompt": prompt, "tool_calls": [{"name": kind, "arguments": args}],
                "solution": render(name, shown), "task": self.name}

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        try:
            gold = gold_calls(row.get("tool_calls"))
        except CallParseError:
            return None
        pred, error = predicted_calls(completion)
        if error is not None or len(pred) != len(gold):
            return 0.0
        ok = all(p["name"] == g["name"] and bind(p, list(g["arguments"])) == g["arguments"]
                 for p, g in zip(pred, gold))
        return 1.0 if ok else 0.0
