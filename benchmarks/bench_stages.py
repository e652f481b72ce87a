"""Time the advantage estimators and the policy losses on a large synthetic batch, on CPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_stages.py                 # 1M completions x 256 tokens, G = 8
    python benchmarks/bench_stages.py --n 65536 --only grpo,ppo_clip    # a quick look

The batch is processed in chunks of ``--chunk`` completions (whole groups), so that every [N, T] tensor of a chunk
stays small (131072 x 256 float32 = 134 MB); batch-level statistics (whitening, GDPO's batch normalisation, GPG's
alpha) are therefore per chunk. Inputs are random: binary rewards (plus a second reward component for GDPO),
lengths uniform in [1, T], sampler log-probs, token entropies, values, and for the estimators that read
a trainer-produced input (greedy_reward, token_entropy, prompt_logprob, info_gain, values) that input is given, so
the time is the estimator's own, not the model forward that produces it. A loss is timed forward + backward through
``logp`` (a leaf tensor), with its aggregation's weights (token_mean, or the loss's own pairing). Times are the
total over all chunks, best of ``--repeat`` runs; input generation is excluded.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from postrl import registry
from postrl.stages import call_stage


def make_chunk(n: int, T: int, G: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    g = torch.arange(n // G).repeat_interleave(G)
    lens = torch.randint(1, T + 1, (n,), generator=gen)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    rewards = (torch.rand(n, 2, generator=gen) < torch.tensor([0.4, 0.7])).float()
    reward = rewards[:, 0] + 0.2 * rewards[:, 1]
    logp = -torch.rand(n, T, generator=gen) * mask
    return {
        "reward": reward, "rewards": rewards, "reward_names": ["correct", "format"],
        "reward_weights": torch.tensor([1.0, 0.2]), "group_ids": g, "valid": torch.ones(n, dtype=torch.bool),
        "completion_mask": mask, "lengths": lens.float(), "sampler_logprobs": logp,
        "token_entropy": torch.rand(n, T, generator=gen) * mask, "greedy_reward": torch.rand(n, generator=gen),
        "prompt_logprob": -torch.rand(n, generator=gen) - 1.0, "info_gain": torch.randn(n, generator=gen),
        "values": torch.randn(n, T, generator=gen) * mask,
        "prompts": ["q"] * n, "completions": [""] * n,
        # loss inputs
        "logp": logp, "old_logp": logp + 0.05 * torch.randn(n, T, generator=gen) * mask, "mask": mask,
    }


def stage(kind: str, name: str):
    fn = registry.get(kind, name)
    return fn() if inspect.isclass(fn) else fn


def bench_advantage(name: str, chunks: list[dict]) -> float:
    fn = stage("advantage", name)
    t0 = time.perf_counter()
    for c in chunks:
        call_stage(fn, c, {}, what=name)
    return time.perf_counter() - t0


LOSS_AGG = {"gspo": "sequence", "gpg": "token_mean"}


def bench_loss(name: str, chunks: list[dict], adv: list[torch.Tensor]) -> float:
    fn = stage("loss", name)
    total = 0.0
    for c, a in zip(chunks, adv):
        agg = registry.get("aggregation", LOSS_AGG.get(name, "token_mean"))
        logp = c["logp"].clone().requires_grad_(True)
        fields = dict(c, logp=logp, advantages=a, entropy=c["token_entropy"], ref_logp=c["old_logp"],
                      sampler_logp=c["sampler_logprobs"])
        t0 = time.perf_counter()
        w = agg(c["mask"], max_len=c["mask"].shape[1])
        loss_mat, _ = call_stage(fn, fields, {}, what=name)
        (w * loss_mat).sum().backward()
        total += time.perf_counter() - t0
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1 << 20, help="completions (default 1048576)")
    p.add_argument("--t", type=int, default=256, help="tokens per completion (padded width)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--chunk", type=int, default=1 << 17, help="completions per chunk (whole groups)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--only", default="", help="comma-separated names to run (advantages and/or losses)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk % args.group_size or args.n % args.chunk:
        raise SystemExit("--chunk must be a multiple of --group-size and divide --n")
    only = {x for x in args.only.split(",") if x}
    nchunks = args.n // args.chunk
    print(f"{args.n} completions x {args.t} tokens, G = {args.group_size}, {nchunks} chunks of {args.chunk}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = []
    # one chunk of inputs at a time is enough memory: time each stage on chunk k, for k in 0..nchunks-1
    adv_names = [n for n in registry.names("advantage") if not only or n in only]
    loss_names = [n for n in registry.names("loss") if not only or n in only]
    times = {("advantage", n): [] for n in adv_names} | {("loss", n): [] for n in loss_names}
    for k in range(nchunks):
        chunk = [make_chunk(args.chunk, args.t, args.group_size, seed=k)]
        adv = [torch.randn(args.chunk, generator=torch.Generator().manual_seed(k))]
        for n in adv_names:
            times[("advantage", n)].append(min(bench_advantage(n, chunk) for _ in range(args.repeat)))
        for n in loss_names:
            times[("loss", n)].append(min(bench_loss(n, chunk, adv) for _ in range(args.repeat)))
        del chunk, adv
    print(f"{'kind':10s} {'name':24s} {'seconds':>9s} {'M completions/s':>16s} {'M tokens/s':>11s}")
    for (kind, n), ts in times.items():
        s = sum(ts)
        results.append((kind, n, s))
        print(f"{kind:10s} {n:24s} {s:9.3f} {args.n / s / 1e6:16.2f} {args.n * args.t / s / 1e6:11.1f}", flush=True)


if __name__ == "__main__":
    main()
