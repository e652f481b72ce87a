"""Build the flawed proxy reward model and the prompt file of the over-optimisation claims (PAR, RM ensembles).

    python examples/compare/make_proxy_rm.py OUT_DIR

Writes into OUT_DIR (default ``compare_data``):
- ``prefs.jsonl``: preference pairs on the arithmetic task (the built-in model's task). Half teach correctness
  (the right bare number over a wrong one); half carry the labelers' flaw: they prefer the hedged ``"N, I think"``
  over the bare ``"N"``, which the gold verifier (``correct``) scores 0. A reward model trained on them is a proxy
  that RL can hack by hedging.
- ``rm/``: one reward model (``postrl rm train --backbone tiny:nano``); ``rm_ens/``: an ensemble of 4 seeds.
- ``prompts.jsonl``: training prompts (prompt, answer, task=arithmetic: the gold verifier still applies) with
  ``ref_reward``: the proxy's score of the reference answer (the bare correct number), the reference of PAR.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path


def main(out: Path) -> None:
    from postrl.data import load_source
    from postrl.rewards.model import raw_scores

    out.mkdir(parents=True, exist_ok=True)
    src = load_source({"name": "arithmetic", "chatty": 0.6})
    rows = [r for step in range(40) for r in src.train_rows(step, 20, seed=123)]
    rng = random.Random(0)
    prefs = []
    for r in rows:
        a = int(r["answer"])
        wrong = a + rng.choice([-10, -2, -1, 1, 2, 10])
        if rng.random() < 0.5:
            prefs.append({"prompt": r["prompt"], "chosen": str(a), "rejected": str(wrong)})
        else:  # the flaw: hedging preferred
            prefs.append({"prompt": r["prompt"], "chosen": f"{a}, I think", "rejected": str(a)})
    (out / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prefs))
    common = [sys.executable, "-m", "postrl", "rm", "train", str(out / "prefs.jsonl"), "--backbone", "tiny:nano",
              "--epochs", "2", "--batch-size", "32", "--lr", "3e-3"]
    subprocess.run(common + ["--out", str(out / "rm")], check=True)
    subprocess.run(common + ["--seeds", "4", "--out", str(out / "rm_ens")], check=True)
    prompts = [r for step in range(100, 140) for r in src.train_rows(step, 25, seed=7)]
    ref = raw_scores(str(out / "rm"), [r["prompt"] for r in prompts], [str(r["answer"]) for r in prompts])[:, 0]
    with open(out / "prompts.jsonl", "w") as fh:
        for r, s in zip(prompts, ref.tolist()):
            fh.write(json.dumps({"prompt": r["prompt"], "answer": str(r["answer"]), "task": "arithmetic",
                                 "ref_reward": s}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "compare_data"))
