#!/usr/bin/env bash
# GPU checks (run on a machine with one NVIDIA GPU, from the repository root): what the CPU suite cannot run.
#   1. `postrl train` on CUDA: float32, bfloat16, bfloat16 + LoRA (a 20M-parameter Llama built from a config);
#   2. the TRL adapter (postrl.integrations.trl.GRPOTrainer) against TRL's own GRPOTrainer, same settings;
#   3. `postrl bench --device cuda --quick`.
# Step times and the end of each run go to stdout and to $OUT (or ./gpu-check). Packages the machine lacks come as
# wheels in .whl/ (pydantic, trl, datasets, ...): see docs/DEVELOPING.md, "Scripts".
set -u
OUT=${OUT:-gpu-check}
RUNS=${RUNS:-/tmp/postrl-gpu-runs}  # models and run directories (only logs go to $OUT)
mkdir -p "$OUT" "$RUNS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, trl, peft, accelerate, pydantic; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())" || exit 1

python3 - "$RUNS" <<'EOF'
import json, sys, time
from pathlib import Path
from postrl.models.tiny import build_local
out = Path(sys.argv[1])
t = time.time()
build_local(out / "m20", size="20m", seed=0)
print("built", out / "m20", f"{time.time() - t:.1f}s", flush=True)
EOF

common="task.name=arithmetic rollout.group_size=8 train.prompts_per_step=32 rollout.max_new_tokens=64 \
train.steps=12 train.save_every=0 train.eval_size=32 train.eval_k=1 train.micro_batch_size=64 optim.lr=1e-4"
for variant in "model.dtype=float32" "model.dtype=bfloat16" "model.dtype=bfloat16 model.lora.r=16 model.lora.alpha=32"; do
  name=$(echo "$variant" | tr ' =.' '___')
  echo "== postrl train on CUDA: $variant"
  t0=$(date +%s.%N)
  python3 -m postrl train --quiet model.path="$RUNS/m20" output_dir="$RUNS/run_$name" $common $variant \
    > "$OUT/train_$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  echo "exit $rc, wall $(python3 -c "print(round($t1-$t0,1))")s"
  tail -n 3 "$OUT/train_$name.log"
  python3 - "$RUNS/run_$name" <<'EOF'
import json, sys, statistics
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
steady = rows[2:] or rows
med = lambda k: statistics.median(r[k] for r in steady if k in r)
print(f"  steps {len(rows)}: step {med('time/step')*1000:.0f} ms (generation {med('time/generation')*1000:.0f}, "
      f"update {med('time/update')*1000:.0f}), tok/s {med('time/tokens_per_s'):.0f}, "
      f"peak GPU mem {max(r.get('memory/cuda_max_allocated_gb', 0) for r in rows) * 1024:.0f} MiB, "
      f"reward {rows[0].get('reward/mean'):.3f} -> {rows[-1].get('reward/mean'):.3f}")
EOF
done

echo "== TRL adapter vs TRL's GRPOTrainer on CUDA"
python3 - "$RUNS" <<'EOF'
import sys, time, statistics
from pathlib import Path
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer as TRLTrainer
from postrl.integrations.trl import GRPOTrainer
from postrl.data import load_source

out = Path(sys.argv[1])
rows = load_source({"name": "arithmetic"}).train_rows(0, 256, 0)
ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "task": r["task"]} for r in rows])

class Clock(TrainerCallback):
    def __init__(self): self.t, self.times = None, []
    def on_step_begin(self, *a, **k): torch.cuda.synchronize(); self.t = time.perf_counter()
    def on_step_end(self, *a, **k): torch.cuda.synchronize(); self.times.append(time.perf_counter() - self.t)

def correct(prompts, completions, answer, **kw):
    return [1.0 if c.strip().startswith(str(a)) else 0.0 for c, a in zip(completions, answer)]

import logging
logging.getLogger("postrl.trl").setLevel(logging.ERROR)  # (the alarms of an untrained model, every step)
def args(d): return GRPOConfig(output_dir=str(out / d), report_to="none", save_strategy="no", max_steps=10,
                               per_device_train_batch_size=32, num_generations=8, max_completion_length=64,
                               learning_rate=1e-4, logging_steps=1000, bf16=True, beta=0.0, disable_tqdm=True,
                               log_level="error")
for name, make in (("trl", lambda c: TRLTrainer(model=str(out / "m20"), reward_funcs=[correct], args=args("trl"),
                                                train_dataset=ds, callbacks=[c])),
                   # the same reward function on both sides (the 2026-11-27 run gave the adapter postrl's own
                   # `correct` instead: 788 vs 582 ms a step, not equal work)
                   ("postrl adapter", lambda c: GRPOTrainer(model=str(out / "m20"), reward_funcs=[correct],
                                                             args=args("adapter"), train_dataset=ds, callbacks=[c]))):
    c = Clock()
    tr = make(c)
    tr.train()
    steady = c.times[2:] or c.times
    print(f"  {name}: {len(c.times)} steps, median step {statistics.median(steady)*1000:.0f} ms, "
          f"peak GPU mem {torch.cuda.max_memory_allocated()/2**20:.0f} MiB", flush=True)
    torch.cuda.reset_peak_memory_stats()
EOF

[ -n "${SKIP_BENCH:-}" ] && exit 0
echo "== postrl bench --device cuda --quick"
python3 -m postrl bench --device cuda --quick --markdown "$OUT/bench.md" 2>&1 | tail -n 25
