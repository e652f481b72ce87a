"""Adapters: a TRL environment_factory class and a verifiers MultiTurnEnv run through postrl's multi-turn rollout."""

from __future__ import annotations

import pytest
import torch

from postrl.environments import make
from postrl.environments.adapters import TRLEnvironment, VerifiersEnvironment
from postrl.errors import ConfigError
from postrl.models.tiny import build_tokenizer
from postrl.environments import episodes
from postrl.generation import Generation, SamplingParams
from postrl.context import ModelContext
from test_train import model_dir  # noqa: F401 - the fixture

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def scripted(tok, turns):
    """A backend that samples ``turns[k]`` on turn k, cut after a stop string (as HFGenerator)."""
    state = {"k": 0, "prompts": []}

    def generate(prompts, n, params, seeds):
        text = turns[state["k"]]
        state["k"] += 1
        state["prompts"].append([list(p) for p in prompts])
        for s in params.stop:
            if s in text:
                text = text[:text.index(s) + len(s)]
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        t = torch.tensor([ids] * len(prompts))
        return Generation(torch.zeros(len(prompts), 1, dtype=torch.long), torch.ones(len(prompts), 1,
                          dtype=torch.long), t, torch.ones(t.shape), torch.full(t.shape, -0.5),
                          torch.tensor([False] * len(prompts)), [text] * len(prompts))

    return generate, state


def ctx_for(tok, generate):
    return ModelContext(None, tok, sampling=SamplingParams(max_new_tokens=40), generate=generate,
                        pad_id=tok.pad_token_id)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class GuessEnv:
    """A TRL environment_factory class: reset(**row) -> text appended to the prompt, a tool method, get_reward."""

    def reset(self, **kwargs):
        self.answer, self.found = kwargs["answer"], False
        return " guess"

    def guess(self, word: str) -> str:
        """Check a guess.

        Args:
            word: the guessed word
        """
        self.found = word == self.answer
        return "yes" if self.found else "no"

    async def get_reward(self) -> float:
        return 1.0 if self.found else 0.25

    def _helper(self):
        return "not a tool"


class NoReset:
    def guess(self, word: str) -> str:
        """Check.

        Args:
            word: w
        """
        return word


@pytest.mark.parametrize("word,reward", [("cat", 1.0), ("dog", 0.25)])
def test_trl_environment_factory_episode(word, reward):
    tok = chat_tokenizer()
    gen, seen = scripted(tok, [f'<tool_call>guess("{word}")</tool_call> tail', "ok</s>"])
    factory = f"{__name__}:GuessEnv"
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "w?", "answer": "cat"}], 1, [0],
                          lambda: make("trl", {"factory": factory, "timeout": 2.0}), max_turns=3,
                          max_total_tokens=200, group_ids=torch.tensor([0]))
    env = make("trl", {"factory": factory})
    assert [t.__name__ for t in env.tools] == ["guess"]  # reset, get_reward and _helper are not tools
    # the prompt: the template's user turn with reset's text appended, the tool's schema rendered
    from postrl.environments.tools import schemas
    want_prompt = tok.apply_chat_template([{"role": "user", "content": "w? guess"}], tools=schemas(env.tools),
                                          add_generation_prompt=True, tokenize=False)
    assert seen["prompts"][0][0] == ids(tok, want_prompt)
    call_ids = ids(tok, f'<tool_call>guess("{word}")</tool_call>')
    obs_ids = ids(tok, f"</s><tool><result>{'yes' if word == 'cat' else 'no'}</result></s><assistant>")
    ans = ids(tok, "ok</s>")
    L = len(call_ids) + len(obs_ids) + len(ans)
    assert b.completion_ids[0, :L].tolist() == call_ids + obs_ids + ans
    assert b.completion_mask[0, :L].tolist() == [1.0] * len(call_ids) + [0.0] * len(obs_ids) + [1.0] * len(ans)
    assert b.extra["turn_ends"][0].tolist() == [len(call_ids) - 1, L - 1, -1]
    assert b.extra["tool_calls"].tolist() == [1] and b.extra["tool_errors"].tolist() == [0]
    assert b.columns["env_turn_rewards"] == [[None, reward]] and not bool(b.truncated[0])


class AsyncToolEnv:
    def reset(self, **kwargs):
        return None

    async def double(self, x: int) -> int:
        """Double a number.

        Args:
            x: the number
        """
        return 2 * x


def test_trl_async_tool_is_awaited_and_reset_none_keeps_the_prompt():
    env = make("trl", {"factory": f"{__name__}:AsyncToolEnv"})
    assert env.reset({"prompt": "p"}) == "p"
    obs, reward, done, info = env.step('<tool_call>double(21)</tool_call>')
    assert obs == "<result>42</result>" and reward is None and not done and info["tool_calls"] == 1
    assert env.step("done") == ("", None, True, {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0})


def test_trl_adapter_errors():
    with pytest.raises(ConfigError, match="environment.factory"):
        make("trl", {"factory": "GuessEnv"})
    with pytest.raises(ConfigError, match="reset"):
        make("trl", {"factory": f"{__name__}:NoReset"})
    with pytest.raises(ConfigError, match="no_such_module"):
        make("trl", {"factory": "no_such_module:X"})
    with pytest.raises(ConfigError, match="environment"):
        make("trl", {"factory": f"{__name__}:GuessEnv", "bogus": 1})
    # parameters are checked from their annotations before the factory is imported
    with pytest.raises(ConfigError, match=r"^environment.timeout: expected a value > 0, got 0$"):
        make("trl", {"factory": "no_such_module:X", "timeout": 0})
    with pytest.raises(ConfigError, match=r"^environment.args: expected a mapping, got list$"):
        make("verifiers", {"env": "no_such_module:X", "args": [1]})
    with pytest.raises(ConfigError, match=r"^environment.memory_mb: expected a value >= 1, got 0$"):
        make("code_repair", {"memory_mb": 0})
    from postrl.data import load_source

    with pytest.raises(ConfigError, match=r"^task.min_digits: expected a value <= digits \(3\), got 4$"):
        load_source({"name": "calculator", "min_digits": 4})  # the calculator's own default digits, 3
    with pytest.raises(ConfigError, match=r"^task.direct: expected a value >= 0 and <= 1, got 2$"):
        load_source({"name": "calculator", "direct": 2})


class HintRubric:
    def __init__(self):
        self.calls = []

    def correct(self, completion, answer) -> float:
        return 1.0 if answer in completion[-1]["content"] else 0.0

    async def turns(self, **kwargs) -> float:
        self.calls.append(sorted(kwargs))
        return float(kwargs["state"]["turn"])

    def get_reward_funcs(self):
        return [self.correct, self.turns]

    def get_reward_weights(self):
        return [1.0, 0.5]


class HintEnv:
    """A verifiers MultiTurnEnv: a hint after each wrong turn, done when the answer appears."""

    def __init__(self, hint="try again", new_style=False, max_turns=10):
        self.hint, self.new_style, self.max_turns = hint, new_style, max_turns
        self.rubric = HintRubric()

    def is_completed(self, messages, state, **kwargs):
        return state["answer"] in messages[-1]["content"]

    async def env_response(self, messages, state, **kwargs):
        state["hints"] = state.get("hints", 0) + 1
        msg = {"role": "user", "content": f"{self.hint} {state['hints']}"}
        return msg["content"] if self.new_style else ([msg], state)


@pytest.mark.parametrize("new_style", [False, True])
def test_verifiers_multiturn_env_episode(new_style):
    tok = chat_tokenizer()
    gen, seen = scripted(tok, ["12</s>", "7</s>", "42</s>"])
    spec = {"env": f"{__name__}:HintEnv", "args": {"hint": "no", "new_style": new_style}}
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "6*7=", "answer": "42"}], 1, [0],
                          lambda: make("verifiers", spec), max_turns=4, max_total_tokens=300,
                          group_ids=torch.tensor([0]))
    t1, t2, t3 = ids(tok, "12</s>"), ids(tok, "7</s>"), ids(tok, "42</s>")
    # the model's turn ended with EOS = the template's end-of-turn: not repeated
    o1, o2 = ids(tok, "<user>no 1</s><assistant>"), ids(tok, "<user>no 2</s><assistant>")
    seq = t1 + o1 + t2 + o2 + t3
    L = len(seq)
    assert b.completion_ids[0, :L].tolist() == seq
    assert b.completion_mask[0, :L].tolist() == ([1.0] * len(t1) + [0.0] * len(o1) + [1.0] * len(t2)
                                                 + [0.0] * len(o2) + [1.0] * len(t3))
    assert b.extra["num_turns"].tolist() == [3] and not bool(b.truncated[0])
    # rubric: correct (1.0, weight 1) + turns (3, weight 0.5) on the last turn only
    assert b.columns["env_turn_rewards"] == [[None, None, 2.5]]
    env = make("verifiers", spec)
    assert env.vf.rubric.calls[-1] == ["answer", "completion", "info", "parser", "prompt", "state", "task"]
    assert seen["prompts"][0][0] == ids(tok, tok.apply_chat_template([{"role": "user", "content": "6*7="}],
                                                                       add_generation_prompt=True, tokenize=False))


def test_verifiers_max_turns_ends_and_scores():
    tok = chat_tokenizer()
    gen, _ = scripted(tok, ["1</s>", "2</s>", "3</s>"])
    spec = {"env": f"{__name__}:HintEnv", "args": {"max_turns": 2}}
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "6*7=", "answer": "42"}], 1, [0],
                          lambda: make("verifiers", spec), max_turns=4, max_total_tokens=300,
                          group_ids=torch.tensor([0]))
    assert b.extra["num_turns"].tolist() == [2]
    assert b.columns["env_turn_rewards"] == [[None, 0.0 + 0.5 * 2]]
    with pytest.raises(ConfigError, match="environment.args"):
        make("verifiers", {"env": f"{__name__}:HintEnv", "args": {"nope": 1}})
    with pytest.raises(ConfigError, match="environment.env"):
        make("verifiers", {"env": "HintEnv"})
    assert isinstance(make("verifiers", spec), VerifiersEnvironment)
    assert isinstance(make("trl", {"factory": f"{__name__}:GuessEnv"}), TRLEnvironment)


def test_adapters_named_in_the_config_train(model_dir, tmp_path):
    """Both adapters through the trainer, named in the config with their import path parameter."""
    from test_train import metrics, run_inprocess

    common = [f"model.path={model_dir}", "task.name=calculator", "task.digits=2", "rewards=[{name: environment}]",
              "advantage={name: turn_mapo}", "rollout.max_new_tokens=6", "rollout.group_size=2",
              "train.prompts_per_step=2", "train.steps=1", "train.eval_size=2", "train.eval_k=1"]
    run_inprocess(common + [f"output_dir={tmp_path / 'trl'}",
                            "environment={name: trl, factory: %s:GuessEnv, max_turns: 2, max_total_tokens: 20}"
                            % __name__])
    # GuessEnv: no correct guess from an untrained model: get_reward 0.25 on an answer turn, 0 for a cut episode
    row = metrics(tmp_path / "trl")[0]
    assert row["reward/environment/mean"] == pytest.approx(0.25 * (1 - row["truncated/frac"]))
    run_inprocess(common + [f"output_dir={tmp_path / 'vf'}",
                            "environment={name: verifiers, env: %s:HintEnv, args: {max_turns: 2}, max_turns: 3, "
                            "max_total_tokens: 30}" % __name__])
    row = metrics(tmp_path / "vf")[0]
    # HintEnv's max_turns 2 ends every episode on turn 2 (the answer never appears): reward 0 + 0.5 * 2
    assert row["turns/per_episode"] == 2.0 and row["reward/environment/mean"] == 1.0


class DictEnv:
    """OpenEnv's shape without the package: reset / step return observations with done, reward, metadata."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        return {"board": "___", "done": False, "reward": None, "metadata": {}}

    def step(self, action):
        return {"board": action["move"], "done": action["move"] == "XXX", "reward": 0.5, "metadata": {}}


def as_move(text):
    return {"move": text}


def test_openenv_adapter_duck_typed_without_the_package():
    """The openenv adapter's text mode reads any object of OpenEnv's shape (here dicts), with or without openenv."""
    env = make("openenv", {"env": f"{__name__}:DictEnv", "action": f"{__name__}:as_move"})
    assert env.reset({"prompt": "Play."}) == "Play.\n\n___"
    assert env.step("X__") == ("X__", 0.5, False, {})
    assert env.step("XXX") == ("", 0.5, True, {})
