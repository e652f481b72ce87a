"""Issue 31, data and sampling: prior prompts (pPE), prompt augmentation, TraPO, AVATAR's replay and TAS.

Hand-computed values, the state rule (recorded in observe, applied once in end_step, the same on every process),
and the trainer's paths: per-row prompts stay on-policy, replayed groups fill zero-signal slots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from postrl import registry, stages
from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.data import load_source
from postrl.errors import ConfigError, DataError
from postrl.generation import Generation, SamplingParams, decorate_prompt, left_pad
from postrl.losses.avatar import tas_weights, temporal_advantage_shaping
from postrl.models.tiny import build_local
from postrl.rewards.builtin import template_format
from postrl.rewards.label_free import majority_vote
from postrl.seeding import stable_hash
from postrl.selection.expansions import ExpandContext
from postrl.selection.replay import AvatarReplay
from postrl.selection.sampling import PlanContext, PromptAugmentation
from postrl.selection.selectors import prompt_key
from postrl.selection.trapo import TraPO, trajectory_similarity
from postrl.stages import StepEnd
from postrl.train.trainer import Trainer


@registry.register("reward", "data31_coin", source="test: 1 for about a quarter of the completions")
def data31_coin(prompts, completions, **_):
    return [float(stable_hash(p, c) % 4 == 0) for p, c in zip(prompts, completions)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano-data31")
    build_local(path, size="nano", seed=0)
    return path


def small(model_dir, out, *extra):
    return [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
            "rollout.max_new_tokens=3", "rollout.group_size=4", "train.prompts_per_step=4", "train.steps=2",
            "train.save_every=0", "train.eval_size=4", "train.eval_k=1", *extra]


# ================================================================================== Prior Prompt Engineering (pPE)
def test_decorate_prompt_hand_values():
    assert decorate_prompt("2+3=", prefix="Q: ", suffix=" A:") == "Q: 2+3= A:"
    assert decorate_prompt("2+3=", system="Think.") == [{"role": "system", "content": "Think."},
                                                        {"role": "user", "content": "2+3="}]
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "2+3="}]
    out = decorate_prompt(conv, system="Think.", prefix="<", suffix=">")
    assert out[0] == {"role": "system", "content": "Think.\n\nBe brief."}  # merged into the existing system turn
    assert out[1]["content"] == "hi" and out[3]["content"] == "<2+3=>"    # the last user message is the query
    assert conv[3]["content"] == "2+3=" and conv[0]["content"] == "Be brief."  # the input is not changed


def _prior_sources(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(4)]
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    specs = [{"name": "arithmetic"}, {"name": "countdown"}, {"name": "file", "path": str(f), "verifier": "arithmetic"}]
    return specs


def test_prior_prompt_every_source_train_and_optionally_not_at_eval(tmp_path):
    opts = {"prompt_prefix": "Think step by step. ", "prompt_suffix": " Answer:"}
    for spec in _prior_sources(tmp_path):
        plain = load_source(spec)
        with_eval = load_source({**spec, **opts})
        without = load_source({**spec, **opts, "eval_prior": False})
        p_train, p_eval = plain.train_rows(3, 4, 7), plain.eval_rows(3, 7)
        for src in (with_eval, without):
            got = src.train_rows(3, 4, 7)
            assert [r["prompt"] for r in got] == [f"Think step by step. {r['prompt']} Answer:" for r in p_train]
            assert [{k: v for k, v in r.items() if k != "prompt"} for r in got] == \
                   [{k: v for k, v in r.items() if k != "prompt"} for r in p_train]  # columns, verifier: the source's
        assert [r["prompt"] for r in with_eval.eval_rows(3, 7)] == \
               [f"Think step by step. {r['prompt']} Answer:" for r in p_eval]
        assert without.eval_rows(3, 7) == p_eval  # eval_prior false: the plain held-out queries
        r = p_train[0]
        assert with_eval.verify(r.get("solution", r.get("answer")), r) == plain.verify(r.get("solution",
                                                                                            r.get("answer")), r)
    # a system prompt makes each query a conversation with a system turn
    src = load_source({"name": "arithmetic", "system_prompt": "Reason first."})
    row = src.train_rows(0, 1, 0)[0]
    assert row["prompt"][0] == {"role": "system", "content": "Reason first."} and row["prompt"][1]["role"] == "user"
    assert load_source({"name": "arithmetic"}).__class__.__name__ == "ArithmeticTask"  # no option: unchanged


def test_prior_prompt_dataset_and_reasoning_gym_sources(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("reasoning_gym")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]).save_to_disk(str(folder))
    for spec in ({"name": "dataset", "name_or_path": str(folder)},
                 {"name": "reasoning_gym", "dataset": "basic_arithmetic", "size": 40}):
        plain, pre = load_source(spec), load_source({**spec, "prompt_prefix": "P: ", "eval_prior": False})
        assert [r["prompt"] for r in pre.train_rows(0, 3, 1)] == ["P: " + r["prompt"] for r in plain.train_rows(0, 3, 1)]
        assert pre.eval_rows(2, 1) == plain.eval_rows(2, 1)


def test_prior_prompt_options_are_validated_when_the_config_is_read():
    with pytest.raises(ConfigError, match=r"^task.eval_prior: expected true or false, got 3$"):
        load_config(None, ["task={name: arithmetic, prompt_prefix: 'Q: ', eval_prior: 3}"])
    with pytest.raises(ConfigError, match=r"^task.prompt_prefix: expected a string, got 5$"):
        load_config(None, ["task={name: arithmetic, prompt_prefix: 5}"])
    cfg = load_config(None, ["task={name: countdown, system_prompt: 'Plan first.', eval_prior: false}"])
    assert cfg.task.params == {"system_prompt": "Plan first.", "eval_prior": False}


def test_prior_prompt_trains_with_it_and_evaluates_without_it(model_dir, tmp_path):
    cfg = load_config(None, small(model_dir, tmp_path / "ppe", "task.prompt_prefix=Q",
                                  "task.eval_prior=false", "rewards=[{name: correct}]"))
    tr = Trainer(cfg, tmp_path / "ppe")
    b = tr.batches.rollout(0)
    tok = tr.tokenizer
    texts = [tok.decode(b.prompt_ids[i][b.prompt_mask[i].bool()].tolist(), skip_special_tokens=True)
             for i in range(len(b))]
    assert all(t.startswith("Q") and t == p for t, p in zip(texts, b.prompts))  # the rollout sees the prior prompt
    seen = []
    gen = tr.backend.generate
    tr.backend.generate = lambda ids, *a, **k: (seen.extend(ids), gen(ids, *a, **k))[1]
    tr.evaluate("test", 0)
    spec = {k: v for k, v in cfg.task.model_dump().items() if k not in ("prompt_prefix", "eval_prior")}
    plain = [r["prompt"] for r in load_source(spec).eval_rows(4, cfg.seed)]
    assert [tok.decode(ids, skip_special_tokens=True) for ids in seen[:4]] == plain  # ... the evaluation does not


# ================================================================================== prompt augmentation
POOL = [{"name": "plain"}, {"name": "boxed", "suffix": " Box it.", "format": r".*\\boxed\{\d+\}"},
        {"name": "tags", "system": "Use tags.", "response_prefix": "<think>", "tags": ["think", "answer"]}]


def test_prompt_augmentation_draws_hand_values():
    pa = PromptAugmentation(templates=POOL)
    draws = pa.draw(11, 6)
    assert draws == pa.draw(11, 6) and len(draws) == 6 and set(draws) <= {0, 1, 2}  # a function of the seed
    assert any(pa.draw(s, 6) != draws for s in range(12, 20))
    cyc = PromptAugmentation(templates=POOL, assign="cycle").draw(11, 6)
    o = cyc[0]
    assert cyc == [(o + j) % 3 for j in range(6)]  # every template twice in a group of 6
    one = PromptAugmentation(templates=POOL, per="prompt").draw(11, 5)
    assert len(set(one)) == 1 and len(one) == 5
    assert pa.plan(4) == ["plain", "boxed", "tags"]


def test_prompt_augmentation_config_checks():
    with pytest.raises(ConfigError, match=r"^filters.0.templates.1.name: 'a' names two templates"):
        load_config(None, ["filters=[{name: prompt_augmentation, templates: [{name: a}, {name: a}]}]"])
    with pytest.raises(ConfigError, match=r"^filters.0.templates.0: give 'format' \(a regex\) or 'tags', not both"):
        load_config(None, ["filters=[{name: prompt_augmentation, templates: [{name: a, format: x, tags: [t]}]}]"])
    with pytest.raises(ConfigError, match=r"^filters.0.templates.0.format: expected a valid regular expression"):
        load_config(None, ["filters=[{name: prompt_augmentation, templates: [{name: a, format: '(('}]}]"])
    with pytest.raises(ConfigError, match=r"^filters.0.templates: required parameter missing"):
        load_config(None, ["filters=[{name: prompt_augmentation}]"])


class EchoBackend:
    """Completion tokens [100 + row, 1]; records each call's (prompt ids, n, seeds)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, n, params, seeds):
        self.calls.append((prompt_ids, n, list(seeds)))
        N = len(prompt_ids) * n
        comp = torch.tensor([[100 + r, 1] for r in range(N)])
        pid, pmask = left_pad([p for p in prompt_ids for _ in range(n)], 0)
        return Generation(prompt_ids=pid, prompt_mask=pmask, completion_ids=comp, completion_mask=torch.ones(N, 2),
                          logprobs=torch.full((N, 2), -0.5), truncated=torch.zeros(N, dtype=torch.bool),
                          texts=[f"t{r}" for r in range(N)])


def _encode(p):  # a toy chat encoding: system turn -> 7, each character -> its code point mod 50
    if isinstance(p, list):
        return [7 if m["role"] == "system" else 8 for m in p] + [ord(c) % 50 for m in p for c in m["content"]]
    return [ord(c) % 50 for c in p]


def test_prompt_augmentation_rollout_gives_each_row_its_template():
    be = EchoBackend()
    pa = PromptAugmentation(templates=POOL)
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}]
    ctx = PlanContext(rows=rows, prompt_ids=[_encode(r["prompt"]) for r in rows], generate=be.generate,
                      params=SamplingParams(), seeds=[5, 6], group_size=3, encode=_encode,
                      encode_text=lambda t: [ord(c) % 50 + 50 for c in t])
    out = pa.rollout(ctx)
    ks = pa.draw(5, 3) + pa.draw(6, 3)
    assert out.columns["template"] == [POOL[k]["name"] for k in ks]
    assert out.columns["template_format"] == [[None, r".*\\boxed\{\d+\}", ["think", "answer"]][k] for k in ks]
    ids, n, seeds = be.calls[0]
    assert n == 1 and len(ids) == 6 and len(set(seeds)) == 6  # one generation row per completion, its own seed
    for r, k in enumerate(ks):
        q = rows[r // 3]["prompt"]
        t = POOL[k]
        want = _encode(decorate_prompt(q, system=t.get("system"), suffix=t.get("suffix", "")))
        want += [ord(c) % 50 + 50 for c in t.get("response_prefix", "")]
        assert ids[r] == want
        assert out.generation.prompt_ids[r][out.generation.prompt_mask[r].bool()].tolist() == want
        assert out.generation.texts[r] == t.get("response_prefix", "") + f"t{r}"  # rewards see the whole answer
    assert out.over == [False] * 6
    # per: prompt -> one template and one call of G completions per prompt, the run's own seeds
    be2 = EchoBackend()
    PromptAugmentation(templates=POOL, per="prompt").rollout(
        PlanContext(rows=rows, prompt_ids=[], generate=be2.generate, params=SamplingParams(), seeds=[5, 6],
                    group_size=3, encode=_encode, encode_text=lambda t: [1]))
    assert be2.calls[0][1] == 3 and be2.calls[0][2] == [5, 6]


def test_template_format_reward_hand_values():
    comps = ["<think>a</think> <answer>3</answer>", "<think>a</think>", "so \\boxed{3}", "\\boxed{x}", "3"]
    fmts = [["think", "answer"], ["think", "answer"], r".*\\boxed\{\d+\}", r".*\\boxed\{\d+\}", None]
    assert template_format(["q"] * 5, comps, fmts) == [1.0, 0.0, 1.0, 0.0, None]
    assert template_format(["q"], ["3"]) == [None]  # no template column: the reward does not apply


def test_prompt_augmentation_rows_stay_on_policy_and_share_their_group(model_dir, tmp_path):
    """Per-row prompts: the sampler's log-probs equal the trainer's recomputation of every row with its own
    prompt_ids (what the update, the reference and TIS use), and the group stays the question's (one group id,
    one advantage baseline over the templates)."""
    pool = ("[{name: a, prefix: 'Q:', format: '\\d+'}, {name: b, suffix: ' ->', response_prefix: '1'}, "
            "{name: c, prefix: '#', suffix: '#'}]")
    cfg = load_config(None, small(model_dir, tmp_path / "pa", "rewards=[{name: data31_coin}, "
                                  "{name: template_format, weight: 0.5}]",
                                  f"filters=[{{name: prompt_augmentation, templates: {pool}}}]"))
    tr = Trainer(cfg, tmp_path / "pa")
    b = tr.batches.rollout(0)
    assert len(set(b.columns["template"])) > 1
    lens = b.prompt_mask.sum(-1)
    assert any(len(set(lens[b.group_ids == g].tolist())) > 1 for g in b.group_ids.unique())  # prompts differ in a group
    logp, _ = tr.ctx.logprobs(b)
    m = b.completion_mask
    assert torch.allclose(logp * m, b.sampler_logprobs * m, atol=1e-4)
    for g in b.group_ids.unique():  # one question per group, whatever the template
        assert len({b.prompts[i] for i in torch.nonzero(b.group_ids == g).flatten().tolist()}) == 1
    tr.step.score(b)
    tr.step.advantages(tr.ctx, b)
    for g in b.group_ids.unique():
        rows = b.group_ids == g
        r = b.reward[rows].double()
        want = (r - r.mean()) / (r.std() + 1e-6) if r.std() > 0 else torch.zeros_like(r)
        assert torch.allclose(b.advantages[rows].double(), want, atol=1e-5)  # GRPO over the mixed templates
    m1 = tr.train_step(1)
    assert math.isfinite(m1["pg_loss"]) and math.isfinite(m1["grad_norm"])


# ================================================================================== TraPO
def test_trajectory_similarity_hand_values():
    q = [0.0, 0.5, 1.0]
    assert trajectory_similarity(q, [[0.2, 0.4, 0.6]], 3) == pytest.approx(1.0)   # same shape: r = 1
    assert trajectory_similarity(q, [[1.0, 0.5, 0.0]], 3) == pytest.approx(-1.0)  # mirrored: r = -1
    assert trajectory_similarity(q, [[0.2, 0.4, 0.6], [1.0, 0.5, 0.0]], 3) == pytest.approx(0.0)  # mean of 1, -1
    assert trajectory_similarity(q, [[0.2, 0.4, 0.6], [1.0, 0.5, 0.0]], 3, "max") == pytest.approx(1.0)
    assert trajectory_similarity(q, [[0.3, 0.3, 0.3]], 3) == pytest.approx(0.0)   # constant: the zero vector
    # prefix alignment: the reference [0, 1] has 2 visits -> L = 2: z(0, .5) = (-.71, .71) = z(0, 1) -> 1
    assert trajectory_similarity(q, [[0.0, 1.0]], 2) == pytest.approx(1.0)
    assert math.isnan(trajectory_similarity(q, [[0.0, 1.0]], 3))  # too short for min_len 3: no reference


def semi_batch(keys_rates: list[tuple[str, bool, float]], G: int = 4) -> RolloutBatch:
    """One group per (prompt, labeled, pass rate): round(rate * G) rows scoring 1 on the group's own column."""
    N = len(keys_rates) * G
    correct, vote = torch.full((N,), math.nan), torch.full((N,), math.nan)
    for g, (_, lab, rate) in enumerate(keys_rates):
        col = correct if lab else vote
        col[g * G:(g + 1) * G] = torch.tensor([1.0 if j < round(rate * G) else 0.0 for j in range(G)])
    return RolloutBatch(
        prompt_ids=torch.ones(N, 1, dtype=torch.long), prompt_mask=torch.ones(N, 1, dtype=torch.long),
        completion_ids=torch.ones(N, 1, dtype=torch.long), completion_mask=torch.ones(N, 1),
        group_ids=torch.arange(len(keys_rates)).repeat_interleave(G), sampler_logprobs=torch.zeros(N, 1),
        truncated=torch.zeros(N, dtype=torch.bool), prompts=[k for k, _, _ in keys_rates for _ in range(G)],
        completions=["x"] * N, columns={"labeled": [lab for _, lab, _ in keys_rates for _ in range(G)]},
        reward_names=["correct", "majority_vote"], rewards=torch.stack([correct, vote], -1),
        reward=torch.zeros(N), valid=torch.ones(N, dtype=torch.bool))


def test_trapo_keeps_labeled_and_the_unlabeled_that_follow_them():
    st = stages.build("filter", "trapo", {"warmup_visits": 2, "threshold": 0.4, "top_ratio": 0.0})
    f: TraPO = st.fn
    # state after two visits: labeled L1 rises, L2 rises; U1 rises, U2 falls, U3 was seen once
    f.trajectories = {prompt_key("L1"): [0.0, 0.25], prompt_key("L2"): [0.25, 0.5],
                      prompt_key("U1"): [0.25, 0.5], prompt_key("U2"): [1.0, 0.75], prompt_key("U3"): [0.5]}
    f.labeled = {prompt_key("L1"): True, prompt_key("L2"): True, prompt_key("U1"): False,
                 prompt_key("U2"): False, prompt_key("U3"): False}
    b = semi_batch([("L1", True, 0.5), ("U1", False, 0.75), ("U2", False, 0.5), ("U3", False, 1.0)])
    keep = st(b)
    # U1: Q = [.25, .5, .75] vs L1 + this visit [0, .25, .5] -> r = 1, vs L2 [.25, .5] (L = 2) -> r = 1: s = 1 >= .4
    # U2: Q = [1, .75, .5] -> r = -1 with both: s = -1, dropped; U3: 2 visits < warmup_visits + 1 = 3, dropped
    assert keep.tolist() == [True] * 4 + [True] * 4 + [False] * 4 + [False] * 4
    recs, _ = f.judge(b.rewards, b.reward_names, b.group_ids, b.prompts, b.columns)
    assert [round(r["score"], 6) if math.isfinite(r["score"]) else None for r in recs] == [None, 1.0, -1.0, None]
    # top_ratio keeps the best of the scored unlabeled groups even below the threshold: k = max(1, floor(2 x .5))
    f.threshold, f.top_ratio = 1.1, 0.5
    assert st(b).tolist()[4:12] == [True] * 4 + [False] * 4
    with pytest.raises(ConfigError, match="filters.trapo: the rows have no 'labeled' column"):
        st({**stages.field_values(b), "columns": {}})
    with pytest.raises(DataError, match="filters.trapo: row 0 column 'labeled': expected true or false, got 'maybe'"):
        st({**stages.field_values(b), "columns": {"labeled": ["maybe"] * len(b)}})


def test_trapo_state_changes_once_per_step_the_same_on_every_process():
    """Two processes judge different groups; the gathered records give both the same trajectories and reference."""
    ranks = [stages.build("filter", "trapo", {"warmup_visits": 1, "top_ratio": 0.0}) for _ in range(2)]
    batches = [[semi_batch([("L1", True, 0.25), ("U1", False, 0.5)]), semi_batch([("L2", True, 0.5)])],
               [semi_batch([("L1", True, 0.5), ("U1", False, 0.75)]), semi_batch([("L2", True, 0.75)])]]
    for step in range(2):
        for st, b in zip(ranks, batches[step]):
            before = json.dumps(st.state_dict())
            keep = st(b)
            assert json.dumps(st.state_dict()) == before  # __call__ reads the state, never changes it
            st.observe(b)
        records = [list(st.fn.observed) for st in ranks]
        metrics = [stages.end_step([st], StepEnd(gather=lambda obj, r=r: [[records[0]], [records[1]]]))
                   for r, st in enumerate(ranks)]
        assert metrics[0] == metrics[1]
    a, b = ranks[0].state_dict(), ranks[1].state_dict()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["trajectories"][prompt_key("L1")] == [0.25, 0.5] and a["trajectories"][prompt_key("U1")] == [0.5, 0.75]
    # step 2: U1's Q = [.5, .75] vs L1 [.25, .5] -> r = 1 >= .4: selected, and joins the reference
    assert a["reliable"] == {prompt_key("U1"): True} and metrics[0]["filter/trapo/selected"] == 1.0
    assert keep.tolist() == [True] * 4  # rank 1's last batch: labeled only
    fresh = stages.build("filter", "trapo", {})
    fresh.load_state_dict(json.loads(json.dumps(a)))
    assert fresh.state_dict() == a


def test_majority_vote_only_unlabeled_leaves_labeled_rows_to_the_verifier():
    comps = ["3", "3", "4", "7", "7", "1"]
    g = [0, 0, 0, 1, 1, 1]
    assert majority_vote(None, comps, g) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    lab = [True, True, True, "false", "false", "false"]  # a CSV file's cells work too
    assert majority_vote(None, comps, g, labeled=lab, only_unlabeled=True) == [None, None, None, 1.0, 1.0, 0.0]
    assert majority_vote(None, comps, g, labeled=lab) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # off by default


def test_trapo_trains_on_semi_supervised_data(model_dir, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "labeled": i % 2 == 0}
            for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1)])]
    data = tmp_path / "semi.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(None, small(model_dir, tmp_path / "trapo",
                                  f"task={{name: file, path: {data}, verifier: arithmetic, eval_fraction: 0}}",
                                  "rewards=[{name: correct}, {name: majority_vote, only_unlabeled: true}]",
                                  "filters=[{name: trapo, warmup_visits: 1, max_attempts: 1}]"))
    tr = Trainer(cfg, tmp_path / "trapo")
    m0 = tr.train_step(0)
    # step 1: every unlabeled prompt has one visit (< warmup_visits + 1): only the two labeled groups train
    assert m0["filter/trapo/judged"] == 2.0 and m0["filter/trapo/selected"] == 0.0
    assert m0["filter/padded_groups"] == 2.0
    f = tr.step.selection[0].fn
    assert sorted(f.labeled.values()) == [False, False, True, True]
    assert all(len(v) == 1 for v in f.trajectories.values())
    m1 = tr.train_step(1)
    assert all(len(v) == 2 for v in f.trajectories.values()) and m1["filter/trapo/judged"] == 2.0
    assert math.isfinite(m1["pg_loss"])


# ================================================================================== AVATAR
def test_tas_weights_hand_values():
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]).float()
    w = tas_weights(mask, 0.3)
    # L = 5: t/(L-1) = 0, .25, .5, .75, 1 -> (2t'-1)^2 = 1, .25, 0, .25, 1 -> 1 + .3 x that
    assert w[0].tolist() == pytest.approx([1.3, 1.075, 1.0, 1.075, 1.3])
    assert w[1].tolist() == pytest.approx([1.3, 1.0, 1.3, 0.0, 0.0])  # L = 3: 0, .5, 1
    assert w[2].tolist() == pytest.approx([1.3, 0, 0, 0, 0]) and w[3].sum() == 0
    assert torch.equal(tas_weights(mask, 0.0), mask)  # lam 0: GRPO
    assert torch.equal(temporal_advantage_shaping(mask)["pg_mask"], tas_weights(mask, 0.3))


def test_tas_multiplies_the_policy_loss_in_the_objective():
    from postrl.losses.objective import Objective

    cfg = load_config(None, ["regularizers=[{name: temporal_advantage_shaping, lam: 0.5}]"])
    plain, tas = Objective.from_config(load_config(None, [])), Objective.from_config(cfg)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]], requires_grad=True)
    fields = {"logp": logp, "old_logp": logp.detach(), "advantages": torch.tensor([1.0, -2.0]), "mask": mask,
              "sampler_logp": logp.detach(), "ref_logp": None, "entropy": None, "logits": None,
              "lengths": mask.sum(-1)}
    w = plain.weights(mask, torch.ones(2, dtype=torch.bool))
    l0, _, _ = plain(fields, w)
    l1, _, _ = tas(fields, w)
    g0, = torch.autograd.grad(l0, logp)
    g1, = torch.autograd.grad(l1, logp)
    # on-policy ratio 1: dL/dlogp_t = -w_t A_i x TAS_t (row 0: 1.5, 1, 1.5; row 1, L = 2: 1.5, 1.5)
    tas_w = torch.tensor([[1.5, 1.0, 1.5], [1.5, 1.5, 0.0]])
    assert torch.allclose(g1, g0 * tas_w, atol=1e-6)


def replay_batch(rewards: list[float], G: int = 2, base: int = 0, step: int = 0) -> RolloutBatch:
    N = len(rewards)
    r = torch.tensor(rewards)
    return RolloutBatch(
        prompt_ids=torch.tensor([[base + 1 + i // G] for i in range(N)]), prompt_mask=torch.ones(N, 1).long(),
        completion_ids=torch.arange(N * 3).reshape(N, 3) + 10 + base, completion_mask=torch.ones(N, 3),
        group_ids=torch.arange(N) // G, sampler_logprobs=-torch.arange(N * 3).reshape(N, 3).float() / 10,
        truncated=torch.zeros(N, dtype=torch.bool), prompts=[f"p{base + i // G}" for i in range(N)],
        completions=[f"c{base + i}" for i in range(N)], columns={"answer": [str(base + i) for i in range(N)]},
        reward_names=["correct"], rewards=r.unsqueeze(-1), raw_rewards=r.unsqueeze(-1), reward=r.clone(),
        valid=torch.ones(N, dtype=torch.bool), extra={"step": step})


def ctx(seed=0):
    return ExpandContext(generate=None, decode=None, group_size=2, seed=seed)


def test_avatar_replay_fills_zero_signal_slots_with_stored_groups():
    st = stages.build("expansion", "avatar_replay", {"capacity": 2})
    rp: AvatarReplay = st.fn
    step0 = replay_batch([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.25])  # groups: std .5, 0, 0, .125
    assert rp.expand(step0, ctx()) is step0  # empty buffer: nothing to replay
    st.observe(step0)
    m = stages.end_step([st], StepEnd())
    # candidates: group 0 (std .5) and group 3 (std .125); slots: groups 1 and 2
    assert m == {"expansion/avatar_replay/slots": 2.0, "expansion/avatar_replay/replayed": 0.0,
                 "expansion/avatar_replay/added": 2.0, "expansion/avatar_replay/buffer": 2.0}
    assert [e["std"] for e in rp.buffer] == [0.5, 0.125] and rp.buffer[0]["rows"][0]["logprobs"] == \
        pytest.approx([0.0, -0.1, -0.2])
    step1 = replay_batch([0.0, 0.0, 1.0, 0.0, 0.7, 0.7], base=100, step=1)  # group 0 and group 2 are slots
    before = json.dumps(rp.state_dict())
    out = rp.expand(step1, ctx(seed=3))
    assert json.dumps(rp.state_dict()) == before
    assert len(out) == len(step1)  # same rows: DDP's row counts stay equal
    rep = out.extra["replayed"]
    assert rep.sum() == 4 and out.extra["replay_age"][rep].tolist() == [1] * 4
    kept = ~rep
    assert out.completions[:2] == ["c102", "c103"] and out.reward[kept].tolist() == [1.0, 0.0]  # the varying group
    stored = sorted(out.reward[rep].tolist())
    assert stored == [0.0, 0.0, 0.25, 1.0]  # both stored groups: (1, 0) and (0, .25)
    i = out.completions.index("c0")
    assert out.sampler_logprobs[i].tolist() == pytest.approx([0.0, -0.1, -0.2])  # the old policy's log-probs
    assert out.prompt_ids[i][out.prompt_mask[i].bool()].tolist() == [1] and out.columns["answer"][i] == "0"
    assert out.valid.all() and out.raw_rewards[rep, 0].tolist() == out.reward[rep].tolist()
    # GRPO on the new batch: the replayed group (1, 0) gets +-1/sqrt(2) (unbiased std .707: (1 - .5)/.707 = .707)
    from postrl.advantages.outcome import grpo  # noqa: F401  (registered)
    adv = stages.build("advantage", "grpo", {})(out)
    g = out.group_ids[i]
    assert sorted(adv[out.group_ids == g].tolist()) == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    # the step's final batch records what it used: each stored group is replayed once
    st.observe(out)
    m = stages.end_step([st], StepEnd())
    assert m["expansion/avatar_replay/slots"] == 2.0 and m["expansion/avatar_replay/replayed"] == 2.0
    assert [e["std"] for e in rp.buffer] == [0.5]  # the fresh varying group (1, 0) of step 1 (std .5)


def test_avatar_replay_state_is_the_same_on_every_process():
    ranks = [stages.build("expansion", "avatar_replay", {"capacity": 3}) for _ in range(2)]
    batches = [replay_batch([1.0, 0.0, 0.0, 0.0]), replay_batch([0.2, 0.4, 0.3, 0.3], base=50)]
    for st, b in zip(ranks, batches):
        st.observe(b)
    records = [list(st.fn.observed) for st in ranks]
    for st in ranks:
        stages.end_step([st], StepEnd(gather=lambda obj: [[records[0]], [records[1]]]))
    a, b = (json.dumps(st.state_dict(), sort_keys=True) for st in ranks)
    assert a == b and [e["std"] for e in ranks[0].fn.buffer] == pytest.approx([0.5, 0.1])  # rank order, then std


def test_avatar_replay_needs_importance_correction_and_trains(model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^filters.0: replayed groups were sampled by an earlier policy; set "
                                          r"loss.tis.level=token"):
        load_config(None, ["filters=[{name: avatar_replay}]"])
    cfg = load_config(None, small(model_dir, tmp_path / "av", "rewards=[{name: data31_coin}]",
                                  "filters=[{name: avatar_replay}]", "loss.tis.level=token", "train.steps=3",
                                  "regularizers=[{name: temporal_advantage_shaping}]"))
    tr = Trainer(cfg, tmp_path / "av")
    m0 = tr.train_step(0)
    assert m0["expansion/avatar_replay/replayed"] == 0.0 and m0["expansion/avatar_replay/buffer"] >= 1
    # force a zero-signal group at step 1: the coin pays nothing for one prompt
    batches = tr.batches
    real = batches._score

    def score(b):
        info = real(b)
        rows = b.group_ids == b.group_ids[0]
        b.reward[rows] = 0.0
        return info

    batches._score = score
    m1 = tr.train_step(1)
    assert m1["expansion/avatar_replay/slots"] >= 1 and m1["expansion/avatar_replay/replayed"] >= 1
    assert m1["replay/rows"] >= 4 and math.isfinite(m1["pg_loss"]) and "tis/weight" in m1


# ================================================================================== ConvSearch-R1, DP-RFT, RLFR
def test_bm25_hand_values_and_rank_incentive(tmp_path):
    from postrl.rewards.retrieval import BM25, rank_incentive, rank_incentive_value

    bm = BM25(["the cat sat", "the dog", "cats and dogs"], k1=0.9, b=0.4)
    # 'cat': N 3, n 1 -> idf = ln(1 + 2.5/1.5) = ln(8/3); d0: tf 1, |d| 3, avgdl 8/3 ->
    # 1.9 / (1 + 0.9 (0.6 + 0.4 x 9/8)) = 1.9 / 1.945
    assert float(bm.scores("cat")[0]) == pytest.approx(math.log(8 / 3) * 1.9 / 1.945)
    assert bm.scores("cat")[1:].tolist() == [0.0, 0.0]
    # 'the dog': d1 holds both words, d0 only 'the' -> ranks d1 1, d0 2; 'dogs' != 'dog' (no stemming): d2 unseen
    assert bm.rank("the dog", [1]) == 1 and bm.rank("the dog", [0]) == 2 and bm.rank("the dog", [2]) is None
    assert [rank_incentive_value(r) for r in (1, 10, 11, 100, 101, None)] == \
           pytest.approx([2.0, 1.0, 89 / 90, 0.0, 0.0, 0.0])  # (19 - r)/9, then (100 - r)/90
    corpus = tmp_path / "passages.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": f"p{i}", "text": t}) for i, t in
                                enumerate(["the cat sat", "the dog", "cats and dogs"])))
    comps = ["<think>x</think>\n<rewrite>the dog</rewrite>", "<think>x</think>\n<rewrite>the dog</rewrite>",
             "<rewrite>the dog</rewrite>", "<think>x</think>\n<rewrite>the dog</rewrite>"]
    out = rank_incentive(None, comps, gold=["p1", ["p2", "p0"], "p1", "nope"], corpus=str(corpus))
    # rank 1 -> 2.0; best of p2 (unseen) and p0 (rank 2) -> 17/9; no <think>: the format penalty; unknown id: None
    assert out[:3] == pytest.approx([2.0, 17 / 9, -0.1]) and out[3] is None
    assert rank_incentive(None, comps[2:3], gold=["p1"], corpus=str(corpus), extract="rewrite_tag") == [2.0]


def test_dp_nn_votes_counts_nearest_neighbour_votes_with_gaussian_noise(tmp_path):
    from postrl.rewards.private import dp_nn_votes, gaussian_dp_epsilon, hashed_embedding, nn_votes

    e = hashed_embedding(["red apple", "apple red", ""], dim=64)
    assert torch.allclose(e[0], e[1]) and e[2].abs().sum() == 0 and float(e[0].norm()) == pytest.approx(1.0)
    priv = tmp_path / "private.jsonl"
    texts = ["red apple pie", "red apple", "green tea", "apple red juice"]
    priv.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    comps = ["red apple", "green tea", "blue sky", "green tea"]
    # group 0 = (red apple, green tea): 3 apple texts vote for 0, the tea text for 1; group 1 = (blue sky, green
    # tea): the apple texts share no word with either (cosine 0: the first, blue sky), the tea text votes for 1
    votes = nn_votes(hashed_embedding(texts), hashed_embedding(comps[:2]))
    assert votes.tolist() == [3.0, 1.0]
    r = dp_nn_votes(None, comps, [0, 0, 1, 1], private=str(priv), noise_multiplier=0.0)
    assert r == pytest.approx([3 / 2, 1 / 2, 3 / 2, 1 / 2])  # votes / (M / G) = votes / 2
    noisy = dp_nn_votes(None, comps, [0, 0, 1, 1], private=str(priv), noise_multiplier=1.0)
    assert noisy == dp_nn_votes(None, comps, [0, 0, 1, 1], private=str(priv), noise_multiplier=1.0)  # seeded
    assert noisy != r and abs(sum(noisy) - sum(r)) < 8
    # RDP of the Gaussian mechanism: T compositions at sigma -> min_a T a / (2 sigma^2) + ln(1/delta) / (a - 1)
    a = 1 + math.sqrt(2 * math.log(1e5) / 100)
    assert gaussian_dp_epsilon(1.0, 100, 1e-5) == pytest.approx(100 * a / 2 + math.log(1e5) / (a - 1), rel=1e-3)
    assert gaussian_dp_epsilon(10.0, 1, 1e-5) < gaussian_dp_epsilon(1.0, 1, 1e-5)


def test_rlfr_field_learns_the_successes_latents_and_shapes_the_advantage():
    from postrl.advantages import grpo

    st = stages.build("advantage", "rlfr", {"beta": 0.5, "flow_epochs": 40, "flow_lr": 3e-2, "width": 32})
    f = st.fn
    gen = torch.Generator().manual_seed(0)
    N, T, H = 4, 3, 2
    good = torch.tensor([2.0, 2.0]) + 0.05 * torch.randn(N, T, H, generator=gen)  # successes' latents near (2, 2)
    hidden = good.clone()
    hidden[2:] = torch.tensor([-2.0, 2.0])                                       # failures' latents elsewhere
    reward = torch.tensor([1.0, 1.0, 0.0, 0.0])
    mask, g = torch.ones(N, T), torch.tensor([0, 0, 0, 0])
    batch = {"reward": reward, "completion_hidden": hidden, "completion_mask": mask, "group_ids": g}
    a0 = st(batch)
    assert torch.allclose(a0, grpo(reward, g).unsqueeze(-1).expand(N, T))  # no field yet: GRPO's advantage
    before = f.deviation(torch.tensor([[2.0, 2.0], [-2.0, 2.0]]))
    st.observe(batch)
    m = stages.end_step([st], StepEnd())
    assert m["advantage/rlfr/flow_tokens"] == 6.0 and f.fits == 1
    after = f.deviation(torch.tensor([[2.0, 2.0], [-2.0, 2.0]]))
    assert after[0] < 0.5 * before[0] and after[0] < after[1]  # the field transports noise to the successes' latents
    a1 = st(batch)
    shaped = (a1 - grpo(reward, g).unsqueeze(-1)) / 0.5
    assert shaped[:2].mean() > 0 > shaped[2:].mean() and abs(float(shaped.mean())) < 1e-5  # whitened over tokens
    state = json.loads(json.dumps(st.state_dict()))
    twin = stages.build("advantage", "rlfr", {"beta": 0.5, "width": 32})
    twin.load_state_dict(state)
    assert torch.allclose(twin.fn.deviation(hidden), f.deviation(hidden))


def test_rlfr_trains_in_the_trainer(model_dir, tmp_path):
    cfg = load_config(None, small(model_dir, tmp_path / "rlfr", "rewards=[{name: data31_coin}]",
                                  "advantage={name: rlfr, width: 16}"))
    tr = Trainer(cfg, tmp_path / "rlfr")
    m0, m1 = tr.train_step(0), tr.train_step(1)
    assert m0["advantage/rlfr/flow_tokens"] > 0 and math.isfinite(m1["pg_loss"]) and tr.step.advantage.fn.fits >= 1
