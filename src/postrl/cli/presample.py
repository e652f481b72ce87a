"""``postrl presample``: completions of the initial policy with their log-probs, sampled once (DPH-RL's rehearsal set).

Reads the run's config (the initial model, the task, ``rollout.temperature``, ``rollout.max_new_tokens``,
``model.chat_template``, ``seed``), samples ``--samples`` completions for each of ``--prompts`` training prompts
and writes one JSON line per completion: ``prompt``, ``completion``, ``prompt_ids``, ``completion_ids``,
``logprobs`` (the policy's log-prob of each completion token at ``rollout.temperature``, the sampler's),
``temperature``, ``correct`` (the task verifier's score, null without one). ``--only-correct`` keeps the completions
the verifier scores 1 (DPH-RL rehearses the prompts the initial model already solves). The ``rehearsal`` expansion
reads the file and the ``f_divergence_rehearsal`` regulariser turns it into the f-divergence term.
"""

from __future__ import annotations

import json
from pathlib import Path

from postrl.cli.common import add_import_paths, check_option, log, split_args
from postrl.errors import DataError


def presample(backend, tokenizer, rows: list[dict], *, samples: int, max_new_tokens: int, temperature: float,
              chat_template: str = "auto", seed: int = 0, only_correct: bool = False) -> list[dict]:
    """The rehearsal rows of ``rows`` (see the module docstring), from ``backend.generate``."""
    from postrl.data import verify_row
    from postrl.generation import SamplingParams, encode_prompt

    prompts = [encode_prompt(tokenizer, r["prompt"], chat_template) for r in rows]
    gen = backend.generate(prompts, samples, SamplingParams(max_new_tokens=max_new_tokens,
                                                            temperature=temperature), seed)
    out = []
    for k in range(len(gen.texts)):
        row, p_ids = rows[k // samples], prompts[k // samples]
        L = int(gen.completion_mask[k].sum())
        if L == 0:
            continue
        score = verify_row(gen.texts[k], row)
        if only_correct and not (score is not None and score >= 1.0):
            continue
        out.append({"prompt": row["prompt"], "completion": gen.texts[k], "prompt_ids": [int(t) for t in p_ids],
                    "completion_ids": gen.completion_ids[k, :L].tolist(),
                    "logprobs": [float(x) for x in gen.logprobs[k, :L].tolist()], "temperature": temperature,
                    "correct": score})
    return out


def run(args) -> int:
    from postrl import accel
    from postrl.config import load_config
    from postrl.data import load_source
    from postrl.models import load_model_and_tokenizer
    from postrl.config import MAX_ROWS_PER_STEP
    from postrl.train.builtin import ensure_builtin

    check_option("--prompts", args.prompts, low=1, high=MAX_ROWS_PER_STEP)
    check_option("--samples", args.samples, low=1, high=MAX_ROWS_PER_STEP)
    path, overrides = split_args(args.items)
    add_import_paths(path)
    cfg = load_config(path, overrides)
    source = load_source(cfg.task.model_dump())
    # the model postrl train starts from: the built-in one is its shipped / cached warm start, not a fresh init
    model_path = ensure_builtin(cfg, log=log) if cfg.model.path == "builtin" else cfg.model.path
    model, tokenizer = load_model_and_tokenizer(model_path, cfg.model.dtype)
    model.eval()
    backend = accel.prepare(model, cfg.accel).generator(model, tokenizer)
    rows = source.train_rows(0, args.prompts, cfg.seed)
    temperature = float(cfg.rollout.temperature or 1.0)
    out = presample(backend, tokenizer, rows, samples=args.samples, max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=temperature, chat_template=cfg.model.chat_template, seed=cfg.seed,
                    only_correct=args.only_correct)
    if not out:
        raise DataError(f"presample: no completion kept of {len(rows) * args.samples} sampled"
                        + (" (--only-correct: the initial model solved none)" if args.only_correct else ""))
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    log(f"presample: {len(out)} completions of {len(rows)} prompts at temperature {temperature:g}: {dest}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("presample", help="sample the initial policy once, with log-probs (DPH-RL rehearsal file)",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]", help="the run's config and overrides")
    p.add_argument("--out", required=True, help="JSON-lines file to write")
    p.add_argument("--prompts", type=int, default=64, help="training prompts to sample (>= 1; default 64)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (>= 1; default 4)")
    p.add_argument("--only-correct", action="store_true", help="keep only the completions the verifier scores 1")
    p.set_defaults(fn=run)
