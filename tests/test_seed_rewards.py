"""Seed methods of issue 31, section "Rewards": hand-computed values for each reward source and shaping stage
(Arctic-Text2SQL-R1, MT-R1-Zero, Shaping Explanations, noisy rewards and RPR, DIVER, MultiRole-R1, Chasing the
Tail). The token-reward producers (DRLC, teacher forcing) are in tests/test_seed_token_rewards.py."""

from __future__ import annotations

import json
import math
import sqlite3
import sys

import pytest
import torch

from postrl import registry
from postrl.errors import ConfigError
from postrl.rewards import score_batch
from postrl.stages import build

nan = float("nan")
T = torch.tensor


def close(a, b, tol=1e-6):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (torch.isnan(a) == torch.isnan(b)).all(), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


class Spec:
    def __init__(self, name, **params):
        self.name, self.params = name, params


def test_every_method_of_the_section_is_registered_with_its_paper():
    want = {("reward", "sql_execution"): "Arctic-Text2SQL-R1", ("reward", "bleu"): "MT-R1-Zero",
            ("reward", "chrf"): "MT-R1-Zero", ("reward", "mt_mixed"): "MT-R1-Zero",
            ("reward", "semantic_similarity"): "Shaping Explanations",
            ("shaping", "reward_noise"): "The Climb Carves Wisdom", ("reward", "reasoning_pattern"): "The Climb Carves",
            ("field", "critic_token_reward"): "DRLC", ("advantage", "critic_dense"): "DRLC",
            ("shaping", "diversity_potential"): "Diversity-Incentivized Exploration",
            ("reward", "lexical_diversity"): "Diversity-Enhanced Reasoning",
            ("reward", "rubric_judge"): "Chasing the Tail",
            ("field", "mle_token_reward"): "Teacher Forcing", ("advantage", "teacher_forcing"): "Teacher Forcing"}
    for (kind, name), paper in want.items():
        e = registry.entry(kind, name)
        assert e.source.startswith(paper), (kind, name, e.source)
        assert e.description, (kind, name)


# ------------------------------------------------------------------------------------------------ Arctic-Text2SQL-R1
@pytest.fixture(scope="module")
def emp_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("sql") / "emp.sqlite"
    con = sqlite3.connect(path)
    con.executescript("CREATE TABLE emp(id INTEGER, name TEXT, dept TEXT, salary REAL);"
                      "INSERT INTO emp VALUES (1, 'ann', 'a', 10), (2, 'bob', 'a', 20), (3, 'cy', 'b', 30),"
                      "(4, 'dee', 'b', 30);")
    con.commit()
    con.close()
    return path


def _sql(s: str) -> str:
    return f"<think>plan</think>\n<answer>The query:\n```sql\n{s}\n```</answer>"


def test_sql_extract_takes_the_last_sql_block_and_the_answer_tag():
    from postrl.rewards.sql import extract_sql

    text = "```sql\nSELECT 1\n```\n<answer>```SQL\nSELECT 2;\n```</answer> ```python\nx\n```"
    assert extract_sql(text) == "SELECT 2;"
    assert extract_sql("```sql\nSELECT 1\n``` then <answer>none</answer>", answer_tag=True) is None
    assert extract_sql("<answer>```sql\nSELECT 3\n```</answer>", answer_tag=True) == "SELECT 3"
    assert extract_sql("SELECT 1") is None and extract_sql("```sql\n  \n```") is None


def test_sql_execution_reward_levels_in_the_sandbox(emp_db):
    from postrl.rewards.sql import sql_execution

    gold = "SELECT name FROM emp WHERE dept = 'a'"
    comps = [
        _sql("SELECT name FROM emp WHERE salary < 25 ORDER BY id DESC"),  # same set {ann, bob}, other order: 1
        _sql("SELECT name FROM emp WHERE dept = 'b'"),                    # runs, other result: 0.1
        _sql("SELEC name FROM emp"),                                       # does not parse: 0
        "SELECT name FROM emp WHERE dept = 'a'",                           # no ```sql block (format): 0
        _sql("DELETE FROM emp"),                                           # writes: refused by the authorizer: 0
        _sql("SELECT name FROM emp WHERE dept = 'a'; DROP TABLE emp"),     # two statements: 0
        _sql("ATTACH DATABASE 'x.db' AS x"),                               # attaches: refused: 0
        _sql("SELECT name FROM emp WHERE dept = 'a' UNION ALL SELECT 'ann'"),  # {ann, bob} with a duplicate: 1
    ]
    n = len(comps)
    out = sql_execution(["q"] * n, comps, db_path=[str(emp_db)] * n, gold_sql=[gold] * n)
    assert out == [1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # compare: 'ordered' needs the same row order; 'multiset' counts duplicates
    assert sql_execution(["q"] * 2, [comps[0], comps[7]], db_path=[str(emp_db)] * 2, gold_sql=[gold] * 2,
                         compare="ordered", valid_reward=0.25) == [0.25, 0.25]
    assert sql_execution(["q"] * 2, [comps[0], comps[7]], db_path=[str(emp_db)] * 2, gold_sql=[gold] * 2,
                         compare="multiset") == [1.0, 0.1]
    # the database stays as it was (the DELETE / DROP did not run)
    assert sqlite3.connect(emp_db).execute("SELECT count(*) FROM emp").fetchone() == (4,)


def test_sql_execution_failures_are_failed_entries_and_a_runaway_query_scores_zero(emp_db, tmp_path):
    specs = [Spec("sql_execution", timeout=3.0)]
    comps = [_sql("SELECT 1"), _sql("SELECT 1"), _sql("SELECT 1"), _sql("SELECT 1"),
             _sql("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c")]
    cols = {"group_ids": [0, 1, 2, 3, 4],
            "db_path": [str(emp_db), str(tmp_path / "missing.sqlite"), None, "emp.sqlite", str(emp_db)],
            "gold_sql": ["SELECT nope FROM emp", "SELECT 1", "SELECT 1", "SELECT 1", "SELECT 1"]}
    out = score_batch(["q"] * 5, comps, cols, specs)
    # gold SQL that fails, a missing database file, a row without a database: failures (NaN), never 0;
    # a relative path resolved under db_root; the endless recursive query hits the time limit: 0
    close(out.matrix[:, 0], [nan, nan, nan, nan, 0.0])
    assert out.failures == {"sql_execution": 4}
    assert "the gold SQL fails" in out.first_failure["sql_execution"] and "no such column: nope" in \
        out.first_failure["sql_execution"]
    rel = score_batch(["q"], [_sql("SELECT count(*) FROM emp")], {"group_ids": [0], "db_path": ["emp.sqlite"],
                                                                  "answer": ["SELECT 4"]},
                      [Spec("sql_execution", db_root=str(emp_db.parent))])
    close(rel.matrix[:, 0], [1.0])  # the gold SQL from the 'answer' column
    with pytest.raises(ConfigError, match=r"^rewards.valid_reward: expected a value >= 0 and <= 1, got 2"):
        build("reward", "sql_execution", {"valid_reward": 2.0}, where="rewards")
    assert registry.entry("reward", "sql_execution").needs == ("sandbox",)


# ------------------------------------------------------------------------------------------------ MT-R1-Zero
def test_bleu_and_chrf_hand_values():
    from postrl.rewards.text import bleu, chrf

    ref = "the cat sat on the mat"
    # hyp "the cat sat on a mat": p1 = 5/6, p2 = 3/5, p3 = 2/4, p4 = 1/3, BP = 1 (equal lengths)
    # BLEU = (5/6 * 3/5 * 1/2 * 1/3) ** (1/4) = (1/12) ** 0.25 = 0.537285
    out = bleu(["q"] * 4, ["the cat sat on a mat", ref, "dog", "x"], answer=[ref, ref, ref, None])
    close(out[:3], [(1 / 12) ** 0.25, 1.0, 0.0], tol=1e-6)  # no unigram in common: 0
    assert out[3] is None
    tagged = bleu(["q"] * 2, ["<think>..</think><translate> the cat sat on a mat </translate>", "no tag"],
                  answer=[ref, ref], tag="translate")
    close(tagged, [(1 / 12) ** 0.25, 0.0], tol=1e-6)
    # chrF of "abd" against "abc": orders 1..3 occur; P = R = (2/3 + 1/2 + 0) / 3 = 7/18 each, so F = 7/18
    close(chrf(["q"] * 3, ["abd", "abc", "xyz"], answer=["abc"] * 3), [7 / 18, 1.0, 0.0], tol=1e-6)
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        bleu(["q"], ["x"])


def test_mt_mixed_is_format_plus_metric_or_penalty():
    from postrl.rewards.text import mt_format_ok, mt_mixed

    ref = "the cat sat on the mat"
    ok = "<think>translate word by word</think> <translate>{}</translate>"
    comps = [ok.format(ref),                                         # +1 + 1.0
             ok.format("the cat sat on a mat"),                      # +1 + 0.537285
             "<translate>the cat sat on the mat</translate>",        # no think: -1 - 2
             ok.format(ref) + "<translate>again</translate>",        # two translate blocks: -1 - 2
             "<translate>x</translate><think>late</think>",          # wrong order: -1 - 2
             ok.format("  ")]                                        # format holds, empty translation: +1 - 2
    out = mt_mixed(["q"] * len(comps), comps, answer=[ref] * len(comps))
    close(out, [2.0, 1 + (1 / 12) ** 0.25, -3.0, -3.0, -3.0, -1.0], tol=1e-6)
    # check_think off: a translate block suffices; chrF as the metric; custom format reward and penalty
    out = mt_mixed(["q"] * 2, [comps[2], "plain text"], answer=[ref] * 2, check_think=False, metric="chrf",
                   format_reward=0.5, fail_penalty=1.0)
    close(out, [1.5, -1.5])
    assert mt_format_ok("<think>a</think><translate>b</translate>") and not mt_format_ok("<think>a<translate>b")


# ------------------------------------------------------------------------------------------------ Shaping Explanations
@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    from transformers import BertConfig, BertModel

    from postrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = BertModel(cfg).eval()
    path = tmp_path_factory.mktemp("enc") / "enc"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), model, tok


def _embedding(model, tok, text, pooling="mean"):
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        h = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
    v = h.mean(0) if pooling == "mean" else h[0]
    return v / v.norm()


def test_semantic_similarity_is_the_cosine_of_pooled_encoder_embeddings(tiny_encoder):
    from postrl.rewards.semantic import semantic_similarity

    path, model, tok = tiny_encoder
    ref = "the mitochondria make atp"
    comps = ["the mitochondria make atp", "cells need energy", "", "<e>cells need energy</e>", "abc"]
    answer = [ref, ref, ref, ref, None]
    out = semantic_similarity(["q"] * 5, comps, answer=answer, encoder=path)
    want = float(_embedding(model, tok, comps[1]) @ _embedding(model, tok, ref))
    # itself: 1; another text: the cosine of the two mean-pooled embeddings, each computed alone (so padding in
    # the batch changes nothing); an empty completion 0; no reference None
    assert out[0] == pytest.approx(1.0, abs=1e-5) and out[1] == pytest.approx(want, abs=1e-5)
    assert out[2] == 0.0 and out[3] == pytest.approx(float(_embedding(model, tok, comps[3]) @ _embedding(
        model, tok, ref)), abs=1e-5) and out[4] is None
    assert -1.0 <= out[1] < 0.9999
    tag = semantic_similarity(["q"] * 2, comps[3:5], answer=[ref, ref], encoder=path, tag="e", pooling="cls")
    close(tag, [float(_embedding(model, tok, comps[1], "cls") @ _embedding(model, tok, ref, "cls")), 0.0], tol=1e-5)
    with pytest.raises(ConfigError, match="no config.json"):
        semantic_similarity(["q"], ["x"], answer=["y"], encoder=str(path) + "-missing")
    with pytest.raises(ConfigError, match="rewards.encoder: required parameter missing"):
        build("reward", "semantic_similarity", {}, where="rewards")


# ------------------------------------------------------------------------------------------------ noisy rewards, RPR
def _noise(rewards, names, group_ids, step=0, **params):
    stage = build("shaping", "reward_noise", params)
    return stage({"rewards": rewards, "reward_names": names, "group_ids": group_ids, "step": step})["rewards"]


def test_reward_noise_flips_binary_rewards_reproducibly():
    r = T([[1.0, 0.3], [0.0, 0.7], [nan, 0.5], [1.0, 0.1]])
    g = T([0, 0, 1, 1])
    close(_noise(r, ["correct", "rm"], g), r)  # p = 0 and no noise: unchanged
    # p = 1 on the binary column: r' = 1 - r (low + high - r); a failed entry stays NaN; other columns untouched
    close(_noise(r, ["correct", "rm"], g, sources=["correct"], flip_prob=1.0)[:, 0], [0.0, 1.0, nan, 0.0])
    close(_noise(r, ["correct", "rm"], g, sources=["correct"], flip_prob=1.0)[:, 1], r[:, 1])
    close(_noise(T([[2.0], [-1.0]]), ["s"], T([0, 1]), flip_prob=1.0, low=-1.0, high=2.0)[:, 0], [-1.0, 2.0])
    with pytest.raises(ValueError, match="column 'rm' holds 0.3, not a binary reward in"):
        _noise(r, ["correct", "rm"], g, flip_prob=0.5)
    # 4000 rows at p = 0.4: the share flipped is 0.4 within 4 standard errors (sqrt(.24/4000) = 0.0077)
    N = 4000
    ones = torch.ones(N, 1)
    gids = torch.arange(N) // 4
    out = _noise(ones, ["correct"], gids, step=7, flip_prob=0.4, seed=1)
    assert abs(float((out == 0).double().mean()) - 0.4) < 0.031
    # reproducible per (seed, step, row): the same again, another step or seed differs; keyed by the row's group
    # and its place in the group, not by its index in the batch (a permutation of the groups permutes the flips)
    close(_noise(ones, ["correct"], gids, step=7, flip_prob=0.4, seed=1), out)
    assert not torch.equal(_noise(ones, ["correct"], gids, step=8, flip_prob=0.4, seed=1), out)
    assert not torch.equal(_noise(ones, ["correct"], gids, step=7, flip_prob=0.4, seed=2), out)
    perm = (torch.arange(N // 4).flip(0).unsqueeze(-1) * 4 + torch.arange(4)).flatten()  # groups reversed
    close(_noise(ones[perm], ["correct"], gids[perm], step=7, flip_prob=0.4, seed=1), out[perm])
    # per='group': every completion of a prompt flipped together
    grp = _noise(ones, ["correct"], gids, step=7, flip_prob=0.4, per="group").reshape(-1, 4)
    assert bool(((grp == 0).all(-1) | (grp == 1).all(-1)).all()) and abs(float((grp[:, 0] == 0).double().mean())
                                                                          - 0.4) < 0.062


def test_reward_noise_adds_zero_mean_noise_of_the_given_std():
    N = 4000
    r = torch.zeros(N, 1)
    g = torch.arange(N)
    out = _noise(r, ["rm"], g, noise_std=0.5, seed=3)[:, 0]
    # mean 0 within 4 standard errors (0.5 / sqrt(4000) = 0.0079), std 0.5 within 5%
    assert abs(float(out.mean())) < 0.032 and abs(float(out.std()) - 0.5) < 0.025
    u = _noise(r, ["rm"], g, noise_std=0.5, noise="uniform", seed=3)[:, 0]
    # uniform on [-sqrt(3) s, sqrt(3) s]: std s
    assert float(u.abs().max()) <= 0.5 * math.sqrt(3) + 1e-9 and abs(float(u.std()) - 0.5) < 0.025
    # flip, then noise: the flipped value plus the same noise as without the flip
    both = _noise(torch.ones(N, 1), ["c"], g, flip_prob=1.0, noise_std=0.5, seed=3)[:, 0]
    nz = _noise(torch.zeros(N, 1), ["c"], g, noise_std=0.5, seed=3)[:, 0]
    close(both, nz, tol=1e-6)
    with pytest.raises(ConfigError, match=r"^shaping.flip_prob: expected a value >= 0 and <= 1, got 1.5$"):
        build("shaping", "reward_noise", {"flip_prob": 1.5})


def test_reasoning_pattern_reward_hand_values():
    from postrl.rewards.text import reasoning_pattern, repetition_ratio

    text = "First, I need to check the sum. Wait, 2 + 2 = 4, therefore the answer is 4."
    # phrases found (lower-cased): "i need to", "wait", "first, ", "therefore" -> 4 / 20 = 0.2; under 20 words: no
    # 20-gram, no repetition penalty
    assert reasoning_pattern(["q"], [text]) == [pytest.approx(0.2)]
    assert reasoning_pattern(["q"], [text + " user: next question"]) == [0.0]  # 0.2 - 1, floored at 0
    assert reasoning_pattern(["q"], ["The answer is 4."]) == [0.0]
    # "a b a b": word 2-grams (a b), (b a), (a b): one distinct 2-gram repeats -> 1/3
    assert repetition_ratio("a b a b", 2) == pytest.approx(1 / 3)
    assert reasoning_pattern(["q"], ["a b a b"], phrases=["a b"], norm=1.0, repetition_n=2) == [pytest.approx(2 / 3)]
    # a phrase counts once; min(1, .) caps; region='think' reads the think block only
    many = " ".join(["wait, thus hence therefore alternatively"] * 3)
    assert reasoning_pattern(["q"], [many], norm=2.0, repetition_n=None) == [1.0]
    assert reasoning_pattern(["q"] * 2, ["<think>wait</think> therefore", "wait"], region="think",
                             norm=1.0) == [1.0, 0.0]


# ------------------------------------------------------------------------------------------------ DIVER, MultiRole-R1
def test_diver_bleu_hand_value():
    from postrl.shaping.diversity import _grams, bleu

    def counts(t):
        w = t.split()
        return [_grams(w, n) for n in range(1, 6)], len(w)

    # hyp "a b c d e g" against "a b c d e f": p1..p5 = 5/6, 4/5, 3/4, 2/3, 1/2; equal length, BP = 1
    want = math.exp(0.02 * math.log(5 / 6) + 0.1 * math.log(4 / 5) + 0.15 * math.log(3 / 4)
                    + 0.25 * math.log(2 / 3) + 0.38 * math.log(1 / 2))
    assert bleu(*counts("a b c d e f"), *counts("a b c d e g")) == pytest.approx(want)
    # a shorter hypothesis, every n-gram matching: BLEU = BP = exp(1 - 6/5)
    assert bleu(*counts("a b c d e f"), *counts("a b c d e")) == pytest.approx(math.exp(1 - 6 / 5))
    # no 5-gram in a 4-word hypothesis: p5 = 0, so 0 (no smoothing); an empty hypothesis: 0
    assert bleu(*counts("a b c d e f"), *counts("a b c d")) == 0.0
    assert bleu(*counts("a b"), *counts("")) == 0.0


def test_diversity_potential_hand_values():
    from postrl.shaping.diversity import diversity_potential

    comps = ["a b", "a c", "a b", "x y"]
    g = T([0, 0, 1, 1])
    r = T([[1.0], [1.0], [0.0], [1.0]])
    names, w = ["correct"], T([1.0])
    # Jaccard of word sets: s(A,B) = 1/3, s(A,C) = 1, s(B,C) = 1/3, D shares nothing
    # batch: d = 1 - mean of the 3 others: A 1 - 4/9 = 5/9, B 1 - 2/9 = 7/9, C 5/9, D 1
    # Phi = d * correct = [5/9, 7/9, 0, 1]; Phi(q) = group means 2/3 and 1/2; F = Phi - Phi(q)
    out = diversity_potential(r, names, w, comps, g, similarity="jaccard", n=1)
    assert out["reward_names"] == ["correct", "diversity"] and float(out["reward_weights"][1]) == pytest.approx(0.1)
    close(out["rewards"][:, 1], [-1 / 9, 1 / 9, -1 / 2, 1 / 2])
    # without the correctness gate: Phi = d; group 1 mean (5/9 + 1) / 2 = 7/9
    close(diversity_potential(r, names, w, comps, g, similarity="jaccard", n=1, source=None)["rewards"][:, 1],
          [-1 / 9, 1 / 9, -2 / 9, 2 / 9])
    # within each group: A, B share 1/3 -> d = 2/3 both (F = 0); C, D share nothing -> d = 1, gated [0, 1]
    close(diversity_potential(r, names, w, comps, g, similarity="jaccard", n=1, scope="group")["rewards"][:, 1],
          [0.0, 0.0, -1 / 2, 1 / 2])
    # gamma < 1: F = gamma Phi - Phi(q); a failed correctness: NaN, left out of Phi(q)
    rn = T([[1.0], [1.0], [nan], [1.0]])
    close(diversity_potential(rn, names, w, comps, g, similarity="jaccard", n=1, gamma=0.5)["rewards"][:, 1],
          [0.5 * 5 / 9 - 2 / 3, 0.5 * 7 / 9 - 2 / 3, nan, 0.5 - 1.0])
    # the default similarity is DIVER's BLEU: identical texts are at distance 0
    same = diversity_potential(T([[1.0]] * 2), names, w, ["a b c d e f"] * 2, T([0, 0]), source=None)
    close(same["rewards"][:, 1], [0.0, 0.0])
    with pytest.raises(ConfigError, match=r"^shaping.gamma: expected a value > 0 and <= 1, got 0.0$"):
        build("shaping", "diversity_potential", {"gamma": 0.0})


def test_lexical_diversity_hand_values():
    from postrl.rewards.diversity import lexical_diversity

    # "the cat saw the dog": distinct-1 = 4/5, distinct-2 = 4/4; mean 0.9; 5 words of min_words 20 -> x 0.25
    assert lexical_diversity(["q"], ["The cat saw the dog."]) == [pytest.approx(0.225)]
    assert lexical_diversity(["q"], ["The cat saw the dog."], min_words=0) == [pytest.approx(0.9)]
    # one word: distinct-1 = 1, no bigram (0): 0.5 unscaled, 0.05 with min_words 10; empty: 0
    assert lexical_diversity(["q"] * 2, ["word", ""], min_words=10) == [pytest.approx(0.05), 0.0]
    assert lexical_diversity(["q"], ["a a a a"], orders=[1], min_words=0) == [pytest.approx(0.25)]
    with pytest.raises(ConfigError, match="rewards.orders"):
        build("reward", "lexical_diversity", {"orders": []}, where="rewards")


# ------------------------------------------------------------------------------------------------ Chasing the Tail
JUDGE = '''
import json

CALLS = {"rubric": 0, "refine": 0, "grade": 0}


def judge(system, user):
    if "grading rubrics" in system and "Current rubric" not in user:
        CALLS["rubric"] += 1
        if "BROKEN" in user:
            return "no json here"
        return json.dumps({"criteria": [{"criterion": "mentions C0", "weight": 3}, {"criterion": "mentions C1"}]})
    if "grading rubrics" in system:
        CALLS["refine"] += 1
        assert "1. (weight 3) mentions C0" in user and "[2]" in user  # the current rubric and the exemplars
        return "```json\\n" + json.dumps({"criteria": [{"criterion": "mentions C0", "weight": 2},
                                                        {"criterion": "mentions C1", "weight": 1},
                                                        {"criterion": "mentions C2", "weight": 1}]}) + "\\n```"
    CALLS["grade"] += 1
    rubric, response = user.split("Rubric:\\n", 1)[1].split("\\n\\nResponse:\\n", 1)
    if "GARBLED" in response:
        return '{"verdicts": [true]}'
    return json.dumps({"verdicts": [f"C{k}" in response for k in range(rubric.count("(weight"))]})
'''


@pytest.fixture()
def judge_module(tmp_path, monkeypatch):
    (tmp_path / "postrl_test_rubric_judge.py").write_text(JUDGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "postrl_test_rubric_judge", raising=False)
    yield "postrl_test_rubric_judge:judge"


def test_rubric_judge_writes_refines_caches_and_grades(judge_module):
    stage = build("reward", "rubric_judge", {"judge": judge_module})
    calls = sys.modules["postrl_test_rubric_judge"].CALLS
    prompts = ["q1", "q1", "q1", "q2"]
    comps = ["C0 and C2", "only C1", "nothing", "C0 GARBLED"]
    cols = {"exemplars": [["great answer", "excellent answer"]] * 3 + [["x", "y"]], "answer": ["a"] * 4}
    out = stage.fn(prompts, comps, **cols)
    # refined rubric: weights 2, 1, 1 -> "C0 and C2" (2 + 1) / 4, "only C1" 1/4, "nothing" 0; a grade with the
    # wrong number of verdicts fails that entry (an error instance, counted by the scorer), not 0
    assert out[:3] == [0.75, 0.25, 0.0] and "1 verdicts for 3 criteria" in str(out[3])
    assert calls == {"rubric": 2, "refine": 2, "grade": 4}  # one rubric (+ one refinement) per prompt
    # a second call in the step: the rubrics written are reused (no new rubric call)
    assert stage.fn(prompts[:1], comps[:1], **{k: v[:1] for k, v in cols.items()}) == [0.75]
    assert calls["rubric"] == 2
    # the step keeps them (observe, end_step), they travel with the state
    stage.observe({"prompts": prompts, "completions": comps, "columns": cols})
    assert stage.end_step(__import__("postrl.stages", fromlist=["StepEnd"]).StepEnd()) == {"rubrics": 2.0}
    state = json.loads(json.dumps(stage.state_dict()))
    fresh = build("reward", "rubric_judge", {"judge": judge_module, "refine_rounds": 0})
    fresh.load_state_dict(state)
    assert fresh.fn(prompts[:2], comps[:2], **{k: v[:2] for k, v in cols.items()}) == [0.75, 0.25]
    assert calls["rubric"] == 2  # the kept rubric, not a new one
    # without refinement the first rubric grades: weights 3, 1 -> "C0 and C2" 3/4
    plain = build("reward", "rubric_judge", {"judge": judge_module, "refine_rounds": 0})
    assert plain.fn(["q3"], ["C0 and C2"]) == [0.75] and plain.fn(["q3"], ["only C1"]) == [0.25]


def test_rubric_judge_failures_are_failed_entries(judge_module):
    out = score_batch(["BROKEN", "BROKEN", "fine"], ["C0", "C1", "C0"], {"group_ids": [0, 0, 1]},
                      [Spec("rubric_judge", judge=judge_module, refine_rounds=0)])
    close(out.matrix[:, 0], [nan, nan, 0.75])
    assert out.failures == {"rubric_judge": 2} and "no rubric" in out.first_failure["rubric_judge"]
    with pytest.raises(ConfigError, match="^rewards.judge: expected an import path 'module:attribute', got"):
        build("reward", "rubric_judge", {"judge": "nocolon"})
