"""REINFORCE under zero-mean reward noise: bias and variance of the policy gradient against group size and noise sd,
measured on fixed prompts over many seeds (the claim of "On Training in Imagination"; docs/claims.md), and the
budget planner (``postrl budget``) checked against the measured variance.

    python examples/compare/gradient_noise.py --out /tmp/claims/gradient_noise [--seeds 200]

No training: the policy is the shipped arithmetic warm start, fixed. For each seed, G_max completions of each of P
fixed held-out prompts are sampled at temperature 1 and scored by the task verifier (binary, clean). The per-sample
score vectors s_i = grad log pi(y_i) are computed exactly for the two output projections of the last decoder block
(attention o_proj and MLP down_proj: 65,536 weights; one batched
backward of sum_i log pi(y_i); per-sample gradients from the saved inputs and output gradients of each Linear:
grad_W_i = sum_t g_t^T x_t over the tokens of sample i). Every estimator of the seed is then a weighted sum of them:

    g = 1/P sum_p 1/G sum_{i < G} (r_pi + e_pi - b_pi) s_pi

for G in the group sizes (the first G completions), Gaussian noise e = sd z (the same z for every sd: paired), the
baseline b none (REINFORCE, the paper's case) or leave-one-out (RLOO). Over the seeds: bias (relative error and cosine
of the mean noisy gradient to the mean clean gradient of the same completions) and variance (trace), beside the
prediction tr Var = (A + B sd^2) / (G - kappa) / P of postrl.diagnostics.budget with A and B measured. A control with
binary flips (p = 0.2) shows a bias the measurement can detect: E[g] shrinks by 1 - 2p.

Planner check: with rollout cost 1 and reward-call cost ``--call-cost`` at noise sd ``--plan-sd``, each budget's
feasible (G, m) allocations (m calls averaged: noise sd / sqrt(m)) are measured, and the allocation the planner picks
from the measured A/B is compared with the measured best.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from postrl.data import load_source
from postrl.diagnostics.budget import gradient_variance, plan_budget
from postrl.generation import SamplingParams, encode_prompt
from postrl.logprobs import completion_logits
from postrl.models import load_model_and_tokenizer
from postrl.rollout.hf import HFGenerator

MODEL = "src/postrl/models/shipped/builtin-arithmetic-tiny-47ad44a34de17449"


def per_sample_grads(model, gen, layers) -> torch.Tensor:
    """[N, D]: grad of log pi(completion_i) w.r.t. the weights of ``layers`` (Linear modules), per sample."""
    saved = {}
    hooks = []
    for name, mod in layers:
        hooks.append(mod.register_forward_hook(lambda m, inp, out, n=name: saved.__setitem__((n, "x"), inp[0].detach())))
        hooks.append(mod.register_full_backward_hook(
            lambda m, gi, go, n=name: saved.__setitem__((n, "g"), go[0].detach())))
    model.zero_grad(set_to_none=True)
    logits = completion_logits(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids)
    logp = torch.log_softmax(logits, -1).gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1)
    (logp * gen.completion_mask).sum().backward()
    for h in hooks:
        h.remove()
    parts = [torch.einsum("bto,bti->boi", saved[(n, "g")], saved[(n, "x")]).reshape(gen.completion_ids.shape[0], -1)
             for n, _ in layers]
    return torch.cat(parts, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="compare/gradient_noise")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--groups", default="2,4,8,16,32,64")
    ap.add_argument("--sds", default="0,0.5,1,2")
    ap.add_argument("--flip", type=float, default=0.2)
    ap.add_argument("--plan-sd", type=float, default=1.0)
    ap.add_argument("--call-cost", type=float, default=0.25)
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    groups = [int(x) for x in args.groups.split(",")]
    sds = [float(x) for x in args.sds.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    gmax = max(groups)
    t0 = time.time()

    model, tok = load_model_and_tokenizer(MODEL)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    last = model.model.layers[-1]
    layers = [(n, m) for n, m in last.named_modules() if n in ("self_attn.o_proj", "mlp.down_proj")]
    for _, m in layers:
        m.weight.requires_grad_(True)
    dim = sum(m.weight.numel() for _, m in layers)
    task = load_source({"name": "arithmetic", "chatty": 0.6})
    sampler = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)

    # fixed prompts: held-out ones whose accuracy under the policy is nearest 0.5 (most within-prompt signal)
    pool = task.eval_rows(40, 0)
    probe = sampler.generate([encode_prompt(tok, r["prompt"], "auto") for r in pool], 32, params, seed=12345)
    acc = [sum(task.verify(probe.texts[i * 32 + j], r) for j in range(32)) / 32 for i, r in enumerate(pool)]
    order = sorted(range(len(pool)), key=lambda i: abs(acc[i] - 0.5))[:args.prompts]
    rows = [pool[i] for i in order]
    prompt_ids = [encode_prompt(tok, r["prompt"], "auto") for r in rows]
    P = len(rows)

    # configurations: (kind, G, sd or p, baseline, m)
    configs = []
    for base in ("none", "loo"):
        for g in groups:
            if base == "loo" and g < 2:
                continue
            for sd in sds:
                configs.append(("noise", g, sd, base, 1))
            configs.append(("flip", g, args.flip, base, 1))
    plan_cands = {}
    for budget in budgets:
        for base in ("none", "loo"):
            for m in range(1, 17):
                g = int(math.floor(budget / (1 + m * args.call_cost) + 1e-9))
                if g < 2 or g > gmax:
                    continue
                key = ("plan", g, args.plan_sd, base, m)
                plan_cands.setdefault(key, []).append(budget)
                if key not in configs:
                    configs.append(key)
    for base in ("none", "loo"):  # every candidate's clean counterpart is a configuration too
        for c in list(configs):
            if c[3] == base and ("noise", c[1], 0.0, base, 1) not in configs:
                configs.append(("noise", c[1], 0.0, base, 1))
    K = len(configs)
    clean_of = torch.tensor([configs.index(("noise", c[1], 0.0, c[3], 1)) for c in configs])
    gen_rng = torch.Generator().manual_seed(2026)
    sum_g = torch.zeros(K, dim, dtype=torch.float64)
    sum_sq = torch.zeros(K, dtype=torch.float64)
    sum_d = torch.zeros(K, dim, dtype=torch.float64)  # noisy minus the clean estimate of the same completions
    sum_dsq = torch.zeros(K, dtype=torch.float64)
    s_sq = torch.zeros(P, dtype=torch.float64)  # sum of ||s||^2 per prompt
    rs_sum = torch.zeros(P, dim, dtype=torch.float64)  # sum of r s per prompt
    rs_sq = torch.zeros(P, dtype=torch.float64)  # sum of ||r s||^2
    r_sum = torch.zeros(P, dtype=torch.float64)
    n_per = 0
    for seed in range(args.seeds):
        gen = sampler.generate(prompt_ids, gmax, params, seed=seed)
        r = torch.tensor([task.verify(gen.texts[i], rows[i // gmax]) for i in range(P * gmax)],
                         dtype=torch.float64).view(P, gmax)
        S = per_sample_grads(model, gen, layers)  # [P*gmax, D] float32
        Sv = S.view(P, gmax, dim)
        nrm = (Sv.double() ** 2).sum(-1)  # [P, gmax]
        s_sq += nrm.sum(1)
        rs_sum += (r.float().unsqueeze(-1) * Sv).sum(1).double()
        rs_sq += (r ** 2 * nrm).sum(1)
        r_sum += r.sum(1)
        n_per += gmax
        z = torch.randn(P, gmax, generator=gen_rng, dtype=torch.float64)
        u = torch.rand(P, gmax, generator=gen_rng, dtype=torch.float64)
        zm = {m: torch.randn(P, gmax, m, generator=gen_rng, dtype=torch.float64).mean(-1) for m in range(1, 17)}
        W = torch.zeros(K, P, gmax, dtype=torch.float64)
        for k, (kind, g, level, base, m) in enumerate(configs):
            rc = r[:, :g]
            if kind == "noise":
                rn = rc + level * z[:, :g]
            elif kind == "flip":
                rn = torch.where(u[:, :g] < level, 1 - rc, rc)
            else:
                rn = rc + level * zm[m][:, :g]
            if base == "loo":
                rn = rn - (rn.sum(1, keepdim=True) - rn) / (g - 1)
            W[k, :, :g] = rn / g / P
        est = (W.view(K, -1).float() @ S).double()
        clean = est[clean_of]  # the clean estimate of the same completions, group size and baseline
        sum_g += est
        sum_sq += (est ** 2).sum(1)
        d = est - clean
        sum_d += d
        sum_dsq += (d ** 2).sum(1)
        if seed % 20 == 0:
            print(f"seed {seed}: {time.time() - t0:.0f}s, accuracy {r.mean():.3f}", flush=True)

    n = args.seeds
    mean_g = sum_g / n
    var = (sum_sq - n * (mean_g ** 2).sum(1)) / (n - 1)
    mean_d = sum_d / n
    var_d = (sum_dsq - n * (mean_d ** 2).sum(1)) / (n - 1)
    B = s_sq / n_per  # E||s||^2 per prompt
    mu = rs_sum / n_per  # E[r s] per prompt (the true gradient of prompt p)
    A_none = rs_sq / n_per - (mu ** 2).sum(1)  # per-sample variance of r s (no baseline)
    p_acc = r_sum / n_per
    ref = mu.mean(0)  # the clean policy gradient over the P prompts (all samples)
    idx = {c: k for k, c in enumerate(configs)}
    result = {"prompts": [r["prompt"] for r in rows], "accuracy": p_acc.tolist(), "dim": dim, "seeds": n,
              "B": B.tolist(), "A_none": A_none.tolist(), "ref_norm": float(ref.norm()), "rows": [], "plan": []}

    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    for (kind, g, level, base, m), k in idx.items():
        if kind == "plan":
            continue
        clean_k = idx[("noise", g, 0.0, base, 1)] if ("noise", g, 0.0, base, 1) in idx else None
        kappa = 1 if base == "loo" else 0
        noise_pred = float((B * (level ** 2)).sum() / P ** 2 / (g - kappa)) if kind == "noise" else float("nan")
        clean_mean = mean_g[clean_k] if clean_k is not None else None
        row = {"kind": kind, "G": g, "level": level, "baseline": base,
               "rel_err": float(mean_d[k].norm() / clean_mean.norm()),
               # the relative error expected from finite seeds alone (zero bias): sqrt(tr Var(d) / n) / ||clean mean||
               "rel_err_null": float(math.sqrt(max(var_d[k].item(), 0) / n) / clean_mean.norm()),
               "cos_clean": cos(mean_g[k], clean_mean), "cos_true": cos(mean_g[k], ref),
               "var": float(var[k]), "noise_var": float(var_d[k]), "noise_var_pred": noise_pred,
               "var_clean": float(var[clean_k])}
        if base == "none":
            row["var_pred"] = float(((A_none + B * level ** 2) if kind == "noise" else A_none).sum() / P ** 2 / g) \
                if kind == "noise" else float("nan")
        result["rows"].append(row)

    # planner check: A/B from the measured clean variance at the largest G (per baseline), then plan each budget
    for base in ("none", "loo"):
        kappa = 1 if base == "loo" else 0
        gl = max(groups)
        vclean = float(var[idx[("noise", gl, 0.0, base, 1)]]) * (gl - kappa)  # = sum_p A_p / P^2
        bbar = float(B.sum()) / P ** 2
        signal = vclean / bbar
        for budget in budgets:
            cands = [(c, idx[c]) for c, bs in plan_cands.items() if budget in bs and c[3] == base]
            measured = sorted(((float(var[k]), c[4], c[1]) for c, k in cands))
            plan = plan_budget(budget, noise_sd=args.plan_sd, signal=signal, rollout_cost=1.0,
                               call_cost=args.call_cost, baseline=base, max_calls=16)
            pred = {(c[4], c[1]): gradient_variance(c[1], c[4], noise_sd=args.plan_sd, signal=signal,
                                                     baseline=base) * bbar for c, _ in cands}
            result["plan"].append({"budget": budget, "baseline": base, "signal": signal,
                                   "planned": [plan.calls, plan.group_size], "continuous": plan.continuous_calls,
                                   "measured_best": [measured[0][1], measured[0][2]],
                                   "candidates": [{"calls": m, "G": g, "var": v, "pred": pred[(m, g)]}
                                                  for v, m, g in sorted(measured, key=lambda x: x[1])]})
    result["wall_s"] = time.time() - t0
    (out / "gradient_noise.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("prompts", "accuracy", "dim", "wall_s")}))
    for row in result["rows"]:
        print(row)
    for p in result["plan"]:
        print(p["budget"], p["baseline"], "planned", p["planned"], "measured best", p["measured_best"],
              f"m* {p['continuous']:.2f}", [(c["calls"], c["G"], round(c["var"] * 1e4, 3), round(c["pred"] * 1e4, 3))
                                          for c in p["candidates"]])


if __name__ == "__main__":
    main()
