"""The environment ``verifiers_v1``: verifiers v1 tasksets and envs played by postrl's rollout.

Tested against the installed verifiers package (``verifiers.v1``: Taskset, Task with @vf.reward / @vf.metric /
@vf.stop, Env.run with agents' run and interaction, Trace)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

vf = pytest.importorskip("verifiers.v1")

from postrl.environments import episodes, make  # noqa: E402
from postrl.environments.reward import environment  # noqa: E402
from postrl.errors import ConfigError  # noqa: E402
from test_env_adapters import chat_tokenizer, ctx_for, ids, scripted  # noqa: E402
from test_train import model_dir  # noqa: E402,F401 - the fixture


class QAData(vf.TaskData):
    answer: str = ""


class QATask(vf.Task[QAData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def correct(self, task, trace) -> float:
        return 1.0 if trace.last_reply == task.answer else 0.0

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "quit"


class QAConfig(vf.TasksetConfig):
    n: int = 3


class QATaskset(vf.Taskset[QATask, QAConfig]):
    def load(self):
        for i in range(self.config.n):
            yield QATask(QAData(prompt=f"{i}+1=", system_prompt="Answer.", answer=str(i + 1)), self.config.task)


class GameConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=3)
    target: str = "5"


class GameEnv(vf.Env[GameConfig]):
    """The env answers each move ('higher' / 'lower') until the target; a win records the reward 'won'."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as it:
            seg = await it.turn()
            while not seg.terminated:
                if seg.last_reply == self.config.target:
                    it.trace.record_reward("won", 1.0, 0.5)
                    break
                seg = await it.turn("lower" if seg.last_reply > self.config.target else "higher")

    async def finalize(self, task, episode):
        (trace,) = episode.traces
        trace.record_metric("finalized", 1.0)


def rollout(turns, spec, rows, max_turns=4, group=1):
    tok = chat_tokenizer()
    gen, seen = scripted(tok, turns)
    b = episodes.rollout(ctx_for(tok, gen), rows, group, [0] * len(rows), lambda: make("verifiers_v1", spec),
                         max_turns=max_turns, max_total_tokens=300, group_ids=torch.arange(len(rows)))
    return tok, b, seen


def test_verifiers_v1_taskset_episode():
    """A plain taskset (verifiers' single-agent env): the task at row['vf_index'], its system prompt and prompt as
    the first observation, one reply, scored by the task's rewards (weight 2) and metrics (env_scores)."""
    tok, b, seen = rollout(["2</s>"], {"taskset": f"{__name__}:QATaskset", "args": {"n": 2}},
                           [{"prompt": "shown in logs", "vf_index": 1}])
    first = "Answer.\n\n1+1="
    assert seen["prompts"][0][0] == ids(tok, tok.apply_chat_template([{"role": "user", "content": first}],
                                                                       add_generation_prompt=True, tokenize=False))
    assert b.columns["env_turn_rewards"] == [[2.0]] and b.extra["num_turns"].tolist() == [1]
    assert b.columns["env_scores"] == [{"turns": 1.0, "reward_correct": 1.0}]
    assert not bool(b.truncated[0]) and b.extra["env_errors"].tolist() == [0]


def test_verifiers_v1_task_from_row_fields():
    """Without vf_index the task is built from the row's fields its TaskData declares (prompt, answer)."""
    _, b, _ = rollout(["7</s>"], {"taskset": f"{__name__}:QATaskset"}, [{"prompt": "5+1=", "answer": "6"}])
    assert b.columns["env_turn_rewards"] == [[0.0]]


def test_verifiers_v1_env_multiturn_episode():
    """An Env whose run() answers each move through an interaction: the env's messages are user turns (exact ids),
    the reward sums the env's record_reward (1.0 x 0.5) and the task's (1.0 x 2), finalize's metric is kept."""
    spec = {"taskset": f"{__name__}:QATaskset", "env": f"{__name__}:GameEnv"}
    tok, b, _ = rollout(["9</s>", "3</s>", "5</s>"], spec, [{"prompt": "guess", "answer": "5"}])
    t1, t2, t3 = ids(tok, "9</s>"), ids(tok, "3</s>"), ids(tok, "5</s>")
    o1, o2 = ids(tok, "<user>lower</s><assistant>"), ids(tok, "<user>higher</s><assistant>")
    seq = t1 + o1 + t2 + o2 + t3
    assert b.completion_ids[0, :len(seq)].tolist() == seq
    assert b.completion_mask[0, :len(seq)].tolist() == ([1.0] * len(t1) + [0.0] * len(o1) + [1.0] * len(t2)
                                                        + [0.0] * len(o2) + [1.0] * len(t3))
    assert b.columns["env_turn_rewards"] == [[None, None, 2.5]]
    assert b.columns["env_scores"][0] == {"turns": 3.0, "finalized": 1.0, "reward_won": 1.0, "reward_correct": 1.0}
    assert b.extra["failure_cause"] == [None] and not bool(b.truncated[0])


def test_verifiers_v1_limits_and_cut_episodes():
    """verifiers' own limits (the seat's max_turns, a @stop on the trace) end the exchange, scored, cause
    env_truncated for a limit; an episode postrl cuts first is cancelled unscored (no reward, truncated) and its
    thread ends."""
    spec = {"taskset": f"{__name__}:QATaskset", "env": f"{__name__}:GameEnv"}
    _, b, _ = rollout(["9</s>", "9</s>", "9</s>"], spec, [{"prompt": "guess", "answer": "5"}], max_turns=5)
    assert b.columns["env_turn_rewards"] == [[None, None, 0.0]]  # max_turns 3 of the seat; no answer, no win
    assert b.extra["failure_cause"] == ["env_truncated"] and not bool(b.truncated[0])
    _, b, _ = rollout(["9</s>", "quit</s>"], spec, [{"prompt": "guess", "answer": "5"}])
    assert b.columns["env_turn_rewards"] == [[None, 0.0]] and b.extra["failure_cause"] == [None]  # @stop gave_up
    before = threading.active_count()
    _, b, _ = rollout(["9</s>", "9</s>"], spec, [{"prompt": "guess", "answer": "5"}], max_turns=2)
    assert b.columns["env_turn_rewards"] == [[None, None]] and bool(b.truncated[0])
    assert environment([], [], b.columns["env_turn_rewards"]) == [0.0]
    assert threading.active_count() <= before
    assert not any(t.name == "postrl-verifiers-episode" for t in threading.enumerate())


class BadTask(QATask):
    @vf.reward
    async def broken(self, trace) -> float:
        raise ValueError("scoring broke")


class BadTaskset(vf.Taskset[BadTask, QAConfig]):
    def load(self):
        yield BadTask(QAData(prompt="p", answer="a"), self.config.task)


class BrokenEnv(GameEnv):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as it:
            await it.turn()
            raise RuntimeError("env broke")


def test_verifiers_v1_fault_isolation():
    """A scoring function or an env that raises ends its episode: env_errors, a NaN reward (the reward source
    fails it); the other episode of the group goes on."""
    _, b, _ = rollout(["a</s>"], {"taskset": f"{__name__}:BadTaskset"}, [{"prompt": "p", "vf_index": 0}])
    assert b.extra["env_errors"].tolist() == [1] and math.isnan(b.columns["env_turn_rewards"][0][0])
    assert environment([], [], b.columns["env_turn_rewards"]) == [None]
    spec = {"taskset": f"{__name__}:QATaskset", "env": f"{__name__}:BrokenEnv"}
    _, b, _ = rollout(["5</s>"], spec, [{"prompt": "guess", "answer": "5"}])
    assert b.extra["env_errors"].tolist() == [1] and b.extra["failure_cause"] == ["env_error"]


class TwoSeatConfig(vf.EnvConfig):
    assistant: vf.AgentConfig = vf.AgentConfig()
    user: vf.AgentConfig = vf.AgentConfig()


class TwoSeatEnv(vf.Env[TwoSeatConfig]):
    async def run(self, task, agents):
        await agents.assistant.run(task)


def test_verifiers_v1_config_errors():
    with pytest.raises(ConfigError, match="declares the seats assistant, user"):
        make("verifiers_v1", {"taskset": f"{__name__}:QATaskset", "env": f"{__name__}:TwoSeatEnv"})
    with pytest.raises(ConfigError, match=r"^environment.args: "):
        make("verifiers_v1", {"taskset": f"{__name__}:QATaskset", "args": {"n": "many"}})
    with pytest.raises(ConfigError, match="not a verifiers v1 Env class"):
        make("verifiers_v1", {"taskset": f"{__name__}:QATaskset", "env": f"{__name__}:QATaskset"})
    with pytest.raises(ConfigError, match="neither a verifiers v1 Taskset"):
        make("verifiers_v1", {"taskset": f"{__name__}:QATask"})
    with pytest.raises(ConfigError, match="environment.seat: expected player, got 'p2'"):
        make("verifiers_v1", {"taskset": f"{__name__}:QATaskset", "env": f"{__name__}:GameEnv", "seat": "p2"})
    with pytest.raises(ConfigError, match="env_args: only with environment.env"):
        make("verifiers_v1", {"taskset": f"{__name__}:QATaskset", "env_args": {"target": "1"}})


class EffortTask(QATask):
    @vf.reward(weight=0.5)
    async def replied(self, trace) -> float:
        return 1.0


class EffortTaskset(vf.Taskset[EffortTask, QAConfig]):
    def load(self):
        return []


def test_verifiers_v1_named_in_the_config_train(model_dir, tmp_path):  # noqa: F811
    """The adapter through the trainer, named in the config: the calculator rows' prompt and answer make the tasks;
    an untrained model never answers right: reward 0.5 (replied, weight 0.5) + 0 (correct) on every episode."""
    from test_train import metrics, run_inprocess

    run_inprocess([f"model.path={model_dir}", "task.name=calculator", "task.digits=2",
                   "rewards=[{name: environment}]", "rollout.max_new_tokens=6", "rollout.group_size=2",
                   "train.prompts_per_step=2", "train.steps=1", "train.eval_size=2", "train.eval_k=1",
                   f"output_dir={tmp_path}",
                   "environment={name: verifiers_v1, taskset: %s:EffortTaskset, args: {n: 0}, max_turns: 2, "
                   "max_total_tokens: 20}" % __name__])
    row = metrics(tmp_path)[0]
    assert row["reward/environment/mean"] == 0.5 and row["turns/per_episode"] == 1.0


class BoxTask(QATask):
    @vf.reward
    async def files_ok(self, trace, runtime) -> float:
        return 1.0


class BoxTaskset(vf.Taskset[BoxTask, QAConfig]):
    def load(self):
        return []


def test_verifiers_v1_refuses_runtime_scoring():
    with pytest.raises(ConfigError, match="scores with files_ok, which need a runtime"):
        make("verifiers_v1", {"taskset": f"{__name__}:BoxTaskset"})
