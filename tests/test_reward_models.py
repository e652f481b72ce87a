"""Reward models: losses, data checks, save/load, the `model` reward source, PRM step labels, and the
demonstrations on synthetic data where the truth is known (learned rationality, ODIN, ensembles under
best-of-n pressure, Monte-Carlo PRM labels).

Texts are strings over a small alphabet scored by the character tokenizer; the true quality is a known function
of the characters. The rationality demonstration runs a nano Llama (`tiny:nano`, the code path of any HF
backbone); the others use the bag-of-tokens backbone (`bag:<dim>`, a real PreTrainedModel behind AutoModel)
for speed.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from postrl import registry
from postrl.cli import main as cli_main
from postrl.errors import ConfigError, DataError
from postrl.reward_models import (
    PreferencePair,
    RewardEnsemble,
    RewardModel,
    RMTrainConfig,
    aggregate_ensemble,
    best_of_many_accuracy,
    bt_loss,
    fit_prm,
    fit_reward_model,
    hf_sampler,
    load_reward_model,
    mc_step_labels,
    odin_penalties,
    pairwise_accuracy,
    pearson,
    preference_ece,
    read_preferences,
    reduce_steps,
    starc_distance,
    step_pieces,
)
from fake_chat import ChatEndpoint

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ helpers
def quality(t: str) -> int:
    return t.count("a") - t.count("b")


def rand_text(rng: random.Random, lo: int = 4, hi: int = 12, alphabet: str = "abcd") -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def pair_scores(model, pairs):
    n = len(pairs)
    s = model.score([p.prompt for p in pairs] * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs])
    s = s.mean(-1) if s.shape[1] > 1 else s[:, 0]
    return s[:n], s[n:]


def truth_accuracy(model, pairs) -> float:
    """Accuracy against the true quality (pairs of equal quality skipped)."""
    keep = [p for p in pairs if quality(p.chosen) != quality(p.rejected)]
    sc, sr = pair_scores(model, keep)
    truth = torch.tensor([quality(p.chosen) > quality(p.rejected) for p in keep])
    return float(((sc > sr) == truth).float().mean())


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ losses
def test_bt_loss_matches_hand_formulas():
    rc, rr = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.5])
    assert torch.allclose(bt_loss(rc, rr), -torch.log(torch.sigmoid(rc - rr)))
    m = torch.tensor([0.3, 1.0])  # Llama-2 margin: -log sigmoid(r_c - r_r - m)
    assert torch.allclose(bt_loss(rc, rr, margin=m), -torch.log(torch.sigmoid(rc - rr - m)))
    beta = torch.tensor([2.0, 0.5])  # rationality: -log sigmoid(beta (r_c - r_r))
    assert torch.allclose(bt_loss(rc, rr, beta=beta), -torch.log(torch.sigmoid(beta * (rc - rr))))
    y = torch.tensor([0.8, 0.3])  # soft labels (data smoothing)
    d = rc - rr
    want = -(y * torch.log(torch.sigmoid(d)) + (1 - y) * torch.log(torch.sigmoid(-d)))
    assert torch.allclose(bt_loss(rc, rr, target=y), want)
    # [B, K] heads with [B] per-pair beta / margin broadcast per row
    rc2, rr2 = torch.stack([rc, rc + 1], 1), torch.stack([rr, rr], 1)
    got = bt_loss(rc2, rr2, beta=beta, margin=m)
    assert got.shape == (2, 2)
    assert torch.allclose(got[:, 1], -torch.log(torch.sigmoid(beta * (rc + 1 - rr) - m)))


def test_odin_penalties_and_pearson():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert pearson(x, 2 * x + 1).item() == pytest.approx(1.0, abs=1e-6)
    assert pearson(x, -x).item() == pytest.approx(-1.0, abs=1e-6)
    assert pearson(x, torch.ones(4)).item() == 0.0
    lengths = torch.tensor([3.0, 5.0, 9.0, 1.0])
    q = torch.tensor([0.1, -0.2, 0.3, 0.0])
    w_l, w_q = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    l_len, l_orth = odin_penalties(lengths * 2, q, lengths, w_l, w_q)
    assert l_len.item() == pytest.approx(abs(pearson(q, lengths).item()) - 1.0, abs=1e-6)
    assert l_orth.item() == pytest.approx(abs(0.5 - 2.0))


def test_eval_metrics_by_hand():
    assert pairwise_accuracy([1.0, 2.0, 3.0, 0.0], [0.0, 2.0, 1.0, 1.0]) == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    # one correct vs many wrong: solved only when above every wrong one (a tie fails)
    assert best_of_many_accuracy([5.0, 1.0, 2.0], [[1.0, 4.9], [0.0, 3.0], [2.0]]) == pytest.approx(1 / 3)
    # STARC: invariant to per-prompt shifts and positive scale; opposite rewards are at distance 2
    r1 = torch.tensor([1.0, 2.0, 0.0, 5.0, 3.0])
    g = ["p", "p", "q", "q", "q"]
    shifted = 3 * r1 + torch.tensor([10.0, 10.0, -4.0, -4.0, -4.0])
    assert starc_distance(r1, shifted, g) == pytest.approx(0.0, abs=1e-9)
    assert starc_distance(r1, -r1, g) == pytest.approx(2.0, abs=1e-9)
    assert 0.0 < starc_distance(r1, torch.tensor([2.0, 1.0, 0.0, 5.0, 3.0]), g) < 2.0
    # preference ECE: symmetrised; a perfectly separated, confident model is calibrated
    assert preference_ece([100.0] * 4, [0.0] * 4) == pytest.approx(0.0, abs=1e-9)
    # confident (p = sigmoid(2)) but right only half the time: every bin's outcome mean is 1/2
    assert preference_ece([2.0, 0.0], [0.0, 2.0]) == pytest.approx(sigmoid(2.0) - 0.5)
    s = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    assert aggregate_ensemble(s, "min").tolist() == [1.0, 2.0]
    assert aggregate_ensemble(s, "uwo", 0.5).tolist() == [2.0 - 0.5 * 1.0, 2.0]
    steps = torch.tensor([[0.9, 0.2, 0.7], [0.5, float("nan"), float("nan")], [float("nan")] * 3])
    assert reduce_steps(steps, "min")[:2].tolist() == pytest.approx([0.2, 0.5])
    assert reduce_steps(steps, "last")[:2].tolist() == pytest.approx([0.7, 0.5])
    assert math.isnan(reduce_steps(steps, "min")[2].item())


def test_step_pieces_follow_the_run_delimiter():
    assert step_pieces("a\n\nb\n\nc") == ["a\n\n", "b\n\n", "c"]
    assert step_pieces("a\n\n\n\nb\n\n") == ["a\n\n\n\n", "b\n\n"]  # a blank step merges into the one before
    assert step_pieces("") == [] and step_pieces("one") == ["one"]
    assert step_pieces("x1\n\ny2\n\nz", steps=["x1", "y2", "z"]) == ["x1\n\n", "y2\n\n", "z"]
    assert "".join(step_pieces("p\nq\n\nr", "\n")) == "p\nq\n\nr"


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("row, words", [
    ({"prompt": "p", "chosen": "a"}, ["row 2", "'rejected'"]),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, ["row 2", "'chosen'", "identical"]),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "annotator": 1.5}, ["row 2", "'annotator'", "float"]),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "annotator": ["x"]}, ["row 2", "'annotator'", "list"]),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "annotator": True}, ["row 2", "'annotator'"]),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, ["row 2", "'chosen'"]),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}, ["row 2", "'margin'"]),
])
def test_bad_preference_rows_name_row_and_field(tmp_path, capsys, row, words):
    f = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b", "annotator": "u1"},
                                               row])
    with pytest.raises(DataError) as e:
        read_preferences(f)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    rc = cli_main(["rm", "train", str(f), "--backbone", "bag:4", "--out", str(tmp_path / "rm")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("postrl: error:") and "row 2" in err


def test_rationality_per_annotator_needs_the_column(tmp_path):
    from postrl.reward_models.train import preference_groups

    pairs = [PreferencePair("", "a", "b", annotator="u", context="math", row=1),
             PreferencePair("", "a", "c", context="chat", row=2), PreferencePair("", "a", "d", context="math", row=3)]
    with pytest.raises(DataError, match="row 2: missing field 'annotator'"):
        preference_groups(pairs, "annotator")
    assert preference_groups(pairs, "context") == (["math", "chat"], [0, 1, 0])
    assert preference_groups(pairs, "judged") == ([], [0, 0, 0])  # per comparison, not per label
    assert preference_groups(pairs, None) == ([], [0, 0, 0])


def test_judged_rationality_betas_by_hand_and_the_bias_column(tmp_path):
    """beta_i = beta_max - (beta_max - beta_min) p_i; at r_c = r_r a comparison's gradient is -beta_i / 2, so a
    likely biased one pulls with a fraction of an unbiased one's strength."""
    from postrl.reward_models import comparison_betas

    pairs = [PreferencePair("", "a", "b", bias=p, row=i + 1) for i, p in enumerate([0.0, 0.5, 0.9, 1.0])]
    betas = comparison_betas(pairs)  # defaults beta_max 1.0, beta_min 0.1
    assert betas.tolist() == pytest.approx([1.0, 0.55, 0.19, 0.1])
    assert comparison_betas(pairs, 2.0, 0.0).tolist() == pytest.approx([2.0, 1.0, 0.2, 0.0])
    d = torch.zeros(4, requires_grad=True)
    (g,) = torch.autograd.grad(bt_loss(d, torch.zeros(4), beta=betas).sum(), d)
    assert g.tolist() == pytest.approx([-0.5, -0.275, -0.095, -0.05])
    with pytest.raises(DataError, match="row 2: no bias score"):
        comparison_betas([pairs[0], PreferencePair("", "a", "c", row=2)])
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "", "chosen": "a", "rejected": "b", "judge_p": 0.25},
                                           {"prompt": "", "chosen": "a", "rejected": "c"}])
    got = read_preferences(f, bias_column="judge_p")
    assert [p.bias for p in got] == [0.25, None]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "", "chosen": "a", "rejected": "b", "bias": 1.5}])
    with pytest.raises(DataError, match=r"row 1: field 'bias' must be a probability in \[0, 1\]"):
        read_preferences(bad)
    with pytest.raises(ConfigError, match="beta_min <= beta_max"):
        RMTrainConfig(rationality="judged", beta_min=2.0).check()


# ------------------------------------------------------------------------------------------------ save / load
def test_nano_llama_reward_model_roundtrip(tmp_path):
    """Backbone = a causal-LM checkpoint folder (what a user downloads), loaded with AutoModel."""
    from transformers import AutoModel

    from postrl.models.tiny import build_local

    build_local(tmp_path / "base", size="nano")
    rng = random.Random(0)
    pairs = []
    while len(pairs) < 64:
        x, y = rand_text(rng), rand_text(rng)
        if quality(x) != quality(y):
            c, r = (x, y) if quality(x) > quality(y) else (y, x)
            pairs.append(PreferencePair("q:", c, r, row=len(pairs) + 1))
    model = fit_reward_model(str(tmp_path / "base"), pairs, RMTrainConfig(epochs=1, batch_size=16, lr=1e-3),
                             num_heads=3, max_length=32)
    folder = model.save_pretrained(tmp_path / "rm")
    assert {"config.json", "model.safetensors", "reward_head.safetensors", "reward_model.json"} <= \
        {p.name for p in folder.iterdir()}
    assert type(AutoModel.from_pretrained(folder)).__name__ == "LlamaModel"  # the backbone is a plain HF model
    again = RewardModel.from_pretrained(folder)
    texts = [p.chosen for p in pairs[:8]]
    a, b = model.score(["q:"] * 8, texts), again.score(["q:"] * 8, texts)
    assert a.shape == (8, 3) and torch.allclose(a, b, atol=1e-5)
    # batching and padding do not change a score
    assert torch.allclose(again.score(["q:"] * 8, texts, batch_size=3), b, atol=1e-5)


# ------------------------------------------------------------------------------------------------ demonstrations
def annotator_pairs(n: int, seed: int, biased: bool = True) -> list[PreferencePair]:
    """Annotators 0, 1 label by the true quality (BT with slope 2); annotators 2, 3 label by a spurious
    feature (count of 'c'), ignoring quality."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        x, y = rand_text(rng), rand_text(rng)
        if x == y or quality(x) == quality(y):
            continue
        ann = rng.randrange(4)
        d = (quality(x) - quality(y)) if (ann < 2 or not biased) else (x.count("c") - y.count("c"))
        prefer_x = rng.random() < sigmoid(2.0 * d)
        c, r = (x, y) if prefer_x else (y, x)
        out.append(PreferencePair("", c, r, annotator=f"ann{ann}", row=len(out) + 1))
    return out


def test_demo_learned_rationality_downweights_biased_annotators():
    """Nano Llama backbone. Learned per-annotator beta (postrl's own variant, not the paper's per-comparison beta):
    the biased annotators get a much lower beta and the held-out accuracy against the true quality beats plain
    Bradley-Terry."""
    train, test = annotator_pairs(1200, 0), annotator_pairs(400, 1, biased=False)
    cfg = dict(epochs=3, batch_size=32, lr=3e-3)
    plain = fit_reward_model("tiny:nano", train, RMTrainConfig(**cfg), max_length=32)
    rational = fit_reward_model("tiny:nano", train, RMTrainConfig(**cfg, rationality="annotator",
                                                                  rationality_lr=5e-2), max_length=32)
    betas = rational.rationality_table()
    acc_plain, acc_rat = truth_accuracy(plain, test), truth_accuracy(rational, test)
    print(f"\nrationality demo: betas {json.dumps({k: round(v, 3) for k, v in sorted(betas.items())})}; held-out "
          f"accuracy vs truth: plain BT {acc_plain:.3f}, learned rationality {acc_rat:.3f}")
    assert max(betas["ann2"], betas["ann3"]) < 0.3 * min(betas["ann0"], betas["ann1"])
    assert acc_rat > acc_plain + 0.08
    assert acc_rat > 0.85


def judged_pairs(n: int, seed: int, frac: float = 0.5, flag_noise: float = 0.1) -> list[PreferencePair]:
    """A fraction ``frac`` of injected biased comparisons, labelled by a spurious feature (count of 'c') instead of
    the quality (BT slope 2 either way); every pair carries a judge's bias probability: 0.7-1.0 when flagged,
    0-0.2 otherwise, and the judge is wrong on ``flag_noise`` of the pairs."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        x, y = rand_text(rng), rand_text(rng)
        if x == y or quality(x) == quality(y):
            continue
        biased = rng.random() < frac
        d = (x.count("c") - y.count("c")) if biased else (quality(x) - quality(y))
        prefer_x = rng.random() < sigmoid(2.0 * d)
        c, r = (x, y) if prefer_x else (y, x)
        flagged = biased != (rng.random() < flag_noise)
        p = rng.uniform(0.7, 1.0) if flagged else rng.uniform(0.0, 0.2)
        out.append(PreferencePair("", c, r, row=len(out) + 1, bias=round(p, 3)))
    return out


def test_demo_judged_rationality_downweights_biased_pairs():
    """Half the training comparisons are biased (a judge flags them, with 10% errors). The per-comparison beta
    ('Mitigating Cognitive Bias in RLHF by Altering Rationality') orders held-out unbiased pairs better than a fixed
    beta, both beta = 1 (plain Bradley-Terry) and beta = the judged betas' mean."""
    from postrl.reward_models import comparison_betas

    train, test = judged_pairs(800, 0), judged_pairs(400, 1, frac=0.0)
    betas = comparison_betas(train)
    cfg = dict(epochs=3, batch_size=32, lr=3e-2)
    plain = fit_reward_model("bag:4", train, RMTrainConfig(**cfg), max_length=32)
    mean_beta = float(betas.mean())
    fixed = fit_reward_model("bag:4", train, RMTrainConfig(**cfg, rationality="judged", beta_max=mean_beta,
                                                           beta_min=mean_beta), max_length=32)
    judged = fit_reward_model("bag:4", train, RMTrainConfig(**cfg, rationality="judged"), max_length=32)
    acc = {k: truth_accuracy(m, test) for k, m in (("plain", plain), ("fixed", fixed), ("judged", judged))}
    print(f"\njudged rationality demo: held-out accuracy vs truth {json.dumps({k: round(v, 3) for k, v in acc.items()})}")
    summary = judged.meta["train"]["comparison_betas"]
    assert summary["mean"] == pytest.approx(mean_beta)
    assert summary["likely_biased"] == pytest.approx(sum(p.bias >= 0.5 for p in train) / 800)
    assert 0.4 < summary["likely_biased"] < 0.6
    assert acc["judged"] > acc["plain"] + 0.08 and acc["judged"] > acc["fixed"] + 0.08
    assert acc["judged"] > 0.85


def length_biased_pairs(n: int, seed: int, gamma: float = 0.5) -> list[PreferencePair]:
    """Labels leak length: P(x > y) = sigmoid((q(x) - q(y)) + gamma (len x - len y)); quality is independent
    of length."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        x, y = rand_text(rng, 2, 16), rand_text(rng, 2, 16)
        if x == y:
            continue
        prefer_x = rng.random() < sigmoid((quality(x) - quality(y)) + gamma * (len(x) - len(y)))
        c, r = (x, y) if prefer_x else (y, x)
        out.append(PreferencePair("", c, r, row=len(out) + 1))
    return out


def test_demo_odin_quality_head_is_decorrelated_from_length():
    train, test = length_biased_pairs(2000, 0), length_biased_pairs(500, 1)
    rng = random.Random(5)
    probe = [rand_text(rng, 2, 16) for _ in range(500)]
    L = torch.tensor([float(len(t)) for t in probe])
    cfg = RMTrainConfig(epochs=4, batch_size=64, lr=3e-2)
    bt = fit_reward_model("bag:8", train, cfg, max_length=64)
    odin = fit_reward_model("bag:8", train, cfg, kind="odin", max_length=64)
    corr_bt = float(pearson(bt.score([""] * 500, probe)[:, 0], L))
    corr_q = float(pearson(odin.score([""] * 500, probe)[:, 0], L))  # score() = the quality head only
    acc_bt = pairwise_accuracy(*pair_scores(bt, test))
    h = odin.head_outputs([""] * 1000, [p.chosen for p in test] + [p.rejected for p in test]).sum(-1)
    acc_odin = pairwise_accuracy(h[:500], h[500:])  # length + quality heads, as trained
    truth_bt, truth_q = truth_accuracy(bt, test), truth_accuracy(odin, test)
    print(f"\nODIN demo: corr(reward, length) plain BT {corr_bt:.3f}, ODIN quality head {corr_q:.3f}; held-out "
          f"accuracy (length-biased labels) BT {acc_bt:.3f}, ODIN heads {acc_odin:.3f}; accuracy vs true quality "
          f"BT {truth_bt:.3f}, ODIN quality head {truth_q:.3f}")
    assert corr_bt > 0.5 and abs(corr_q) < 0.1
    assert abs(acc_odin - acc_bt) < 0.05
    assert truth_q > truth_bt + 0.1


def gold(t: str) -> int:
    """Gold reward: quality, and the rare characters v..z (never seen in the preference data) are bad."""
    return quality(t) - 2 * sum(t.count(ch) for ch in "vwxyz")


def test_demo_ensemble_resists_best_of_n_overoptimization(tmp_path):
    """4 seeds trained on gold labels with 25% noise; best-of-n over candidates that contain characters the
    training data never had. A single proxy rewards some of them (its random extrapolation) and best-of-n finds
    them; the ensemble's min / uwo disagree-and-penalise, keeping the gold reward higher."""
    rng = random.Random(0)
    pairs = []
    while len(pairs) < 1000:
        x, y = rand_text(rng), rand_text(rng)
        if x == y or gold(x) == gold(y):
            continue
        prefer_x = (gold(x) > gold(y)) != (rng.random() < 0.25)
        pairs.append(PreferencePair("", *((x, y) if prefer_x else (y, x)), row=len(pairs) + 1))
    ens = fit_reward_model("bag:8", pairs, RMTrainConfig(epochs=3, batch_size=32, lr=3e-2), seeds=4, max_length=64)
    assert isinstance(ens, RewardEnsemble) and ens.num_scores == 4
    folder = ens.save_pretrained(tmp_path / "ens")
    trials, nmax = 60, 128
    rng = random.Random(7)
    cands = [["".join(rng.choice("vwxyz") if rng.random() < 0.3 else rng.choice("abcd")
                      for _ in range(rng.randint(4, 12))) for _ in range(nmax)] for _ in range(trials)]
    flat = [c for cs in cands for c in cs]
    # the scores come through the registered reward sources, as in `postrl train`
    model_k = [registry.get("reward", f"model/{k}") for k in range(4)]
    S = torch.tensor([f([""] * len(flat), flat, path=str(folder)) for f in model_k]).T.reshape(trials, nmax, 4)
    G = torch.tensor([float(gold(c)) for c in flat]).reshape(trials, nmax)
    mins = torch.tensor(registry.get("reward", "model")([""] * len(flat), flat, path=str(folder), aggregate="min"))
    assert torch.allclose(mins.reshape(trials, nmax), S.min(-1).values)

    def best_of(score, n):
        return float(G[:, :n].gather(1, score[:, :n].argmax(1, keepdim=True)).mean())

    table = {}
    for n in (1, 4, 16, 64, 128):
        single = sum(best_of(S[..., k], n) for k in range(4)) / 4
        table[n] = (single, best_of(S.min(-1).values, n), best_of(aggregate_ensemble(S, "uwo", 1.0), n))
    print("\nensemble demo: gold reward of best-of-n (mean single proxy / ensemble min / ensemble uwo): " +
          "; ".join(f"n={n}: {a:.2f} / {b:.2f} / {c:.2f}" for n, (a, b, c) in table.items()))
    single, wco, uwo = table[128]
    assert wco > single + 0.5 and uwo > single + 0.5


def test_heads_ensemble_columns_feed_ensemble_shaping(tmp_path):
    """K heads on one backbone -> K reward columns model/0..K-1 through score_batch -> ensemble_min shaping."""
    from postrl.rewards import score_batch

    rng = random.Random(3)
    pairs = [PreferencePair("", *sorted([rand_text(rng), rand_text(rng)], key=quality, reverse=True), row=i + 1)
             for i in range(200)]
    pairs = [p for p in pairs if p.chosen != p.rejected]
    m = fit_reward_model("bag:4", pairs, RMTrainConfig(epochs=1, batch_size=32, lr=3e-2), num_heads=3, max_length=32)
    folder = m.save_pretrained(tmp_path / "heads")
    comps = [rand_text(rng) for _ in range(6)]

    class Spec:
        def __init__(self, name, **params):
            self.name, self.params = name, params

    specs = [Spec(f"model/{k}", path=str(folder)) for k in range(3)] + [Spec("model", path=str(folder),
                                                                             aggregate="min")]
    out = score_batch([""] * 6, comps, {"group_ids": [0] * 6}, specs)
    direct = m.score([""] * 6, comps)
    assert torch.allclose(out.matrix[:, :3], direct, atol=1e-5)
    assert torch.allclose(out.matrix[:, 3], direct.min(-1).values, atol=1e-5)
    if "ensemble_min" in registry.names("shaping"):
        shaped = registry.get("shaping", "ensemble_min")(out.matrix[:, :3], ["model/0", "model/1", "model/2"],
                                                        torch.ones(3), sources=["model/0", "model/1", "model/2"])
        assert torch.allclose(shaped["rewards"][:, 0], direct.min(-1).values, atol=1e-5)


@pytest.mark.parametrize("margin, smoothing", [(True, None), (False, 0.5)])
def test_margin_and_data_smoothing_train(margin, smoothing):
    rng = random.Random(1)
    pairs = []
    while len(pairs) < 300:
        x, y = rand_text(rng), rand_text(rng)
        if quality(x) != quality(y):
            c, r = (x, y) if quality(x) > quality(y) else (y, x)
            pairs.append(PreferencePair("", c, r, margin=float(abs(quality(x) - quality(y))) / 4, row=len(pairs) + 1))
    test = pairs[250:]
    m = fit_reward_model("bag:4", pairs[:250], RMTrainConfig(epochs=3, batch_size=25, lr=3e-2, margin=margin,
                                                             smoothing=smoothing), max_length=32)
    summary = m.meta["train"]
    if smoothing:  # labels were smoothed towards the model's own predictions (IDS)
        assert 0.5 < summary["mean_soft_label"] < 1.0
    assert summary["loss"][-1] < summary["loss"][0]
    assert truth_accuracy(m, test) > 0.8


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_rm_train_and_eval(tmp_path, capsys):
    rows = []
    for p in annotator_pairs(300, 4):
        rows.append({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "annotator": p.annotator})
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    out = tmp_path / "rm"
    rc = cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(out), "--lr", "3e-2",
                   "--epochs", "2", "--rationality", "annotator", "--max-length", "32"])
    text = capsys.readouterr().out
    assert rc == 0 and "held out:" in text and "rationality betas" in text
    cfg = json.loads((out / "reward_model.json").read_text())
    assert cfg["rationality"] == "annotator" and set(cfg["rationality_betas"]) == {"ann0", "ann1", "ann2", "ann3"}
    rng = random.Random(9)
    evals = []
    for _ in range(30):
        wrong = sorted({rand_text(rng) for _ in range(4)}, key=quality)[:3]
        evals.append({"prompt": "", "chosen": "aaaaaaaa", "rejected": wrong})
    edata = write_jsonl(tmp_path / "eval.jsonl", evals)
    odin = tmp_path / "odin"
    assert cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(odin), "--odin",
                     "--lr", "3e-2", "--max-length", "32", "--chat-template", "none"]) == 0
    assert json.loads((odin / "reward_model.json").read_text())["chat_template"] == "none"  # the option reaches it
    assert cfg["chat_template"] == "auto"
    capsys.readouterr()
    assert cli_main(["rm", "eval", str(out), str(edata), "--compare", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rows"] == 30 and res["pairs"] == 90
    assert res["one_vs_many_accuracy"] > 0.7 and res["starc_distance"] == pytest.approx(0.0, abs=1e-9)
    assert cli_main(["rm", "eval", str(out), str(edata), "--compare", str(odin)]) == 0
    assert "starc_distance=" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ PRM
P_STEP, N_STEPS = 0.7, 4


def prm_row(i: int) -> dict:
    return {"prompt": "q " + "".join(chr(97 + (i // 26 ** j) % 26) for j in range(2)) + ":", "answer": "7"}


def prm_verify(completion: str, row: dict) -> float:
    return 1.0 if completion.split("\n\n") == ["7"] * N_STEPS else 0.0


def scripted_policy(seed: int):
    """Each step is '7' with probability P_STEP (else another digit); so from a prefix of k correct steps the
    chance of success is P_STEP ** (N_STEPS - k), and 0 after a wrong step."""
    def step(rng):
        return "7" if rng.random() < P_STEP else rng.choice("0123456 89".replace(" ", ""))

    def sample(prompts, prefixes, n, s):
        rng = random.Random(seed * 7919 + s)
        out = []
        for prefix in prefixes:
            k = len(step_pieces(prefix))
            out.append(["\n\n".join(step(rng) for _ in range(N_STEPS - k)) for _ in range(n)])
        return out

    return sample, step


def true_step_value(completion: str) -> list[float]:
    out, ok = [], True
    for k, piece in enumerate(step_pieces(completion), 1):
        ok = ok and piece.strip() == "7"
        out.append(P_STEP ** (N_STEPS - k) if ok else 0.0)
    return out


def test_demo_prm_monte_carlo_labels_and_step_scores(tmp_path):
    sample, step = scripted_policy(0)
    rng = random.Random(1)
    rows = [prm_row(i) for i in range(300)]
    completions = ["\n\n".join(step(rng) for _ in range(N_STEPS)) for _ in rows]
    records = mc_step_labels(rows, completions, sample, prm_verify, rollouts=16, seed=0)
    assert len(records) == 300 and all(len(r.labels) == N_STEPS for r in records)
    truth = [true_step_value(c) for c in completions]
    err = [lab - t for r, tv in zip(records, truth) for lab, t in zip(r.labels, tv)]
    mean_err = sum(err) / len(err)
    mae = sum(abs(e) for e in err) / len(err)
    print(f"\nPRM labels: {len(err)} steps, mean(label - truth) {mean_err:+.3f}, mean |label - truth| {mae:.3f}")
    assert abs(mean_err) < 0.02 and mae < 0.1  # unbiased MC estimates, binomial noise with 16 rollouts

    prm = fit_prm("bag:8", records[:240], RMTrainConfig(epochs=10, batch_size=16, lr=1e-1), max_length=64)
    held, hp = completions[240:], [r["prompt"] for r in rows[240:]]
    S = prm.step_scores(hp, held)
    assert S.shape == (60, N_STEPS)
    T = torch.tensor([true_step_value(c) for c in held])
    step_mae = float((S - T).abs().mean())
    print(f"PRM step scores on held-out completions: mean |score - true value| {step_mae:.3f}")
    assert step_mae < 0.05

    # as a reward source: step lists (the process-reward convention), or one reduced scalar
    folder = prm.save_pretrained(tmp_path / "prm")
    fn = registry.get("reward", "model")
    lists = fn(hp[:3], held[:3], path=str(folder))
    assert [len(x) for x in lists] == [N_STEPS] * 3
    assert torch.allclose(torch.tensor(lists), S[:3], atol=1e-5)
    steps_col = [[p.strip() for p in step_pieces(c)] for c in held[:3]]
    assert torch.allclose(torch.tensor(fn(hp[:3], held[:3], steps_col, path=str(folder))), S[:3], atol=1e-5)
    mins = fn(hp[:3], held[:3], path=str(folder), reduce="min")
    assert mins == pytest.approx(S[:3].min(-1).values.tolist(), abs=1e-5)
    assert type(load_reward_model(folder)) is RewardModel


def test_hf_sampler_and_prm_cli(tmp_path, capsys):
    from postrl.models.tiny import build_local

    policy, tok = build_local(tmp_path / "policy", size="nano")
    sample = hf_sampler(policy, tok, max_new_tokens=4)
    outs = sample(["1+1=", "2+2="], ["", "4"], 3, 0)
    assert len(outs) == 2 and all(len(o) == 3 and all(isinstance(x, str) for x in o) for o in outs)
    assert sample(["1+1="], [""], 3, 0) == sample(["1+1="], [""], 3, 0)  # seeded

    rc = cli_main(["prm", "train", "--policy", str(tmp_path / "policy"), "--task", "arithmetic",
                   "--task-arg", "digits=1", "--prompts", "4", "--samples", "2", "--rollouts", "2",
                   "--max-new-tokens", "3", "--backbone", "bag:4", "--out", str(tmp_path / "prm"),
                   "--labels-out", str(tmp_path / "labels.jsonl"), "--lr", "1e-2"])
    assert rc == 0, capsys.readouterr().err
    labels = [json.loads(x) for x in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert labels and all(set(r["labels"]) <= {0.0, 1.0} or len(r["labels"]) > 1 for r in labels)

    # train from labelled steps, with a held-out calibration set for `postrl calibrate`
    sample_fn, step = scripted_policy(2)
    rng = random.Random(2)
    rows = [prm_row(i) for i in range(60)]
    comps = ["\n\n".join(step(rng) for _ in range(N_STEPS)) for _ in rows]
    recs = mc_step_labels(rows, comps, sample_fn, prm_verify, rollouts=8)
    write_jsonl(tmp_path / "steps.jsonl", [r.to_json() for r in recs])
    rc = cli_main(["prm", "train", "--records", str(tmp_path / "steps.jsonl"), "--backbone", "bag:4",
                   "--out", str(tmp_path / "prm2"), "--lr", "3e-2", "--epochs", "2",
                   "--calibration-out", str(tmp_path / "calib.jsonl")])
    assert rc == 0
    calib = [json.loads(x) for x in (tmp_path / "calib.jsonl").read_text().splitlines()]
    assert len(calib) == 12 * N_STEPS and {c["condition"] for c in calib} == {"0", "1", "2", "3"}
    # with the PRM's hidden state at each step end (conditional_ot's features) and one row per held-out prompt
    rc = cli_main(["prm", "train", "--records", str(tmp_path / "steps.jsonl"), "--backbone", "bag:4",
                   "--out", str(tmp_path / "prm3"), "--lr", "3e-2", "--epochs", "1",
                   "--calibration-out", str(tmp_path / "calib2.jsonl"), "--calibration-features",
                   "--calibration-prompts"])
    assert rc == 0
    calib = [json.loads(x) for x in (tmp_path / "calib2.jsonl").read_text().splitlines()]
    steps_rows = [c for c in calib if c["condition"] != "prompt"]
    prompt_rows = [c for c in calib if c["condition"] == "prompt"]
    assert len(steps_rows) == 12 * N_STEPS and 1 <= len(prompt_rows) <= 12
    width = len(calib[0]["features"])
    assert width > 0 and all(len(c["features"]) == width for c in calib)
    assert all(0.0 <= c["outcome"] <= 1.0 for c in prompt_rows)
    rc = cli_main(["calibrate", str(tmp_path / "calib2.jsonl"), "--method", "conditional_ot", "--features-field",
                   "features", "--out", str(tmp_path / "cal2.json")])
    assert rc == 0


# ------------------------------------------------------------------------------------------------ in `postrl train`
def test_reward_models_in_a_training_run(tmp_path):
    """K heads -> reward columns model/0, model/1 -> ensemble_min shaping; a PRM as a process reward."""
    from postrl.config import load_config
    from postrl.models.tiny import build_local
    from postrl.reward_models import StepRecord
    from postrl.train.trainer import Trainer

    build_local(tmp_path / "policy", size="nano")
    pairs = [PreferencePair("1+1=", "2" + "a" * (i % 5), "x" + "b" * (i % 3), row=i + 1) for i in range(40)]
    fit_reward_model("bag:4", pairs, RMTrainConfig(lr=1e-2), num_heads=2, max_length=32).save_pretrained(
        tmp_path / "rm")
    fit_prm("bag:4", [StepRecord("1+1=", "2\n\n3", [0.5, 1.0])] * 8, RMTrainConfig(lr=1e-2),
            max_length=32).save_pretrained(tmp_path / "prm")
    base = [f"model.path={tmp_path / 'policy'}", "task.name=arithmetic", "task.digits=1", "rollout.max_new_tokens=4",
            "rollout.group_size=4", "train.prompts_per_step=4", "train.steps=1", "train.save_every=0",
            "train.eval_size=4", "train.eval_k=1"]
    rm = str(tmp_path / "rm")
    runs = {
        "ens": [f"rewards=[{{name: model/0, path: '{rm}'}}, {{name: model/1, path: '{rm}'}}, {{name: correct}}]",
                "shaping=[{name: ensemble_min, sources: [model/0, model/1]}, {name: weighted_sum}]"],
        "prm": [f"rewards=[{{name: model, path: '{tmp_path / 'prm'}'}}]"],
    }
    for name, extra in runs.items():
        cfg = load_config(None, [*base, f"output_dir={tmp_path / name}", *extra])
        Trainer(cfg, cfg.output_dir).train()
        last = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
        fails = {k: v for k, v in last.items() if k.endswith("failure_rate")}
        assert fails and all(v == 0.0 for v in fails.values()), fails
        assert math.isfinite(last["reward/mean"])


def test_parquet_preferences(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["p", "q"], "chosen": ["a", "b"], "rejected": ["c", "d"],
                             "annotator": [1, 2], "margin": [0.5, 1.0]}), tmp_path / "prefs.parquet")
    pairs = read_preferences(tmp_path / "prefs.parquet")
    assert [(p.annotator, p.margin) for p in pairs] == [("1", 0.5), ("2", 1.0)]
    pq.write_table(pa.table({"prompt": ["p", "q"], "chosen": ["a", "b"], "rejected": ["c", "d"],
                             "annotator": [0.5, 1.5]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"row 1: field 'annotator' must be a string or integer id, got float"):
        read_preferences(tmp_path / "bad.parquet")


def _bias_judge() -> ChatEndpoint:
    """A local OpenAI-compatible endpoint standing in for an LLM judge: a comparison whose task carries a
    bandwagon cue ('Most people prefer') is likely biased (score 9 of 10), others not (1); 'BROKEN' replies
    without a score."""

    def reply(body: dict) -> str:
        user = body["messages"][-1]["content"]
        return ('{"grade": 1}' if "BROKEN" in user else
                '{"score": 9, "reason": "bandwagon"}' if "Most people prefer" in user else '{"score": 1}')

    return ChatEndpoint(reply)


def test_cli_rm_train_judged_by_an_llm_judge_endpoint_and_by_a_function(tmp_path, capsys, monkeypatch):
    rows = []
    for p in judged_pairs(120, 5):
        cue = "Most people prefer c. " if p.bias >= 0.5 else ""
        rows.append({"prompt": cue, "chosen": p.chosen, "rejected": p.rejected})
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    judge = _bias_judge()
    try:
        out = tmp_path / "rm"
        rc = cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(out), "--lr", "3e-2",
                       "--rationality", "judged", "--bias-judge", judge.url, "--bias-judge-model", "critic",
                       "--eval-fraction", "0.25", "--max-length", "32"])
        text = capsys.readouterr().out
        assert rc == 0 and "bias judge: 90 pairs" in text and "comparison betas" in text
        assert len(judge.requests) == 90 and judge.requests[0]["model"] == "critic"
        assert "cognitive bias" in judge.requests[0]["messages"][0]["content"]
        assert "Preferred response (A):" in judge.requests[0]["messages"][1]["content"]
        cfg = json.loads((out / "reward_model.json").read_text())
        assert cfg["rationality"] == "judged"
        betas = cfg["meta"]["train"]["comparison_betas"]
        cued = sum(r["prompt"] != "" for r in rows)
        # score 9 -> p 0.9 -> beta 1 - 0.9 * 0.9 = 0.19; score 1 -> beta 1 - 0.9 * 0.1 = 0.91
        assert betas["min"] == pytest.approx(0.19) and betas["max"] == pytest.approx(0.91) and 0 < cued < 120
        broken = write_jsonl(tmp_path / "broken.jsonl", rows[:3] + [{**rows[3], "chosen": "BROKEN"}])
        rc = cli_main(["rm", "train", str(broken), "--backbone", "bag:4", "--out", str(tmp_path / "x"),
                       "--rationality", "judged", "--bias-judge", judge.url, "--eval-fraction", "0"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.count("\n") == 0 and "no bias probability for 1 of 4 pairs; first: row 4" in err
    finally:
        judge.close()
    # any judge postrl can call: a function (system, user) -> reply text, e.g. a local model
    (tmp_path / "my_judge.py").write_text("def judge(system, user):\n"
                                          "    return '{\"score\": 8}' if 'Most people' in user else '{\"score\": 0}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out2 = tmp_path / "rm2"
    assert cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(out2), "--rationality", "judged",
                     "--bias-judge", "my_judge:judge", "--eval-fraction", "0", "--max-length", "32"]) == 0
    betas = json.loads((out2 / "reward_model.json").read_text())["meta"]["train"]["comparison_betas"]
    assert betas["min"] == pytest.approx(1 - 0.9 * 0.8) and betas["max"] == pytest.approx(1.0)
    assert betas["likely_biased"] == pytest.approx(sum(r["prompt"] != "" for r in rows) / 120)
    capsys.readouterr()
    # the offline route: the precomputed column; without it, one line naming the row
    nocol = write_jsonl(tmp_path / "nocol.jsonl", rows[:4])
    rc = cli_main(["rm", "train", str(nocol), "--backbone", "bag:4", "--out", str(tmp_path / "y"),
                   "--rationality", "judged", "--eval-fraction", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "row 1: no bias score" in err
    assert cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(tmp_path / "z"),
                     "--bias-judge", "my_judge:judge"]) == 2
    assert "add --rationality judged" in capsys.readouterr().err
