"""``postrl budget``: the group size and reward calls per completion that a fixed budget should buy, given the
reward's noise (:mod:`postrl.diagnostics.budget`)."""

from __future__ import annotations

import json
import math

from postrl.errors import ConfigError


def _option(text: str) -> tuple[str, float, float]:
    parts = text.split(":")
    if len(parts) != 3:
        raise ConfigError(f"--option: expected NAME:NOISE_SD:CALL_COST, got '{text}'")
    try:
        return parts[0], float(parts[1]), float(parts[2])
    except ValueError:
        raise ConfigError(f"--option: expected NAME:NOISE_SD:CALL_COST with numbers, got '{text}'") from None


def run(args) -> int:
    from postrl.diagnostics.budget import estimate_noise, gradient_variance, plan_options, signal_var
    from postrl.io import read_jsonl

    measured = None
    if args.scores:
        measured = estimate_noise(read_jsonl(args.scores))
    noise_sd = args.noise_sd if args.noise_sd is not None else measured["noise_sd"] if measured else None
    if noise_sd is None and not args.option:
        raise ConfigError("--noise-sd: give the reward's noise (sd of repeated calls on one completion), "
                          "--scores FILE to measure it, or --option NAME:NOISE_SD:CALL_COST")
    if args.signal_var is not None:
        signal = args.signal_var
    else:
        sd = args.reward_sd if args.reward_sd is not None else measured["reward_sd"] if measured else None
        mean = args.reward_mean if args.reward_mean is not None else measured["reward_mean"] if measured else 0.0
        if sd is None or not math.isfinite(sd):
            raise ConfigError("--reward-sd: give the clean reward's sd within a prompt (0.5 for a binary reward at "
                              "50% accuracy), --signal-var, or --scores FILE with several completions per prompt")
        signal = signal_var(sd, mean, args.baseline)
    if signal <= 0:
        raise ConfigError(f"--signal-var: expected a value > 0 (the clean reward must vary), got {signal:g}")
    options = [_option(o) for o in args.option]
    if noise_sd is not None:
        options.insert(0, ("reward", noise_sd, args.call_cost))
    plans = plan_options(args.budget, options, signal=signal, rollout_cost=args.rollout_cost,
                         baseline=args.baseline, max_calls=args.max_calls, min_group=args.min_group)
    if args.json:
        print(json.dumps({"signal_var": signal, "measured": measured, "plans": [p.as_dict() for p in plans]},
                         indent=1))
        return 0
    if measured:
        print(f"measured from {args.scores}: noise sd {measured['noise_sd']:.4g} over {measured['calls']} calls on "
              f"{measured['completions']} completions; clean reward sd within a prompt {measured['reward_sd']:.4g}, "
              f"mean {measured['reward_mean']:.4g}")
    best = plans[0]
    print(f"budget {args.budget:g} per prompt, rollout {args.rollout_cost:g}, baseline {args.baseline}, "
          f"signal A/B {signal:.4g}")
    for p in plans:
        cost = next(c for n, _, c in options if n == p.option)
        sd = next(s for n, s, _ in options if n == p.option)
        mark = "*" if p is best else " "
        print(f"{mark} {p.option}: noise sd {sd:g}, call cost {cost:g}: group_size {p.group_size}, "
              f"{p.calls} call(s) per completion (continuous optimum {p.continuous_calls:.3g}), cost {p.cost:g}, "
              f"gradient variance {p.variance:.4g} x E||grad log pi||^2 ({p.noise_share:.0%} from the noise)")
    sd = next(s for n, s, _ in options if n == best.option)
    cost = next(c for n, _, c in options if n == best.option)
    k = 1 if args.baseline == "loo" else 0
    if sd > 0:  # the trade-off of the chosen scorer (a noiseless one is scored once)
        print("calls  group  variance   (" + best.option + ")")
    for m in range(1, min(args.max_calls, max(8, 2 * best.calls)) + 1 if sd > 0 else 1):
        g = int(math.floor(args.budget / (args.rollout_cost + m * cost) + 1e-9))
        if g <= k:
            break
        v = gradient_variance(g, m, noise_sd=sd, signal=signal, baseline=args.baseline)
        print(f"{m:5d}  {g:5d}  {v:.4g}{'  <- best' if m == best.calls else ''}")
    which = f" with '{best.option}'" if len(plans) > 1 else ""
    print(f"set rollout.group_size: {best.group_size} and score each completion {best.calls} time(s){which} "
          f"(the reward is the mean of the calls)")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser(
        "budget", help="group size and reward calls per completion for a fixed budget, given the reward's noise",
        description="Plan a prompt's budget between rollouts and reward calls (after 'On Training in Imagination': "
        "zero-mean reward noise adds gradient variance (A + B sd^2/m)/G; under G (c_r + m c_q) <= budget the "
        "optimum is m* = sd sqrt(c_r / (signal_var c_q))). docs/budget.md.")
    b.add_argument("--budget", type=float, required=True, help="cost units per prompt (a step's budget / prompts)")
    b.add_argument("--noise-sd", type=float, default=None, help="sd of repeated reward calls on one completion")
    b.add_argument("--scores", default=None, metavar="FILE",
                   help="JSONL of repeated scores (prompt, completion, score): measures noise sd and reward sd")
    b.add_argument("--reward-sd", type=float, default=None, help="clean reward's sd within a prompt")
    b.add_argument("--reward-mean", type=float, default=None, help="clean reward's mean (baseline none: E[r^2])")
    b.add_argument("--signal-var", type=float, default=None,
                   help="A/B directly: per-sample clean gradient variance over E||grad log pi||^2")
    b.add_argument("--rollout-cost", type=float, default=1.0, help="cost of generating one completion (default 1)")
    b.add_argument("--call-cost", type=float, default=0.0, help="cost of one reward call (default 0)")
    b.add_argument("--option", action="append", default=[], metavar="NAME:NOISE_SD:CALL_COST",
                   help="another scorer to compare (repeatable): a cheap noisy judge vs an expensive clean one")
    b.add_argument("--baseline", choices=("loo", "none"), default="loo",
                   help="loo: a leave-one-out / group baseline (RLOO, GRPO family; default); none: plain REINFORCE")
    b.add_argument("--max-calls", type=int, default=64, help="most calls per completion considered")
    b.add_argument("--min-group", type=int, default=None, help="smallest group (default 2 with loo, 1 with none)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=run)
