"""Reward-model training methods of issue 29 section 4: `rm train --lm-reg` (GRM's text-generation regulariser),
HERON pairs from an ordered list of reward factors (`rm heron`), and Critique-out-Loud reward models
(`rm train --critic`, the reward `cloud`)."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from postrl import stages
from postrl.cli import main as cli_main
from postrl.errors import ConfigError, DataError
from postrl.reward_models import PreferencePair, RMTrainConfig, RewardModel, fit_reward_model, load_reward_model
from postrl.reward_models.backbones import load_backbone
from postrl.reward_models.critique import (CRITIQUE_MARKER, Critic, attach_critiques, cloud_scores, critique_request,
                                           with_critique)
from postrl.reward_models.heron import heron_compare, heron_pairs, parse_factors
from postrl.reward_models.train import bt_loss, completion_logps, lm_regularizer, train_reward_model


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digit_pairs(n: int, seed: int = 0) -> list[PreferencePair]:
    """Chosen completions hold a digit, rejected ones do not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        c = "".join(rng.choice("ab7") for _ in range(rng.randint(1, 4))) + str(i % 10)
        r = "".join(rng.choice("abx") for _ in range(rng.randint(1, 5)))
        out.append(PreferencePair("1+1=", c, r, row=i + 1))
    return out


# ================================================================================================ --lm-reg (GRM)
def lm_model(max_length: int = 64, seed: int = 0) -> RewardModel:
    bb, tok, head = load_backbone("tiny:nano", seed=seed, lm_head=True)
    return RewardModel(bb, tok, max_length=max_length, lm_head=head, chat_template="none")


def test_completion_logps_equal_the_causal_lms_own():
    """sum_t log pi(y_t | x, y_<t) through the kept LM head equals the causal LM's own log-probs of the completion
    tokens (each row alone, unpadded); with the prompt truncated away the first completion token (nothing
    predicts it) is not counted."""
    from postrl.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    lm = build_model(tok, size="nano", seed=0).eval()
    m = RewardModel(lm.get_decoder(), tok, max_length=7, lm_head=lm.get_output_embeddings(), chat_template="none")
    prompts, comps = ["1+1=", "3*4=", ""], ["2", "12ab", "xyz9876"]  # row 3: 7 completion tokens, no prompt
    enc = m.encode_many(prompts, comps)
    ids, mask = m.collate([x for x, _ in enc])
    with torch.no_grad():
        got = completion_logps(m, m.hidden(ids, mask), ids, mask, torch.tensor([c for _, c in enc]))
        for i, (x, c) in enumerate(enc):
            logits = lm(input_ids=torch.tensor([x])).logits[0]
            lp = torch.log_softmax(logits.float(), -1)
            want = sum(float(lp[j - 1, x[j]]) for j in range(max(len(x) - c, 1), len(x)))
            assert float(got[i]) == pytest.approx(want, abs=1e-5), i


def test_lm_regularizer_by_hand():
    """logsigmoid form: -log sigma(0.1 * S); S = -10 -> log(1 + e) = 1.31326; S = -20 -> log(1 + e^2) = 2.12693;
    mean 1.72010. nll form: mean(10, 20) = 15."""
    s = torch.tensor([-10.0, -20.0])
    assert float(lm_regularizer(s)) == pytest.approx((math.log(1 + math.e) + math.log(1 + math.e ** 2)) / 2, abs=1e-5)
    assert float(lm_regularizer(s, form="nll")) == pytest.approx(15.0)
    assert float(lm_regularizer(s, beta=0.2)) == pytest.approx((math.log(1 + math.e ** 2) + math.log(1 + math.e ** 4))
                                                               / 2, abs=1e-5)


def test_lm_reg_loss_is_the_weighted_sum():
    """One batch: the logged loss = (1 - alpha) mean -log sigma(r_c - r_r) + alpha mean -log sigma(beta log pi(y_c | x)),
    each computed here on a copy of the model before the step."""
    pairs = digit_pairs(6)
    m = lm_model()
    ref = copy.deepcopy(m)
    enc_c = ref.encode_many([p.prompt for p in pairs], [p.chosen for p in pairs])
    enc_r = ref.encode_many([p.prompt for p in pairs], [p.rejected for p in pairs])
    ids, mask = ref.collate([x for x, _ in enc_c] + [x for x, _ in enc_r])
    with torch.no_grad():
        out, hid = ref.forward_hidden(ids, mask)
        bt = float(bt_loss(out[:6], out[6:]).mean())
        logps = completion_logps(ref, hid[:6], ids[:6], mask[:6], torch.tensor([c for _, c in enc_c]))
        reg = float(-F.logsigmoid(0.1 * logps).mean())
    summary = train_reward_model(m, pairs, RMTrainConfig(lr=1e-3, batch_size=6, lm_reg=0.3))
    assert summary["loss"][0] == pytest.approx(0.7 * bt + 0.3 * reg, abs=1e-5)
    assert summary["lm_reg_loss"][0] == pytest.approx(reg, abs=1e-5)


def test_lm_reg_keeps_the_hidden_states_generative():
    """Bradley-Terry alone at a high learning rate wrecks what the shared hidden states say about text (the LM
    head's NLL of the chosen responses rises); with the regulariser it stays lower, while both rank the pairs."""
    pairs = digit_pairs(48)
    held = digit_pairs(40, seed=1)

    def nll(m: RewardModel) -> float:
        enc = m.encode_many([p.prompt for p in held], [p.chosen for p in held])
        ids, mask = m.collate([x for x, _ in enc])
        with torch.no_grad():
            return float(-completion_logps(m, m.hidden(ids, mask), ids, mask, torch.tensor([c for _, c in enc])).mean())

    def acc(m: RewardModel) -> float:
        s = m.score([p.prompt for p in held] * 2, [p.chosen for p in held] + [p.rejected for p in held])[:, 0]
        return float((s[:40] > s[40:]).float().mean())

    plain, reg = lm_model(), lm_model()
    start = nll(plain)
    train_reward_model(plain, pairs, RMTrainConfig(lr=3e-3, epochs=3, batch_size=8))
    train_reward_model(reg, pairs, RMTrainConfig(lr=3e-3, epochs=3, batch_size=8, lm_reg=0.5, lm_reg_form="nll"))
    assert nll(plain) > start and nll(reg) < nll(plain) - 1.0, (start, nll(plain), nll(reg))
    assert acc(plain) > 0.8 and acc(reg) > 0.8


def test_cli_lm_reg(tmp_path, capsys):
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in digit_pairs(12)]
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    out = tmp_path / "rm"
    assert cli_main(["rm", "train", str(data), "--backbone", "tiny:nano", "--out", str(out), "--lm-reg",
                     "--max-length", "32", "--lr", "1e-3"]) == 0
    meta = json.loads((out / "reward_model.json").read_text())["meta"]["train"]
    assert meta["config"]["lm_reg"] == 0.01 and meta["config"]["lm_reg_form"] == "logsigmoid"
    assert len(meta["lm_reg_loss"]) == 1 and "lm_reg" in capsys.readouterr().out
    assert load_reward_model(out).score(["1+1="], ["2"]).shape == (1, 1)  # a plain reward-model folder
    rc = cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(tmp_path / "x"), "--lm-reg"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "has no language-model head" in err
    rc = cli_main(["rm", "train", str(data), "--backbone", "tiny:nano", "--out", str(tmp_path / "x"), "--lm-reg", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "lm_reg (the text-generation loss weight alpha) must be in (0, 1), got 1.0" in err


# ================================================================================================ HERON
def test_heron_compare_by_hand():
    """Factors correct > -length (margin 2) > style (margin 0.5): the first level whose signed difference exceeds
    its margin decides, strictly."""
    f = parse_factors(["correct", "-length", "style"], [0, 2, 0.5])
    assert heron_compare([1, 50, 0], [0, 3, 9], f) == (1, 0)        # correct decides, whatever follows
    assert heron_compare([1, 9, 0], [1, 3, 0], f) == (-1, 1)        # tie on correct; -(9 - 3) = -6 < -2: b
    assert heron_compare([1, 4, 0], [1, 3, 1], f) == (-1, 2)        # |4 - 3| <= 2: style 0 - 1 = -1 < -0.5: b
    assert heron_compare([1, 5, 1.0], [1, 3, 0.5], f) == (0, -1)    # 2 is not > 2; 0.5 is not > 0.5: undecided
    assert heron_compare([0, 1, 0], [0, 4, 0], f) == (1, 1)         # lower length wins by 3 > 2


def test_heron_pairs_from_samples_rows():
    """Rows of a run's samples.jsonl (factors in 'rewards'; 'length' from the text): all pairs within a prompt,
    chosen = the winner, level = the deciding factor; counts per level; identical completions skipped."""
    rows = [{"prompt": "p", "completion": "aaaa", "rewards": {"correct": 1.0}},
            {"prompt": "p", "completion": "a", "rewards": {"correct": 1.0}},
            {"prompt": "p", "completion": "bb", "rewards": {"correct": 0.0}},
            {"prompt": "q", "completion": "x", "rewards": {"correct": 0.0}},
            {"prompt": "q", "completion": "xy", "rewards": {"correct": 0.0}},
            {"prompt": "q", "completion": "x", "rewards": {"correct": 1.0}}]
    pairs, counts = heron_pairs(rows, parse_factors(["correct", "-length"], [0, 1]))
    assert pairs == [{"prompt": "p", "chosen": "a", "rejected": "aaaa", "level": "length"},   # tie; -(4 - 1) < -1
                     {"prompt": "p", "chosen": "aaaa", "rejected": "bb", "level": "correct"},
                     {"prompt": "p", "chosen": "a", "rejected": "bb", "level": "correct"},
                     {"prompt": "q", "chosen": "x", "rejected": "xy", "level": "correct"}]    # rows 5 and 6
    # q: x vs xy ties on correct and |1 - 2| = 1 is not > 1: undecided; x vs x (same text): not compared
    assert counts["compared"] == 5
    assert (counts["decided/correct"], counts["decided/length"], counts["undecided"]) == (3, 1, 1)
    # margins in standard deviations: lengths 4, 1, 2, 1, 2, 1 -> population std 1.0672; 3 std = 3.20 > 3: the
    # length pair of p is undecided now
    pairs2, counts2 = heron_pairs(rows, parse_factors(["correct", "-length"], [0, 3]), margin_unit="std")
    assert counts2["margin/length"] == pytest.approx(3 * math.sqrt(sum((x - 11 / 6) ** 2 for x in [4, 1, 2, 1, 2, 1])
                                                                  / 6))
    assert [p["level"] for p in pairs2] == ["correct", "correct", "correct"]
    assert len(heron_pairs(rows, parse_factors(["correct"]), max_pairs=1)[0]) == 2


def test_heron_bad_input_is_one_line():
    with pytest.raises(DataError, match=r"^rows: row 2: no factor 'style' \(a column of the row, or a key of its "):
        heron_pairs([{"prompt": "p", "completion": "a", "style": 1}, {"prompt": "p", "completion": "b"}],
                    parse_factors(["style"]))
    with pytest.raises(DataError, match=r"^rows: row 1: factor 'style' must be a finite number, got 'good'"):
        heron_pairs([{"prompt": "p", "completion": "a", "style": "good"}], parse_factors(["style"]))
    with pytest.raises(ConfigError, match=r"^--margins: expected one margin per factor \(2\), got 1"):
        parse_factors(["a", "b"], [1.0])


def test_cli_heron_then_rm_train(tmp_path, capsys):
    """rm heron writes the pair file rm train reads; the reward model learns the hierarchy's order (correct
    first, then shorter)."""
    rng = random.Random(0)
    rows = []
    for k in range(30):
        for _ in range(4):
            ok = rng.random() < 0.5
            text = ("7" if ok else "x") + "a" * rng.randint(0, 6)
            rows.append({"prompt": f"q{k}", "completion": text, "correct": float(ok)})
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "pairs.jsonl"
    assert cli_main(["rm", "heron", str(data), "--factors", "correct,-length", "--margins", "0,1",
                     "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "heron: 120 rows, 30 prompts" in said and "decided at correct" in said
    pairs = [json.loads(x) for x in out.read_text().splitlines()]
    assert pairs and {p["level"] for p in pairs} == {"correct", "length"}
    assert all(p["chosen"][0] == "7" for p in pairs if p["level"] == "correct")
    assert cli_main(["rm", "train", str(out), "--backbone", "bag:4", "--out", str(tmp_path / "rm"), "--lr", "3e-2",
                     "--epochs", "3", "--max-length", "16", "--eval-fraction", "0.2"]) == 0
    m = load_reward_model(tmp_path / "rm")
    s = m.score([""] * 3, ["7a", "7aaaaa", "xa"])[:, 0]
    assert s[0] > s[2] and s[0] > s[1]  # correct beats incorrect (level 1); shorter beats longer (level 2)
    assert cli_main(["rm", "heron", str(data), "--factors", "nope", "--out", str(out)]) == 2
    assert "no factor 'nope'" in capsys.readouterr().err


# ================================================================================================ CLoud
def scripted_critic(requests, n, seeds):
    """A critic that reads the response out of the request: 'fine' when it holds a digit, else 'wrong'; sample k
    of n adds k exclamation marks (distinct critiques for self-consistency)."""
    out = []
    for q in requests:
        resp = q.split("\n\nResponse:\n", 1)[1].rsplit("\n\n", 1)[0]
        word = "fine" if any(ch.isdigit() for ch in resp) else "wrong"
        out.append([word + "!" * k for k in range(n)])
    return out


CRITIC = f"{__name__}:scripted_critic"


def test_cloud_reward_is_the_mean_over_critiques(tmp_path):
    """r(x, y) = mean_k RM(x, y + MARKER + z_k), the K critiques from the critic; computed by hand with the model's
    own score of each concatenated text."""
    pairs = digit_pairs(24)
    critic = Critic(CRITIC)
    attach_critiques(pairs, critic)
    assert pairs[0].chosen.endswith(CRITIQUE_MARKER + "fine") and pairs[0].rejected.endswith(CRITIQUE_MARKER + "wrong")
    m = fit_reward_model("bag:4", pairs, RMTrainConfig(lr=3e-2, epochs=2), max_length=48)
    m.meta["critique"] = {"critic": CRITIC, "max_new_tokens": 8}
    m.save_pretrained(tmp_path / "rm")
    prompts, ys = ["1+1=", "2+2="], ["2", "four"]
    r = stages.build("reward", "cloud", {"path": str(tmp_path / "rm"), "samples": 3, "temperature": 1.0})
    got = r({"prompts": prompts, "completions": ys})
    model = load_reward_model(tmp_path / "rm")
    for i, (x, y) in enumerate(zip(prompts, ys)):
        z = scripted_critic([critique_request(x, y)], 3, [0])[0]
        each = model.score([x] * 3, [with_critique(y, zk) for zk in z])[:, 0]
        assert got[i] == pytest.approx(float(each.mean()), abs=1e-6)
        assert len(set(each.tolist())) == 3  # three different critiques, three different scores
    assert got[0] > got[1]  # the critique that says 'fine' scores higher
    with pytest.raises(ConfigError, match=r"was trained on critiques .* score with the reward 'cloud'"):
        stages.build("reward", "model", {"path": str(tmp_path / "rm")})({"prompts": prompts, "completions": ys})


def test_cloud_with_a_language_model_critic(tmp_path):
    """A causal-LM folder as the critic: K sampled critiques per response, the same for the same seed whatever
    the batch it is scored in; greedy with samples > 1 is refused when the config is read."""
    from postrl.models.tiny import build_local

    build_local(tmp_path / "critic", size="nano", seed=0)
    critic = Critic(str(tmp_path / "critic"), max_new_tokens=6, temperature=1.0, chat_template="none")
    pairs = digit_pairs(8)
    m = fit_reward_model("bag:4", pairs, RMTrainConfig(lr=3e-2), max_length=48)
    mean, per, crit = cloud_scores(m, critic, ["1+1=", "2+2="], ["2", "x"], samples=3, seed=5)
    assert per.shape == (2, 3) and torch.allclose(mean, per.mean(-1))
    assert all(len(c) == 3 for c in crit) and len(set(crit[0])) > 1
    alone, _, crit_alone = cloud_scores(m, critic, ["2+2="], ["x"], samples=3, seed=5)
    assert crit_alone[0] == crit[1] and float(alone[0]) == pytest.approx(float(mean[1]), abs=1e-6)
    with pytest.raises(ConfigError, match=r"^rewards.0.temperature: samples=3 critiques need temperature > 0"):
        stages.check_params("reward", "cloud", {"path": "rm", "samples": 3}, "rewards.0")


def test_cli_rm_train_with_a_critic(tmp_path, capsys):
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in digit_pairs(30)]
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    out = tmp_path / "rm"
    assert cli_main(["rm", "train", str(data), "--backbone", "bag:4", "--out", str(out), "--critic", CRITIC,
                     "--critic-max-tokens", "16", "--lr", "3e-2", "--max-length", "48"]) == 0
    assert "critic " in capsys.readouterr().out
    meta = json.loads((out / "reward_model.json").read_text())["meta"]
    assert meta["critique"]["critic"] == CRITIC and meta["critique"]["max_new_tokens"] == 16
    r = stages.build("reward", "cloud", {"path": str(out)})  # the critic recorded in the folder
    assert len(r({"prompts": ["1+1="], "completions": ["2"]})) == 1
