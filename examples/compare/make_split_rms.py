"""Reward models whose members disagree, for the RM-ensemble retry (examples/compare/rm_ensembles_split.yaml).

    python examples/compare/make_split_rms.py OUT_DIR      (default compare_data; about 3 minutes on 2 cores)

Four annotators label 200 pairs each on the arithmetic task. Annotator 0 has the labelling flaw of the PAR claim:
half of its pairs prefer the hedged ``"N, I think"`` over the bare right ``"N"`` (the gold verifier scores the
hedge 0), half prefer the right bare number over a wrong one. Annotators 1-3 are careful: the right bare number over
a wrong bare one or over a wrong hedged one (``"M, I think"``); they never compare a hedged right answer with a bare
one, so the only evidence on that comparison is annotator 0's.

- ``rm_split_member_k/``: a reward model on annotator k's 200 pairs; member 0 learns the flaw (measured: "65, I
  think" +6.5 to +6.7, "65" -0.7 to -2.4), members 1-3, which have only seen hedged answers lose, score it -5.6 to -8.0;
- ``rm_split_ens/``: the four as one ensemble (members on different data subsets, disagreeing on the hedge);
- ``rm_split_all/``: one reward model on all 800 pairs. The careful annotators' "wrong hedged answer loses" pairs
  outweigh the flawed ones: it scores the hedge lower than the bare answer (-1.0 vs -0.2), with a weak correctness
  signal.

Both with ``postrl rm train --backbone tiny:nano`` (3 epochs, batch 32, lr 3e-3), seed 0.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path


def main(out: Path) -> None:
    from postrl.data import load_source
    from postrl.reward_models.model import RewardEnsemble, RewardModel

    out.mkdir(parents=True, exist_ok=True)
    src = load_source({"name": "arithmetic", "chatty": 0.6})
    rows = [r for step in range(40) for r in src.train_rows(step, 20, seed=321)]
    rng = random.Random(1)
    annot: list[list[dict]] = [[] for _ in range(4)]
    for i, r in enumerate(rows):
        k = i % 4
        a = int(r["answer"])
        wrong = a + rng.choice([-10, -2, -1, 1, 2, 10])
        if k == 0 and rng.random() < 0.5:  # the flawed annotator: hedging preferred
            pair = {"prompt": r["prompt"], "chosen": f"{a}, I think", "rejected": str(a)}
        elif k == 0 or rng.random() < 0.5:
            pair = {"prompt": r["prompt"], "chosen": str(a), "rejected": str(wrong)}
        else:  # careful annotators also see wrong hedged answers lose
            pair = {"prompt": r["prompt"], "chosen": str(a), "rejected": f"{wrong}, I think"}
        annot[k].append(pair)
    split = out / "prefs_split"
    split.mkdir(exist_ok=True)
    for k, pairs in enumerate(annot):
        (split / f"annotator_{k}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (split / "all.jsonl").write_text("".join(json.dumps(p) + "\n" for pairs in annot for p in pairs))
    common = [sys.executable, "-m", "postrl", "rm", "train", "--backbone", "tiny:nano", "--epochs", "3",
              "--batch-size", "32", "--lr", "3e-3"]
    subprocess.run(common[:5] + [str(split / "all.jsonl")] + common[5:] + ["--out", str(out / "rm_split_all")],
                   check=True)
    for k in range(4):
        subprocess.run(common[:5] + [str(split / f"annotator_{k}.jsonl")] + common[5:]
                       + ["--out", str(out / f"rm_split_member_{k}")], check=True)
    members = [RewardModel.from_pretrained(out / f"rm_split_member_{k}") for k in range(4)]
    RewardEnsemble(members, {"annotators": 4, "flawed": [0]}).save_pretrained(out / "rm_split_ens")
    print(f"wrote {out}/rm_split_all, {out}/rm_split_ens")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "compare_data"))
