"""Soak: run `postrl train` for many steps and watch the process from outside.

    python scripts/soak.py --steps 2000 --out soak.json [KEY=VALUE ...]     # the demo config by default

Every ``--every`` seconds it records the training process's resident memory (VmRSS, and VmHWM, the peak so far),
its open file descriptors (/proc/PID/fd), the step it reached (metrics.jsonl lines) and the run directory's size per
file. At the end it prints and writes (``--out``) a summary: memory and descriptors after warm-up (the first 10% of
steps) against the end, their slope per 100 steps (and the memory's over the second half of the steps, where the
heap has met the largest batches: the figure that tells a leak from warm-up), and the bytes that metrics.jsonl,
samples.jsonl and the whole run directory add per step. docs/reliability.md holds the measured figures; `make soak`
runs it (2,000 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(val.split()[0])  # kB
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return {}
    return out if "VmRSS" in out and "VmHWM" in out else {}  # (an exiting process has no memory lines)


def _sizes(run: Path) -> dict[str, int]:
    sizes = {name: (run / name).stat().st_size for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl")
             if (run / name).exists()}
    sizes["run_dir"] = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    return sizes


def _steps(run: Path) -> int:
    try:
        return sum(1 for _ in (run / "metrics.jsonl").open())
    except OSError:
        return 0


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value against step."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((s - mx) ** 2 for s, _ in points)
    return sum((s - mx) * (v - my) for s, v in points) / den if den else 0.0


def soak(steps: int, overrides: list[str], every: float = 2.0, workdir: Path | None = None) -> dict:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="postrl-soak-"))
    run = workdir / "run"
    cmd = [sys.executable, "-m", "postrl", "train", "--quiet", f"output_dir={run}", f"train.steps={steps}",
           "train.eval_every=0", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict] = []
    t0 = time.time()
    while proc.poll() is None:
        st = _status(proc.pid)
        if st and run.exists():
            samples.append({"t": round(time.time() - t0, 2), "step": _steps(run), **st, **_sizes(run)})
        time.sleep(every)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"soak: postrl train exited {proc.returncode}: {err[-2000:]}")
    done = _steps(run)
    final = _sizes(run)
    warm = [s for s in samples if s["step"] >= max(1, steps // 10)]
    rss = [(s["step"], s["VmRSS"] / 1024) for s in warm]
    # the second half of the steps, without the end of the run (the final save and evaluation add their own peak)
    late = [(s["step"], s["VmRSS"] / 1024) for s in samples if steps // 2 <= s["step"] < steps]
    fds = [(s["step"], s["fds"]) for s in warm]
    summary = {
        "steps": done, "wall_s": round(time.time() - t0, 1), "samples": len(samples),
        "rss_mib_after_warmup": round(rss[0][1], 1) if rss else None,
        "rss_mib_end": round(rss[-1][1], 1) if rss else None,
        "rss_mib_max_after_warmup": round(max(v for _, v in rss), 1) if rss else None,
        "rss_mib_per_100_steps": round(100 * _slope(rss), 3),
        "rss_mib_at_half": round(late[0][1], 1) if late else None,
        "rss_mib_per_100_steps_second_half": round(100 * _slope(late), 3),
        "peak_rss_mib": round(max(s["VmHWM"] for s in samples) / 1024, 1) if samples else None,
        "fds_after_warmup": fds[0][1] if fds else None, "fds_end": fds[-1][1] if fds else None,
        "fds_max": max((v for _, v in fds), default=None),
        "bytes_per_step": {k: round(v / max(done, 1), 1) for k, v in final.items()},
        "final_bytes": final,
    }
    return {"summary": summary, "series": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between two readings")
    ap.add_argument("--out", help="write the summary and the readings as JSON")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    res = soak(args.steps, args.overrides, args.every)
    print(json.dumps(res["summary"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
