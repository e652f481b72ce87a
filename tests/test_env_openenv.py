"""The environment ``openenv``: OpenEnv environments (in-process, over HTTP, MCP tools) through postrl's rollout.

Tested against the installed openenv package (its Environment / Action / Observation / MCPEnvironment / server /
GenericEnvClient classes)."""

from __future__ import annotations

import math
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("openenv.core.env_server.mcp_environment")

from fastmcp import FastMCP  # noqa: E402
from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402
from openenv.core.env_server.mcp_types import CallToolAction  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

from postrl.environments import episodes, make  # noqa: E402
from postrl.environments.openenv_env import OpenEnvEnvironment  # noqa: E402
from postrl.environments.tools import schemas  # noqa: E402
from postrl.errors import ConfigError  # noqa: E402
from test_env_adapters import chat_tokenizer, ctx_for, ids, scripted  # noqa: E402
from test_train import model_dir  # noqa: E402,F401 - the fixture

CLOSED: list[str] = []


class GuessAction(Action):
    guess: str = Field(..., description="the guessed number")


class TwoFields(Action):
    a: str
    b: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    """Guess the secret: feedback 'higher' / 'lower' (reward 0.0), done with reward 1.0 when right; a guess of
    'boom' raises, 'stop' ends by the environment's own limit (metadata truncated)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, secret: int = 42):
        super().__init__()
        self.secret, self._state = secret, State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(step_count=0)
        return GuessObservation(feedback=f"guess a number (seed {seed}, level {kwargs.get('level')})")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        text = action.guess.strip()
        if text == "boom":
            raise RuntimeError("the environment broke")
        if text == "stop":
            return GuessObservation(feedback="out of time", done=False, reward=None, metadata={"truncated": True})
        n = int(text)
        if n == self.secret:
            return GuessObservation(feedback="right", done=True, reward=True)
        return GuessObservation(feedback="higher" if n < self.secret else "lower", reward=0.0)

    @property
    def state(self):
        return self._state

    def close(self):
        CLOSED.append("guess")


def test_openenv_text_episode():
    """reset with the row's seed / reset keys, the model's text as the action's field, feedback as user turns,
    rewards and done from the observations (a True reward counts 1.0), the environment closed after the rollout."""
    tok = chat_tokenizer()
    gen, seen = scripted(tok, ["7</s>", "42</s>"])
    spec = {"env": f"{__name__}:GuessEnvironment", "action": f"{__name__}:GuessAction", "seed_key": "seed",
            "reset_keys": ["level"]}
    CLOSED.clear()
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "Guess.", "seed": 3, "level": 2}], 1, [0],
                          lambda: make("openenv", spec), max_turns=4, max_total_tokens=300,
                          group_ids=torch.tensor([0]))
    first = "Guess.\n\nguess a number (seed 3, level 2)"
    assert seen["prompts"][0][0] == ids(tok, tok.apply_chat_template([{"role": "user", "content": first}],
                                                                       add_generation_prompt=True, tokenize=False))
    t1, o1, t2 = ids(tok, "7</s>"), ids(tok, "<user>higher</s><assistant>"), ids(tok, "42</s>")
    L = len(t1) + len(o1) + len(t2)
    assert b.completion_ids[0, :L].tolist() == t1 + o1 + t2
    assert b.completion_mask[0, :L].tolist() == [1.0] * len(t1) + [0.0] * len(o1) + [1.0] * len(t2)
    assert b.columns["env_turn_rewards"] == [[0.0, 1.0]]
    assert b.extra["num_turns"].tolist() == [2] and not bool(b.truncated[0]) and b.extra["env_errors"].tolist() == [0]
    assert CLOSED == ["guess"]


def test_openenv_reward_done_truncation_mapping():
    env = make("openenv", {"env": f"{__name__}:GuessEnvironment", "action": f"{__name__}:GuessAction",
                           "prompt": "observation"})
    assert env.reset({"prompt": "ignored"}) == "guess a number (seed None, level None)"
    assert env.step("50") == ("lower", 0.0, False, {})
    # the environment's own limit (metadata truncated) ends the episode, with its cause
    assert env.step("stop") == ("", None, True, {"failure_cause": "env_truncated"})
    env = make("openenv", {"env": f"{__name__}:GuessEnvironment", "action": f"{__name__}:GuessAction",
                           "prompt": "row"})
    assert env.reset({"prompt": "only the row"}) == "only the row"
    assert env.step("42") == ("", 1.0, True, {})

    class Client:  # an EnvClient's shape: StepResult(observation, reward, done, metadata)
        def reset(self, **kw):
            return StepResult(observation={"text": "hi", "done": False}, reward=None, done=False)

        def step(self, action):
            return StepResult(observation={"text": "bye", "n": 1}, reward=0.5, done=True, metadata={})

    from postrl.environments import openenv_env

    obs, reward, done, _ = openenv_env.step_result(Client().step(None))
    assert (openenv_env.observation_text(obs), reward, done) == ('{"text": "bye", "n": 1}', 0.5, True)
    assert openenv_env.observation_text(Client().reset().observation) == "hi"
    assert openenv_env.observation_text(GuessObservation(feedback="f"), "feedback") == "f"


class ScoredCalc(MCPEnvironment):
    """An MCP environment: tools add and submit; submit ends the episode with reward 1.0 when the answer is 5."""

    def __init__(self):
        mcp = FastMCP("calc")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return "submitted"

        super().__init__(mcp)

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Observation(done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        obs = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            obs.done, obs.reward = True, 1.0 if action.arguments.get("answer") == 5 else 0.0
        return obs

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=False)

    @property
    def state(self):
        return State()


def test_openenv_mcp_tools_episode():
    """Tools mode: the MCP tools' schemas rendered in the prompt, a <tool_call> sent as CallToolAction, the result
    as a tool turn, the submitting call's reward and done; a malformed call counted and not sent."""
    tok = chat_tokenizer()
    call1, call2 = "<tool_call>mul(1)</tool_call>", "<tool_call>add(2, 3)</tool_call>"
    gen, seen = scripted(tok, [call1, call2, "<tool_call>submit(answer=5)</tool_call>"])
    spec = {"env": f"{__name__}:ScoredCalc"}
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "2+3?"}], 1, [0], lambda: make("openenv", spec),
                          max_turns=4, max_total_tokens=400, group_ids=torch.tensor([0]))
    env = make("openenv", spec)
    assert [t.__name__ for t in env.tools] == ["add", "submit"]
    assert schemas(env.tools)[0]["function"]["parameters"]["required"] == ["a", "b"]
    want = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=schemas(env.tools),
                                   add_generation_prompt=True, tokenize=False)
    assert seen["prompts"][0][0] == ids(tok, want)
    t1, t2 = ids(tok, call1), ids(tok, call2)
    o1 = ids(tok, "</s><tool><result>error: unknown tool 'mul'; tools: add, submit</result></s><assistant>")
    o2 = ids(tok, "</s><tool><result>5</result></s><assistant>")
    L = len(t1) + len(o1) + len(t2) + len(o2)
    assert b.completion_ids[0, :L].tolist() == t1 + o1 + t2 + o2
    assert b.completion_mask[0, :L].tolist() == ([1.0] * len(t1) + [0.0] * len(o1) + [1.0] * len(t2)
                                                 + [0.0] * len(o2))
    assert b.extra["tool_calls"].tolist() == [2] and b.extra["malformed_calls"].tolist() == [1]
    assert b.extra["turn_tool_calls"][0].tolist() == [0, 1, 1, 0]
    assert b.columns["env_turn_rewards"] == [[None, None, 1.0]] and not bool(b.truncated[0])
    # a turn without a tool call ends the episode without a reward; a tool error is counted
    env.reset({"prompt": "p"})
    assert env.step("no call") == ("", None, True, {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0})


def test_openenv_client_over_http():
    """A real OpenEnv server (uvicorn on loopback) reached with OpenEnv's GenericEnvClient: the same episode."""
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        tok = chat_tokenizer()
        gen, _ = scripted(tok, ["7</s>", "42</s>"])
        spec = {"env": "openenv.core.generic_client:GenericEnvClient", "args": {"base_url": url},
                "action": f"{__name__}:as_dict", "seed_key": "seed"}
        b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "Guess.", "seed": 1}], 1, [0],
                              lambda: make("openenv", spec), max_turns=4, max_total_tokens=300,
                              group_ids=torch.tensor([0]))
        assert b.columns["env_turn_rewards"] == [[0.0, 1.0]] and b.extra["env_errors"].tolist() == [0]
        assert b.extra["turn_observations"] == [["higher", ""]]
    finally:
        server.should_exit = True


def as_dict(text: str) -> dict:
    """The action GenericEnvClient sends: a plain dict."""
    return {"guess": text}


class BrokenInit(GuessEnvironment):
    def __init__(self):
        raise RuntimeError("cannot start")


def test_openenv_fault_isolation():
    """A foreign environment that raises (in step or in its constructor) ends its episode, counted; the other
    episodes go on; the reward source environment fails that episode (NaN, excluded)."""
    tok = chat_tokenizer()
    gen, _ = scripted(tok, ["boom</s>", "boom</s>"])
    spec = {"env": f"{__name__}:GuessEnvironment", "action": f"{__name__}:GuessAction"}
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "p"}], 1, [0], lambda: make("openenv", spec), max_turns=2,
                          max_total_tokens=100, group_ids=torch.tensor([0]))
    assert b.extra["env_errors"].tolist() == [1] and math.isnan(b.columns["env_turn_rewards"][0][0])
    from postrl.environments.reward import environment

    assert environment([], [], b.columns["env_turn_rewards"]) == [None]
    gen, _ = scripted(tok, ["1</s>"])
    b = episodes.rollout(ctx_for(tok, gen), [{"prompt": "p"}], 1, [0],
                          lambda: make("openenv", {"env": f"{__name__}:BrokenInit", "action": f"{__name__}:GuessAction"}),
                          max_turns=2, max_total_tokens=100, group_ids=torch.tensor([0]))
    assert b.extra["env_errors"].tolist() == [1] and b.extra["failure_cause"] == ["env_error"]


def test_openenv_config_errors():
    with pytest.raises(ConfigError, match="action_field: TwoFields has 2 required fields"):
        make("openenv", {"env": f"{__name__}:GuessEnvironment", "action": f"{__name__}:TwoFields"})
    with pytest.raises(ConfigError, match="action_field: GuessAction has no field 'text'"):
        make("openenv", {"env": f"{__name__}:GuessEnvironment", "action": f"{__name__}:GuessAction",
                         "action_field": "text"})
    with pytest.raises(ConfigError, match="action_field: only with environment.action"):
        make("openenv", {"env": f"{__name__}:GuessEnvironment", "action_field": "guess"})
    with pytest.raises(ConfigError, match="environment.env"):
        make("openenv", {"env": "GuessEnvironment"})
    with pytest.raises(ConfigError, match=r"^environment.prompt"):
        make("openenv", {"env": f"{__name__}:GuessEnvironment", "prompt": "both_ways"})
    assert isinstance(make("openenv", {"env": f"{__name__}:ScoredCalc"}), OpenEnvEnvironment)


class EchoEnvironment(Environment):
    """Echoes the message, done after one step: reward 0.25 when reset was given the row's answer, else 0."""

    def reset(self, seed=None, episode_id=None, answer=None, **kwargs):
        self.answer = answer
        return GuessObservation(feedback="say something")

    def step(self, action, timeout_s=None, **kwargs):
        return GuessObservation(feedback=action.guess, done=True, reward=0.25 if self.answer is not None else 0.0)

    @property
    def state(self):
        return State()


def test_openenv_named_in_the_config_train(model_dir, tmp_path):  # noqa: F811
    """The adapter through the trainer, named in the config (reset_keys hands the calculator row's answer to
    reset): the reward source environment reads the echo's reward, 0.25 on every episode."""
    from test_train import metrics, run_inprocess

    run_inprocess([f"model.path={model_dir}", "task.name=calculator", "task.digits=2",
                   "rewards=[{name: environment}]", "rollout.max_new_tokens=6", "rollout.group_size=2",
                   "train.prompts_per_step=2", "train.steps=1", "train.eval_size=2", "train.eval_k=1",
                   f"output_dir={tmp_path}",
                   "environment={name: openenv, env: %s:EchoEnvironment, action: %s:GuessAction, "
                   "reset_keys: [answer], max_turns: 2, max_total_tokens: 20}" % (__name__, __name__)])
    row = metrics(tmp_path)[0]
    assert row["reward/environment/mean"] == 0.25 and row["turns/per_episode"] == 1.0
