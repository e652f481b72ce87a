"""The configuration reference (docs/config.md, ``postrl config reference``), generated from the pydantic models of
:mod:`postrl.config`: every key, its default, type and range, and its meaning."""

from __future__ import annotations

import json
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from postrl.config import (MAX_GROUP_SIZE, MAX_LR, MAX_NEW_TOKENS, MAX_REWARD_WEIGHT, MAX_ROWS_PER_STEP,
                           MAX_TOKENS_PER_STEP, Config, StageSpec)


def _type_text(ann: Any) -> str:
    """A field's type in words: ``int``, ``float or null``, ``"hf" / "vllm"``, ``list of str``, ``pair of float``."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " / ".join(json.dumps(a) for a in args)
    if origin in (Union, UnionType):
        return " or ".join("null" if a is type(None) else _type_text(a) for a in args)
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is tuple:
        return f"pair of {_type_text(args[0])}" if len(args) == 2 and args[0] == args[1] else "tuple"
    if isinstance(ann, type) and issubclass(ann, StageSpec):
        return "stage"
    return getattr(ann, "__name__", str(ann))


def _range_text(f: Any) -> str:
    """Type and bounds of a field, from its annotation and its ge / gt / le / lt constraints."""
    bounds = []
    for m in f.metadata:
        for cls, attr, op in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(m, cls):
                bounds.append(f"{op} {getattr(m, attr):g}")
    return ", ".join([_type_text(f.annotation), *bounds])




def _rules() -> str:
    return f"""## Types, ranges and limits

Every mistake below stops the run before it starts with one line naming the key (`postrl: error: ...`).

- **Strict types.** A count takes an integer: not `true`, `3.0` or `"3"`. A switch takes a YAML boolean
  (`true`/`false`, also YAML's `yes`/`no`/`on`/`off`): not `1` or `"true"`. A float may be written as an integer.
  Command-line overrides are read as YAML first, so `train.steps=3` is the integer 3.
- **Finite numbers.** No `.nan` or `.inf` anywhere in the config, stage parameters included.
- **Unknown keys** are refused in every section. A stage's parameters are its keyword-only arguments
  (`postrl methods`); a reward function whose `**kwargs` receive the prompt rows' columns (TRL style, e.g.
  `correct`) takes no other key, while a verl-style `compute_score`'s `**kwargs` take its parameters (verl's
  `reward_kwargs`).
- **Ranges** are in the tables' range column. Besides: `optim.betas` each in [0, 1); `optim.warmup_steps` and
  `optim.warmup_ratio` are exclusive (the ratio gives ceil(ratio x train.steps x train.epochs x
  train.mini_batches) warmup steps, as transformers' `warmup_ratio`); `train.mini_batches` at most the rows per step;
  `optim.lr` and `sft.lr` at most {MAX_LR:g} (an AdamW step moves each weight by about lr: beyond it a run only
  diverges); every reward weight (`rewards.N.weight`, `reward.weights`) in [-{MAX_REWARD_WEIGHT:g},
  {MAX_REWARD_WEIGHT:g}] (the weighted sum is float32: a larger weight is a unit mistake, scale the reward itself);
  `seed` in [0, 2^63 - 1] (torch's generators take 64 bits); `rollout.stop` strings non-empty.
- **Limits** on what would exhaust memory or never end: `rollout.group_size` <= {MAX_GROUP_SIZE}; rows per step
  (`train.prompts_per_step` x `rollout.group_size`) <= {MAX_ROWS_PER_STEP}; `rollout.max_new_tokens` <=
  {MAX_NEW_TOKENS}; tokens per step (rows per step x `rollout.max_new_tokens`) <= {MAX_TOKENS_PER_STEP:,};
  rows per evaluation (`train.eval_size` x `train.eval_k`) <= {MAX_ROWS_PER_STEP};
  `sft.batch_size` <= {MAX_ROWS_PER_STEP}.
- **Length stages.** `overlong_soft` (DAPO) punishes completions longer than `max_length - buffer` tokens; in a
  config `max_length` defaults to `rollout.max_new_tokens` and `buffer` to a fifth of it (DAPO's 20480 / 4096),
  and one that could never apply (`max_length - buffer >= rollout.max_new_tokens`) is an error.
  `difficulty_truncation` (Difficulty-Aware DLER) cuts each prompt at floor(max_length (1 - tighten acc_g)), acc_g
  its group's accuracy; its `max_length` defaults to `rollout.max_new_tokens`.

## Data files: the held-out split

`task: {{name: file, path: data.jsonl}}` (or `name: dataset`) holds rows out for the evaluations before, during
and after training: by default the last 10% (`eval_fraction: 0.1`) of a fixed permutation of the rows, the same
for every seed, so no run trains on them (at least one row when the file has two or more, and never all of them).
`eval_path: held.jsonl` (`eval_split` for a dataset) evaluates on that file's rows instead and trains on every row
of `path`; `eval_fraction: 0` holds no row out. `prompt_column` (default `prompt`) names the prompt: a non-empty
string, or a conversation (TRL's conversational format: a list of `{{role, content}}` messages, rendered with the
tokenizer's chat template; a user's reward function then gets prompts as message lists and each completion as
`[{{role: assistant, content: ...}}]`, as in TRL). The other columns reach the rewards as keyword arguments
(`columns` keeps a subset); `verifier` names a task whose verifier scores the rows (e.g. `arithmetic`, reading
`answer`). Files are read as UTF-8; a file in another encoding, a lone surrogate (`\\ud800`) or an empty prompt is
one error line naming the file and row.

## Prior prompts: options of every task

Every prompt source (a procedural task, `file`, `dataset`, `reasoning_gym`) also takes `prompt_prefix`,
`prompt_suffix` (text around every training query: prefix + query + suffix), `system_prompt` (a system turn; the
prompt becomes a conversation, which needs the tokenizer's chat template) and `eval_prior` (default true; false:
the held-out rows keep their plain queries). "Prior Prompt Engineering for Reinforcement Fine-Tuning";
`postrl.data.prior_prompt`.
"""


def reference_markdown() -> str:
    """The configuration reference (docs/config.md), generated from the pydantic models' fields."""
    lines = ["# Configuration reference", "",
             "Generated by `postrl config reference` from `src/postrl/config/`; do not edit by hand.", "",
             "Any key can be set in a YAML file or overridden on the command line as `section.key=value`.",
             "A stage section (`task`, `advantage`, `loss`, each entry of `rewards`, `shaping`, `filters`) takes "
             "`name` plus the stage's own parameters; `postrl methods` lists the stages and their sources.", "",
             _rules()]

    def walk(model: type[BaseModel], prefix: str) -> None:
        rows = []
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel) and not issubclass(ann, StageSpec):
                continue
            default = f.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = default.model_dump(mode="json")
            elif isinstance(default, list):
                default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
            rows.append(f"| `{prefix}{name}` | `{json.dumps(default)}` | {_range_text(f)} | {f.description or ''} |")
        if rows:
            lines.extend([f"## `{prefix.rstrip('.') or 'top level'}`", "", "| key | default | range | meaning |",
                          "|---|---|---|---|", *rows, ""])
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel) and not issubclass(ann, StageSpec):
                walk(ann, f"{prefix}{name}.")

    walk(Config, "")
    return "\n".join(lines)
