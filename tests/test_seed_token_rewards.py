"""Seed methods of issue 31 with token rewards: DRLC (an LLM critic's span scores on the tokens, ``critic_dense``)
and teacher forcing (log p of a separately trained MLE model, ``teacher_forcing``): hand-computed values and the
anchor computations."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError
from postrl.fields import produce
from postrl.generation import encode_prompt, left_pad
from postrl.stages import build

nan = float("nan")
T = torch.tensor


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (torch.isnan(a) == torch.isnan(b)).all(), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


@pytest.fixture(scope="module")
def tok():
    from postrl.models.tiny import build_tokenizer

    return build_tokenizer()


def _batch(tok, prompts, texts, width, reward=None):
    P, pm = left_pad([encode_prompt(tok, p, "auto") for p in prompts], tok.pad_token_id)
    ids = torch.full((len(texts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(texts), width)
    for i, t in enumerate(texts):
        x = tok(t, add_special_tokens=False)["input_ids"]
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1.0
    n = len(texts)
    b = RolloutBatch(prompt_ids=P, prompt_mask=pm, completion_ids=ids, completion_mask=mask,
                     group_ids=torch.arange(n), sampler_logprobs=torch.zeros(n, width),
                     truncated=torch.zeros(n, dtype=torch.bool), prompts=list(prompts), completions=list(texts))
    b.reward = reward
    return b


# ------------------------------------------------------------------------------------------------ DRLC
def test_critic_spans_are_located_and_spread_onto_tokens():
    from postrl.rewards.critic import locate, parse_spans, spread

    assert parse_spans('```json\n{"spans": [{"text": "bc", "score": 1}, {"span": "f", "score": -0.5}]}\n```') == \
        [("bc", 1.0), ("f", -0.5)]
    assert parse_spans("[]") == []
    for bad in ('{"spans": [{"text": "x", "score": "high"}]}', '{"verdict": 1}', "not json"):
        with pytest.raises(Exception, match="critic|JSON"):
            parse_spans(bad)
    text = "abcabc"
    # in order: the second "bc" is searched after the first; a quote not in the text is skipped
    assert locate(text, [("bc", 1.0), ("bc", 2.0), ("zz", 5.0)]) == [(1, 3, 1.0), (4, 6, 2.0)]
    # tokens of 2, 1, 3 characters: char ends 2, 3, 6 -> token 0 covers [0, 2), 1 covers [2, 3), 2 covers [3, 6)
    ends = [2, 3, 6]
    # the span [1, 4) overlaps all three tokens: 'uniform' 0.9 / 3 each, 'each' 0.9 each, 'last' 0.9 on token 2
    assert spread([(1, 4, 0.9)], ends, "uniform") == pytest.approx([0.3, 0.3, 0.3])
    assert spread([(1, 4, 0.9)], ends, "each") == pytest.approx([0.9, 0.9, 0.9])
    assert spread([(1, 4, 0.9)], ends, "last") == pytest.approx([0.0, 0.0, 0.9])
    # a span inside one token; two spans add up
    assert spread([(2, 3, 1.0), (0, 1, -1.0), (5, 6, 0.5)], ends, "uniform") == pytest.approx([-1.0, 1.0, 0.5])


CRITIC = '''
import json

SEEN = []


def critic(system, user):
    SEEN.append(user)
    response = user.split("Response:\\n", 1)[1].split("\\n\\nEnvironment reward:", 1)[0]
    if "boom" in response:
        return "I cannot say"
    return json.dumps({"spans": [{"text": "bc", "score": 1.0}, {"text": "f", "score": -0.5}]})
'''


@pytest.fixture()
def critic_module(tmp_path, monkeypatch):
    (tmp_path / "postrl_test_critic.py").write_text(CRITIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "postrl_test_critic", raising=False)
    yield "postrl_test_critic:critic"


def test_critic_dense_token_rewards_and_advantage(tok, critic_module):
    batch = _batch(tok, ["q1", "q2", "q3"], ["abcdef", "xbcy", "boom"], 7, reward=T([1.0, 0.0, 1.0]))
    stage = build("advantage", "critic_dense", {"critic": critic_module, "critic_task": "spell well",
                                                "whiten": False})
    assert "critic_token_reward" in stage.reads and stage.field_params["critic"] == critic_module
    produce(ModelContext(model=None, tokenizer=tok), batch, stage)
    c = batch.extra["critic_token_reward"]
    # one token per character: "abcdef": b, c get 1.0 / 2 each, f gets -0.5; "xbcy": b, c 0.5 each, no "f";
    # the critic's reply for "boom" is not JSON: NaN over the row
    close(c[0], [0.0, 0.5, 0.5, 0.0, 0.0, -0.5, 0.0])
    close(c[1], [0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.isnan(c[2, :4]).all() and (c[2, 4:] == 0).all()
    seen = sys.modules["postrl_test_critic"].SEEN
    assert any("Task:\nspell well" in u and "Question:\nq1" in u and "Environment reward: 1" in u for u in seen)
    adv = stage(batch)
    # r = c + R on the last token; undiscounted returns from t:
    # row 0: r = [0, .5, .5, 0, 0, -.5 + 1]; G = [1.5, 1.5, 1, .5, .5, .5, 0]
    close(adv[0], [1.5, 1.5, 1.0, 0.5, 0.5, 0.5, 0.0])
    # row 1 (R = 0): r = [0, .5, .5, 0]; G = [1, 1, .5, 0]; row 2 (failed critic): 0
    close(adv[1], [1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    close(adv[2], [0.0] * 7)
    # outcome_coef 0, dense_coef 2: only the critic's tokens, doubled
    dense = build("advantage", "critic_dense", {"critic": critic_module, "outcome_coef": 0.0, "dense_coef": 2.0,
                                                "whiten": False})(batch)
    close(dense[0], [1.0, 1.0, 0.0, -1.0, -1.0, -1.0, 0.0])
    # whitened (default): zero mean, unit variance over the valid rows' tokens
    w = build("advantage", "critic_dense", {"critic": critic_module})(batch)
    m = batch.completion_mask[:2].bool()
    assert abs(float(w[:2][m].mean())) < 1e-5 and math.isclose(float(w[:2][m].std()), 1.0, rel_tol=1e-4)


def test_critic_dense_needs_exactly_one_critic():
    for params in ({}, {"critic": "a:b", "critic_url": "http://127.0.0.1:1/v1"}):
        with pytest.raises(ConfigError, match="set exactly one of critic"):
            build("advantage", "critic_dense", params)
    with pytest.raises(ConfigError, match=r"advantage.critic_spread: expected 'uniform', 'each' or 'last'"):
        build("advantage", "critic_dense", {"critic": "a:b", "critic_spread": "mean"})


# ------------------------------------------------------------------------------------------------ teacher forcing
@pytest.fixture(scope="module")
def mle(tmp_path_factory):
    from postrl.models.tiny import build_local

    path = tmp_path_factory.mktemp("mle") / "mle"
    model, tok = build_local(path, size="nano", seed=5)
    return str(path), model.eval(), tok


def test_teacher_forcing_token_reward_is_the_mle_models_logprob(mle):
    path, model, tok = mle
    batch = _batch(tok, ["1+2=", "10-3="], ["3", "7 ok"], 5, reward=T([1.0, 0.0]))
    stage = build("advantage", "teacher_forcing", {"mle_model": path, "whiten": False})
    assert "mle_token_reward" in stage.reads
    policy = ModelContext(model=None, tokenizer=tok)  # the policy is not used: only its tokenizer
    produce(policy, batch, stage)
    r = batch.extra["mle_token_reward"]
    # anchor: log p of each completion token under the MLE model, by postrl's one log-prob path at temperature 1
    want, _ = ModelContext(model=model, tokenizer=tok).logprobs(batch)
    close(r, want * batch.completion_mask, tol=1e-5)
    assert (r[0, 1:] == 0).all() and (r < 0).sum() == 5
    # the advantage: undiscounted returns of log p (the log-prob of the rest of the completion)
    adv = stage(batch)
    close(adv, r.flip(-1).cumsum(-1).flip(-1) * batch.completion_mask, tol=1e-5)
    # with the outcome on the last token
    adv1 = build("advantage", "teacher_forcing", {"mle_model": path, "whiten": False, "outcome_coef": 2.0})(batch)
    close(adv1[0, 0], r[0, 0] + 2.0, tol=1e-5)
    close(adv1[1, :4], (r[1].flip(-1).cumsum(-1).flip(-1))[:4], tol=1e-5)  # R = 0


def test_teacher_forcing_soft_q_differs_from_logprob_by_a_telescoping_term(mle):
    from postrl.logprobs import completion_logits

    path, model, tok = mle
    batch = _batch(tok, ["1+2=", "10-3="], ["3 and 4", "7 ok"], 8)
    lp_stage = build("advantage", "teacher_forcing", {"mle_model": path})
    q_stage = build("advantage", "teacher_forcing", {"mle_model": path, "mle_form": "soft_q"})
    ctx = ModelContext(model=None, tokenizer=tok)
    produce(ctx, batch, lp_stage)
    lp = batch.extra.pop("mle_token_reward")
    produce(ctx, batch, q_stage)
    q = batch.extra["mle_token_reward"]
    with torch.no_grad():
        logits = completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids)
    v0 = torch.logsumexp(logits[:, 0], -1)  # V(s_0): the value of the state before the first completion token
    # r_t = f(y_t) - V(s_{t+1}) = log p_t + V(s_t) - V(s_{t+1}), with V = 0 after the last token:
    # sum_t r_t = sum_t log p_t + V(s_0)
    close(q.sum(-1), lp.sum(-1) + v0, tol=1e-3)
    L = 7  # row 0: the last token's reward is its logit (nothing after it)
    close(q[0, L - 1], logits[0, L - 1, batch.completion_ids[0, L - 1]], tol=1e-4)


def test_teacher_forcing_with_its_own_vocabulary_maps_its_tokens_by_characters(mle, tmp_path):
    from postrl.models.tiny import DEFAULT_CHARS, build_tokenizer

    path, model, tok = mle
    # the same model with another vocabulary: characters in reverse order, embedding rows permuted to match, so it
    # gives every text the same log-probs through other token ids
    tok_b = build_tokenizer(DEFAULT_CHARS[::-1])
    va, vb = tok.get_vocab(), tok_b.get_vocab()
    assert va != vb and set(va) == set(vb)
    import copy

    model_b = copy.deepcopy(model)
    emb = model.get_input_embeddings().weight.data
    new = emb.clone()
    for s, ia in va.items():
        new[vb[s]] = emb[ia]
    model_b.get_input_embeddings().weight.data.copy_(new)
    model_b.tie_weights()
    (tmp_path / "b").mkdir()
    model_b.save_pretrained(tmp_path / "b")
    tok_b.save_pretrained(tmp_path / "b")
    batch = _batch(tok, ["1+2="], ["3 ok"], 5)
    ctx = ModelContext(model=None, tokenizer=tok)
    same = build("advantage", "teacher_forcing", {"mle_model": path})
    produce(ctx, batch, same)
    want = batch.extra.pop("mle_token_reward")
    other = build("advantage", "teacher_forcing", {"mle_model": str(tmp_path / "b")})
    produce(ctx, batch, other)
    close(batch.extra["mle_token_reward"], want, tol=1e-4)
    with pytest.raises(ConfigError, match="advantage.mle_model '.*missing': no config.json"):
        batch.extra.pop("mle_token_reward")
        produce(ctx, batch, build("advantage", "teacher_forcing", {"mle_model": str(tmp_path / "missing")}))
    with pytest.raises(ConfigError, match="advantage.mle_model: required parameter missing"):
        build("advantage", "teacher_forcing", {})
