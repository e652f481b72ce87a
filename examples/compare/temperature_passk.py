"""pass@K at single temperatures against a mixed-temperature set of the same K ("On the Role of Temperature Sampling
in Test-Time Scaling"; docs/claims.md). No training.

    python examples/compare/temperature_passk.py --model MODEL_DIR --task '{name: scratchpad}' --out DIR

For each sampling seed, n completions of each of N held-out prompts are sampled at every temperature of
``--temps``. pass@K at temperature T is the unbiased estimator 1 - C(n - c_T, K) / C(n, K) (c_T right answers of
n); the mixed set draws K / m completions at each of the m temperatures (the ``multi_temperature`` plan's split):
pass@K_mixed = 1 - prod_T C(n - c_T, K/m) / C(n, K/m). Reported per K: the mean over prompts per seed, its 95%
interval over the seeds, and the paired t-test over prompts (all seeds pooled) of mixed against the best single
temperature at that K; the same with all seeds' completions pooled (n x seeds per prompt and temperature, K up to
that: the large-K end where the paper finds single-temperature scaling saturating). Per-prompt solved sets: a prompt is solved at T when any of its n completions at T (all
seeds pooled) is right; the prompts solved at some temperatures only are the paper's "different temperatures solve
different problems".
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from postrl.compare import interval, paired_t
from postrl.config import yaml_load
from postrl.data import load_source
from postrl.generation import SamplingParams, encode_prompt
from postrl.models import load_model_and_tokenizer
from postrl.rollout.hf import HFGenerator


def none_right(n: int, c: int, k: int) -> float:
    """C(n - c, k) / C(n, k): the chance that k of n completions (c right) drawn without replacement are all wrong."""
    if n - c < k:
        return 0.0
    return math.comb(n - c, k) / math.comb(n, k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="{name: arithmetic, chatty: 0.6}")
    ap.add_argument("--out", default="compare/temperature_passk")
    ap.add_argument("--temps", default="0.5,1.0,1.5")
    ap.add_argument("--n", type=int, default=24, help="completions per prompt, temperature and seed")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ks", default="3,6,12,24")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    temps = [float(t) for t in args.temps.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    m = len(temps)
    if any(k % m for k in ks) or max(ks) > args.n:
        raise SystemExit(f"every K must be a multiple of {m} and at most n={args.n}")
    task = load_source(yaml_load(args.task))
    rows = task.eval_rows(args.prompts, 0)
    model, tok = load_model_and_tokenizer(args.model)
    model.eval()
    gen = HFGenerator(model, tok)
    ids = [encode_prompt(tok, r["prompt"], "auto") for r in rows]
    N = len(rows)
    counts = {}  # (seed, T) -> [N] right answers of n
    for seed in range(args.seeds):
        for T in temps:
            out = gen.generate(ids, args.n, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=T),
                               seed=1000 * seed + int(100 * T))
            right = [task.verify(out.texts[i], rows[i // args.n]) for i in range(N * args.n)]
            counts[(seed, T)] = [int(sum(right[i * args.n:(i + 1) * args.n])) for i in range(N)]
            print(f"seed {seed} T {T}: pass@1 {sum(counts[(seed, T)]) / (N * args.n):.3f} ({time.time() - t0:.0f}s)",
                  flush=True)
    n = args.n
    result = {"model": args.model, "task": args.task, "temps": temps, "n": n, "prompts": N, "seeds": args.seeds,
              "ks": ks, "table": []}
    for k in ks:
        per_prompt = {}  # name -> [seed * N + i] pass@k of prompt i in seed s
        for T in temps:
            per_prompt[f"T={T:g}"] = [1 - none_right(n, counts[(s, T)][i], k) for s in range(args.seeds)
                                      for i in range(N)]
        per_prompt["mixed"] = [1 - math.prod(none_right(n, counts[(s, T)][i], k // m) for T in temps)
                               for s in range(args.seeds) for i in range(N)]
        best = max((name for name in per_prompt if name != "mixed"),
                   key=lambda name: sum(per_prompt[name]))
        row = {"K": k, "best_single": best}
        for name, vals in per_prompt.items():
            seeds = [sum(vals[s * N:(s + 1) * N]) / N for s in range(args.seeds)]
            row[name] = interval(seeds)
        d = paired_t(dict(enumerate(per_prompt["mixed"])), dict(enumerate(per_prompt[best])))
        row["mixed_vs_best"] = d
        result["table"].append(row)
    # all seeds pooled: n * seeds completions per prompt and temperature; K up to that, paired t over prompts
    pooled = {T: [sum(counts[(s, T)][i] for s in range(args.seeds)) for i in range(N)] for T in temps}
    big = n * args.seeds
    result["pooled"] = []
    for k in sorted({k * args.seeds for k in ks} | {big}):
        if k % m or k > big:
            continue
        per = {f"T={T:g}": [1 - none_right(big, pooled[T][i], k) for i in range(N)] for T in temps}
        per["mixed"] = [1 - math.prod(none_right(big, pooled[T][i], k // m) for T in temps) for i in range(N)]
        best = max((x for x in per if x != "mixed"), key=lambda x: sum(per[x]))
        row = {"K": k, "best_single": best, **{x: sum(v) / N for x, v in per.items()},
               "mixed_vs_best": paired_t(dict(enumerate(per["mixed"])), dict(enumerate(per[best])))}
        result["pooled"].append(row)
    result["counts"] = {f"{s}:{T:g}": counts[(s, T)] for s in range(args.seeds) for T in temps}
    # per-prompt solved sets over all seeds' completions at each temperature
    solved = {T: {i for i in range(N) if any(counts[(s, T)][i] for s in range(args.seeds))} for T in temps}
    anyT = set().union(*solved.values())
    allT = set.intersection(*solved.values())
    result["solved"] = {f"T={T:g}": len(solved[T]) for T in temps}
    result["solved_any"] = len(anyT)
    result["solved_all"] = len(allT)
    result["solved_only"] = {f"T={T:g}": len(solved[T] - set().union(*(solved[U] for U in temps if U != T)))
                             for T in temps}
    result["samples_per_prompt_per_T"] = n * args.seeds
    result["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "temperature_passk.json").write_text(json.dumps(result, indent=1))
    for row in result["table"]:
        cells = "  ".join(f"{name} {row[name]['mean']:.3f}±{row[name]['half']:.3f}" for name in
                          [f"T={T:g}" for T in temps] + ["mixed"])
        d = row["mixed_vs_best"]
        print(f"K={row['K']}: {cells}  mixed-best({row['best_single']}) {d['diff']:+.4f} p={d['p']:.3g}")
    for row in result["pooled"]:
        d = row["mixed_vs_best"]
        print(f"pooled K={row['K']}: " + "  ".join(f"{x} {row[x]:.3f}" for x in row if x.startswith("T=") or
                                                    x == "mixed") + f"  mixed-best {d['diff']:+.4f} p={d['p']:.3g}")
    print({k: result[k] for k in ("solved", "solved_any", "solved_all", "solved_only", "wall_s")})


if __name__ == "__main__":
    main()
