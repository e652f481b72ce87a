"""Multi-turn rollouts: token ids preserved across turns, masks, tools (raising, hanging, malformed), limits."""

from __future__ import annotations

import math
import time

import pytest
import torch

from postrl.context import ModelContext
from postrl.environments import Environment, make
from postrl.environments.calculator import CalculatorEnv, calc
from postrl.environments.reward import environment as env_reward
from postrl.environments.tools import ToolEnvironment, parse_tool_calls, run_tool
from postrl.models.tiny import build_model, build_tokenizer
from postrl.environments import episodes
from postrl.generation import Generation, SamplingParams
from postrl.rollout.hf import HFGenerator

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


class Echo(Environment):
    """Three turns: observation 'ok<k>' after turns 0 and 1, reward 0.5 on turn 1 and 1.0 on the last."""

    def reset(self, row):
        self.k = 0
        return row["prompt"]

    def step(self, action):
        self.k += 1
        return f"ok{self.k}", (0.5 if self.k == 2 else 1.0 if self.k == 3 else None), self.k == 3, {}


def recording(gen):
    calls = []

    def generate(prompts, n, params, seeds):
        out = gen.generate(prompts, n, params, seeds)
        calls.append(([list(p) for p in prompts], out))
        return out

    return generate, calls


def test_chat_template_trained_ids_equal_sampled_ids_across_turns():
    tok = chat_tokenizer()
    model = build_model(tok, size="nano", seed=0)
    generate, calls = recording(HFGenerator(model, tok))
    ctx = ModelContext(model, tok, sampling=SamplingParams(max_new_tokens=6, temperature=1.0), generate=generate,
                       pad_id=tok.pad_token_id)
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "34*5=", "answer": "170"}]
    b = episodes.rollout(ctx, rows, 2, [11, 12], Echo, max_turns=3, max_total_tokens=200,
                          group_ids=torch.tensor([0, 0, 1, 1]))
    assert len(calls) == 3 and b.extra["num_turns"].tolist() == [3, 3, 3, 3]
    for r in range(4):
        prompt = b.prompt_ids[r][b.prompt_mask[r].bool()].tolist()
        L = int(b.extra["turn_ends"][r, -1]) + 1
        comp, m = b.completion_ids[r, :L].tolist(), b.completion_mask[r, :L]
        sampled, msgs = [], [{"role": "user", "content": rows[r // 2]["prompt"]}]
        for k, (ctxs, out) in enumerate(calls):
            n = int(out.completion_mask[r].sum())
            ids = out.completion_ids[r, :n].tolist()
            # token in: turn k generated from exactly prompt + the completion so far, nothing re-encoded
            start = len(ctxs[r]) - len(prompt)
            assert ctxs[r] == prompt + comp[:start]
            # token out: the trained ids at the turn's positions are the sampled ids, in the loss mask
            assert comp[start:start + n] == ids and m[start:start + n].tolist() == [1.0] * n
            assert int(b.extra["turn_ends"][r, k]) == start + n - 1
            assert torch.allclose(b.sampler_logprobs[r, start:start + n], out.logprobs[r, :n])
            sampled += ids
            msgs.append({"role": "assistant", "content": tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids)})
            if k < 2:
                msgs.append({"role": "user", "content": f"ok{k + 1}"})
        assert [t for t, keep in zip(comp, m.tolist()) if keep] == sampled
        # the environment's tokens are the template's separators around the observation, out of the mask
        text = tok.decode(prompt + comp)
        want = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True) + tok.decode(
            calls[-1][1].completion_ids[r, :int(calls[-1][1].completion_mask[r].sum())].tolist())
        assert text == want
    assert b.extra["turn_rewards"][0].tolist() == [0.0, 0.5, 1.0]
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [1.5] * 4
    # the trainer's recomputed log-probs of the trained tokens equal the sampler's
    lp, _ = ctx.logprobs(b)
    mask = b.completion_mask.bool()
    assert torch.allclose(lp[mask], b.sampler_logprobs[mask], atol=1e-4)


def scripted(tok, turns: list[str]):
    """A generation backend that 'samples' ``turns[k]`` on turn k (k = number of calls so far), honouring
    max_new_tokens and stop strings like HFGenerator."""
    state = {"k": 0}

    def generate(prompts, n, params, seeds):
        text = turns[state["k"]]
        state["k"] += 1
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        ended = True
        for s in params.stop:
            if s in text:
                ids = list(tok(text[:text.index(s) + len(s)], add_special_tokens=False)["input_ids"])
        if len(ids) > params.max_new_tokens:
            ids, ended = ids[:params.max_new_tokens], False
        elif not (ids and ids[-1] == tok.eos_token_id) and not any(s in text for s in params.stop):
            ended = False
        N = len(prompts)
        t = torch.tensor([ids] * N)
        return Generation(torch.zeros(N, 1, dtype=torch.long), torch.ones(N, 1, dtype=torch.long), t,
                          torch.ones(t.shape), torch.full(t.shape, -0.5), torch.tensor([not ended] * N), [text] * N)

    return generate


def ctx_for(tok, generate, max_new=40):
    return ModelContext(None, tok, sampling=SamplingParams(max_new_tokens=max_new), generate=generate,
                        pad_id=tok.pad_token_id)


@pytest.mark.parametrize("template", ["auto", "none"])
def test_calculator_episode_masks_and_reward(template):
    tok = chat_tokenizer()
    turns = ['<tool_call>calc("12*34")</tool_call> and more', "408</s>"]
    b = episodes.rollout(ctx_for(tok, scripted(tok, turns)), [{"prompt": "12*34=", "answer": "408"}], 1, [0],
                          CalculatorEnv, max_turns=3, max_total_tokens=200, group_ids=torch.tensor([0]),
                          chat_template=template)
    call_ids = tok('<tool_call>calc("12*34")</tool_call>', add_special_tokens=False)["input_ids"]
    obs = "<result>408</result>"
    sep = f"</s><tool>{obs}</s><assistant>" if template == "auto" else obs
    obs_ids = tok(sep, add_special_tokens=False)["input_ids"]
    ans = tok("408</s>", add_special_tokens=False)["input_ids"]
    L = len(call_ids) + len(obs_ids) + len(ans)
    assert b.completion_ids[0, :L].tolist() == call_ids + obs_ids + ans
    assert b.completion_mask[0, :L].tolist() == [1.0] * len(call_ids) + [0.0] * len(obs_ids) + [1.0] * len(ans)
    assert (b.sampler_logprobs[0, :L] != 0).tolist() == b.completion_mask[0, :L].bool().tolist()
    assert b.extra["turn_ends"][0].tolist() == [len(call_ids) - 1, L - 1, -1]
    assert b.extra["tool_calls"].tolist() == [1] and b.extra["tool_errors"].tolist() == [0]
    assert b.columns["env_turn_rewards"] == [[None, 1.0]] and not bool(b.truncated[0])
    assert math.isnan(b.extra["turn_rewards"][0, 2]) and b.extra["turn_rewards"][0, :2].tolist() == [0.0, 1.0]


def test_eos_ended_turn_is_not_followed_by_a_second_end_of_turn():
    tok = chat_tokenizer()
    b = episodes.rollout(ctx_for(tok, scripted(tok, ["hi</s>", "x</s>", "y</s>"])), [{"prompt": "q"}], 1, [0],
                          Echo, max_turns=3, max_total_tokens=200, group_ids=torch.tensor([0]))
    assert tok.decode(b.completion_ids[0][b.completion_ids[0] != tok.pad_token_id].tolist()) == \
        "hi</s><user>ok1</s><assistant>x</s><user>ok2</s><assistant>y</s>"


def boom(x: int) -> int:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("kaput")


def hang(x: int) -> int:
    """Never return in time.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


def test_raising_and_hanging_tools_are_counted_and_isolated():
    tok = build_tokenizer()

    class Env(ToolEnvironment):
        def __init__(self):
            super().__init__([boom, hang, calc], timeout=0.3)

        def verify(self, answer, row):
            return float(answer.strip() == "7")

    turns = ["<tool_call>boom(1)</tool_call>", "<tool_call>hang(1)</tool_call>",
             "<tool_call>nope(</tool_call>", "<tool_call>calc(\"3+4\")</tool_call>", "7</s>"]
    t0 = time.perf_counter()
    b = episodes.rollout(ctx_for(tok, scripted(tok, turns)), [{"prompt": "q"}], 1, [0], Env, max_turns=5,
                          max_total_tokens=400, group_ids=torch.tensor([0]), chat_template="none")
    assert time.perf_counter() - t0 < 3.0  # the hung tool was abandoned after its timeout
    ex = b.extra
    assert (ex["tool_calls"].item(), ex["tool_errors"].item(), ex["malformed_calls"].item()) == (3, 2, 1)
    assert ex["num_turns"].item() == 5 and b.columns["env_turn_rewards"] == [[None] * 4 + [1.0]]
    text = b.completions[0]
    assert "<result>error: RuntimeError: kaput</result>" in text and "timed out after 0.3s" in text
    assert "<result>error: malformed tool call" in text and "<result>7</result>7" in text


def test_tool_call_parsing_formats():
    tools = {"calc": calc}
    (c,) = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>', tools)
    assert (c.name, c.arguments, c.error) == ("calc", {"expression": "2*3"}, "")
    (c,) = parse_tool_calls('x <tool_call>calc("2*3")</tool_call>', tools)
    assert c.arguments == {"expression": "2*3"}
    assert "unknown tool" in parse_tool_calls("<tool_call>f(1)</tool_call>", tools)[0].error
    assert "bad arguments" in parse_tool_calls("<tool_call>calc(1, 2)</tool_call>", tools)[0].error
    assert "unclosed" in parse_tool_calls('<tool_call>calc("1"', tools)[0].error
    assert parse_tool_calls("no call", tools) == []
    assert run_tool(calc, {"expression": "(2+3)*4"}, 1.0) == ("20", True)
    assert run_tool(calc, {"expression": "__import__('os')"}, 1.0)[1] is False


def test_environment_error_fails_the_episode_reward():
    tok = build_tokenizer()

    class Broken(Environment):
        def step(self, action):
            raise ValueError("env bug")

    b = episodes.rollout(ctx_for(tok, scripted(tok, ["a</s>"])), [{"prompt": "q"}], 1, [0], Broken, max_turns=2,
                          max_total_tokens=50, group_ids=torch.tensor([0]), chat_template="none")
    assert b.extra["env_errors"].tolist() == [1] and b.extra["num_turns"].tolist() == [1]
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [None]


def test_an_environment_whose_constructor_raises_fails_its_episode_only():
    """One environment that cannot be made ends its episode (counted), the others run; a configuration mistake
    (a PostrlError) stops the rollout in one line."""
    from postrl.errors import ConfigError

    tok = build_tokenizer()
    made = iter([RuntimeError("no connection"), None])

    def make():
        err = next(made)
        if err is not None:
            raise err
        return Environment()

    b = episodes.rollout(ctx_for(tok, scripted(tok, ["a</s>"])), [{"prompt": "q"}], 2, [0], make, max_turns=1,
                          max_total_tokens=50, group_ids=torch.tensor([0, 0]), chat_template="none")
    assert b.extra["env_errors"].tolist() == [1, 0] and b.extra["num_turns"].tolist() == [0, 1]

    def misconfigured():
        raise ConfigError("environment.x: expected a number, got 'a'")

    with pytest.raises(ConfigError, match="environment.x"):
        episodes.rollout(ctx_for(tok, scripted(tok, ["a</s>"])), [{"prompt": "q"}], 1, [0], misconfigured,
                         max_turns=1, max_total_tokens=50, group_ids=torch.tensor([0]), chat_template="none")


def test_max_total_tokens_cuts_turns_and_observations():
    tok = chat_tokenizer()
    b = episodes.rollout(ctx_for(tok, scripted(tok, ["abcdefgh", "ijklmnop"]), max_new=6), [{"prompt": "q"}], 1,
                          [0], Echo, max_turns=3, max_total_tokens=12, group_ids=torch.tensor([0]))
    # turn 0: 6 tokens (max_new_tokens, truncated); observation '</s><user>ok1</s><assistant>' cut at 12 tokens
    assert int(b.completion_ids.shape[1]) == 12 and b.completion_mask[0].tolist() == [1.0] * 6 + [0.0] * 6
    assert b.extra["turn_truncated"][0].tolist() == [True, False, False]
    assert b.extra["num_turns"].tolist() == [1] and bool(b.truncated[0])


def test_async_environment_and_registry():
    tok = build_tokenizer()

    class AsyncEcho:
        async def reset(self, row):
            return row["prompt"]

        async def step(self, action):
            return "", 2.0, True, {}

    b = episodes.rollout(ctx_for(tok, scripted(tok, ["a</s>"])), [{"prompt": "q"}], 1, [0], AsyncEcho,
                          max_turns=2, max_total_tokens=50, group_ids=torch.tensor([0]), chat_template="none")
    assert b.columns["env_turn_rewards"] == [[2.0]]
    assert isinstance(make("calculator", {"timeout": 1.0}), CalculatorEnv)
    from postrl.errors import ConfigError
    with pytest.raises(ConfigError, match="environment"):
        make("calculator", {"bogus": 1})


def test_turn_metrics_of_an_episode_batch():
    from postrl.diagnostics.metrics import turn_metrics

    tok = build_tokenizer()
    turns = ['<tool_call>calc("2*3")</tool_call>', '<tool_call>calc("x")</tool_call>', "<tool_call>(</tool_call>",
             "6</s>"]
    b = episodes.rollout(ctx_for(tok, scripted(tok, turns)), [{"prompt": "2*3=", "answer": "6"}], 1, [0],
                          CalculatorEnv, max_turns=4, max_total_tokens=400, group_ids=torch.tensor([0]),
                          chat_template="none")
    m = turn_metrics(b.extra, b.completion_mask)
    assert m["turns/per_episode"] == 4 and m["turns/tool_calls"] == 2 and m["turns/tool_success"] == 0.5
    assert m["turns/malformed_calls"] == 1 and m["turns/env_errors"] == 0 and m["turns/truncated_turns"] == 0
    model_tokens = b.completion_mask.sum().item()
    assert m["turns/env_token_fraction"] == pytest.approx(1 - model_tokens / (b.extra["turn_ends"].max().item() + 1))
    assert b.columns["env_turn_rewards"] == [[None, None, None, 1.0]]


def test_tool_schemas_reach_the_chat_template():
    tok = build_tokenizer()
    tok.chat_template = ("{% if tools %}<system>{% for t in tools %}{{ t['function']['name'] }}:"
                         "{{ t['function']['parameters']['required'][0] }};{% endfor %}</s>{% endif %}" + TEMPLATE)
    ids = episodes.prompt_ids(tok, "2*3=", [{"type": "function", "function": {
        "name": "calc", "parameters": {"required": ["expression"]}}}], "auto")
    assert tok.decode(ids) == "<system>calc:expression;</s><user>2*3=</s><assistant>"
    from postrl.environments.tools import schemas
    (s,) = schemas([calc])
    assert s["function"]["name"] == "calc" and s["function"]["parameters"]["required"] == ["expression"]
    assert "expression" in s["function"]["parameters"]["properties"]


def test_code_repair_feedback_each_turn_and_progress_rewards():
    from postrl.environments.code_repair import CodeRepairEnv
    from postrl.rewards.code import code_reshaped, reshaped_score
    from postrl.sandbox import Limits, run

    tok = build_tokenizer()
    buggy, fixed = "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n"
    tests = "assert add(1, 2) == 3\nassert add(0, 0) == 0\n"
    turns = [buggy + "</s>", buggy + "</s>", fixed + "</s>"]
    b = episodes.rollout(ctx_for(tok, scripted(tok, turns)), [{"prompt": "fix: " + buggy, "tests": tests}], 1,
                          [0], lambda: CodeRepairEnv(timeout=10.0), max_turns=4, max_total_tokens=400,
                          group_ids=torch.tensor([0]), chat_template="none")
    w = dict(w_parse=0.05, w_compile=0.05, w_run=0.1, w_tests=0.75, w_lint=0.05)
    assert {k: v for k, v in code_reshaped.__kwdefaults__.items() if k.startswith("w_")} == w
    s0 = reshaped_score(run(buggy, tests, limits=Limits(timeout=10.0)), buggy, **w)
    assert 0 < s0 < 1
    rewards = b.columns["env_turn_rewards"][0]
    assert rewards[0] == pytest.approx(s0) and rewards[1] == 0.0 and rewards[2] == pytest.approx(1.0 - s0)
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [pytest.approx(1.0)]
    assert b.extra["num_turns"].item() == 3 and not bool(b.truncated[0])
    assert "tests: 1/2 passed; " in b.completions[0]
