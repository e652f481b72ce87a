"""The environment ``verifiers_v1``: a verifiers v1 taskset (and optionally its ``Env``) run in postrl's rollout.

verifiers v1 (``import verifiers.v1 as vf``; the ``verifiers`` extra, tested against verifiers 0.4.0) splits an
environment into a **taskset** (``vf.Taskset``: ``load()`` yields ``vf.Task`` objects, each a ``TaskData`` with the
prompt and the task's ``@vf.reward`` / ``@vf.metric`` / ``@vf.stop`` methods) and a **harness** (the program that
plays the task: it calls a model and tools until it stops), joined by an ``vf.Env`` whose ``run(task, agents)``
drives the episode (``agents.<seat>.run(task)``, or ``async with agents.<seat>.interaction(task) as it`` then
``await it.turn(message)`` per exchange, e.g. a game engine answering each move) and whose ``finalize(task,
episode)`` may add rewards. In postrl the policy *is* the harness: the adapter plays the env's seat with postrl's
token-in/token-out rollout and leaves the rest to verifiers' own code. Config:

    environment: {name: verifiers_v1, taskset: my_pkg:MyTaskset, args: {...}}                  # single-agent
    environment: {name: verifiers_v1, taskset: my_pkg:GameTaskset, env: my_pkg:GameEnv, env_args: {...}}

The mapping:

* ``reset(row)``: the task is the taskset's task at position ``row[index_key]`` (``vf_index``) when the row has
  that key, else a task of the taskset's task type built from the row's fields that its ``TaskData`` declares
  (``prompt``, ``answer``, ...), with the taskset's task config. The episode (``env.setup``, ``env.run``,
  ``env.finalize``; without ``env`` a single ``run`` of the seat, verifiers' ``SingleAgentEnv``) starts in a thread
  of its own with its own event loop; the first observation is the first message the seat is asked to answer:
  a prompted task's ``system_prompt``, a blank line and its prompt (verifiers' own fallback for harnesses that take
  no system message), or for a prompt-less task the message the env opens with.
* each model turn is the seat's reply (an assistant message on the seat's ``vf.Trace``); the episode goes on until
  the env asks the seat again (its message is the next observation, role ``user``, no reward) or ends: then the
  task scores the trace (``task.score``: the ``@vf.reward`` functions with their weights, the ``@vf.metric``
  functions), the env's ``finalize`` runs, and the step returns ``done`` with the reward ``trace.reward`` =
  sum_r score_r * weight_r over everything recorded on the seat's trace (the task's rewards, ``record_reward`` calls
  in ``env.run`` / ``finalize``). The trace's metrics and each reward's score go to ``info['scores']``
  (``env/<name>`` in ``postrl eval``; rewards as ``reward_<name>``).
* verifiers' own limits end the exchange as in verifiers (a terminated segment): the seat's ``max_turns``
  (``AgentConfig.max_turns``) and the task's ``@vf.stop`` checks that take the ``Trace``; such an episode is scored
  and ends with ``info['failure_cause'] = 'env_truncated'`` when the stop is a limit (``trace.is_truncated``). An
  episode postrl cuts first (``max_turns``, ``max_total_tokens``) is cancelled, unscored: no reward (0 in the
  reward source ``environment``).

Fault isolation: a taskset, task, env or scoring function that raises, or an episode that does not answer within
``timeout`` seconds, ends its episode (``env_errors``, reward NaN). Limits (refused with a one-line error when the
environment is made, except where said; a row's task that needs one of them ends its episode): tool servers (``Task.toolsets`` / ``Taskset.toolsets``: MCP servers that
a harness wires in), a second seat played by another model (e.g. verifiers' ``user-sim`` env; postrl plays one seat,
``seat``), scoring functions that need a runtime (a sandbox box) and judges (they call their own model), ``@vf.stop``
checks on a ``Request`` / ``Response`` (not run); ``interaction.steer`` / ``send`` (raise inside the episode).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import queue
import threading
from typing import Annotated, Any

from annotated_types import Gt

from postrl.environments import Environment
from postrl.environments.adapters import resolve
from postrl.errors import ConfigError, PostrlError
from postrl.registry import register

_TASKS: dict[tuple, list] = {}  # (taskset path, args) -> the tasks read so far, in order


class Cancelled(BaseException):
    """Raised inside a verifiers episode that postrl ended (cut) before the env did."""


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("environment verifiers_v1: the verifiers package (>= 0.4, 'pip install postrl[verifiers]') "
                          "is not installed") from None
    return vf


def load_taskset(path: str, args: dict) -> Any:
    """The taskset at import path ``path`` (a ``vf.Taskset`` class, given its config built from ``args``, or a
    function returning a taskset, given ``args`` as keywords)."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    obj = resolve(path, "taskset")
    try:
        if isinstance(obj, type) and issubclass(obj, vf.Taskset):
            config_cls = concrete_type(obj, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            return obj(config_cls.model_validate(args))
        if callable(obj) and not isinstance(obj, type):
            out = obj(**args)
            if isinstance(out, vf.Taskset):
                return out
    except (TypeError, ValueError) as e:
        raise ConfigError(f"environment.args: {path}: {str(e).splitlines()[0]}") from None
    raise ConfigError(f"environment.taskset: '{path}' is neither a verifiers v1 Taskset class nor a function "
                      f"returning a Taskset")


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


class _Seat:
    """The env's seat that postrl's policy plays (what ``agents.<seat>`` returns to the env's code)."""

    def __init__(self, name: str, spec: Any, episode: "_Episode"):
        self.name, self.spec, self.episode = name, spec, episode
        self.trainable = True

    async def run(self, task: Any, **_: Any) -> Any:
        """One segment on a prompted task: the model's reply, then scoring (verifiers' tool-less ``run``)."""
        async with self.interaction(task) as it:
            segment = await it.turn()
            if not segment.terminated:
                it.trace.stop("agent_completed")
        return it.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        it = _Interaction(self, task)
        yield it
        await it.close()


class _Interaction:
    """verifiers' ``Interaction`` with postrl's rollout as the harness: ``turn(message)`` asks postrl's policy."""

    def __init__(self, seat: _Seat, task: Any):
        vf = _vf()
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask

        self.vf, self.seat, self.task = vf, seat, task
        self.trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                              state=state_cls(type(task))(),
                              agent=AgentInfo(config=seat.spec, name=seat.name, trainable=seat.trainable))
        self.stops = [fn for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is vf.Trace]
        self.started = self.over = self.closed = False

    def _add(self, message: Any, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    async def _refused(self) -> bool:
        from verifiers.v1.session import call_hook

        limit = self.seat.spec.max_turns
        if limit is not None and self.trace.num_turns >= limit:
            self.trace.stop("max_turns")
            return True
        for stop in self.stops:
            if await call_hook(stop, {self.vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
                return True
        return False

    async def turn(self, message: Any = None) -> Any:
        vf = self.vf
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.types import content_text

        if self.closed or self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        data = self.task.data
        prompted = not self.started and data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: a bare turn() takes a prompted task's opening reply")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        texts = []
        if not self.started:
            if data.system_prompt is not None:
                self._add(vf.SystemMessage(content=data.system_prompt))
                texts.append(data.system_prompt)
            if data.prompt is not None:
                for m in ([vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else data.prompt):
                    self._add(m)
                texts.append(data.prompt_text)
        self.started = True
        if message is not None:
            new = [vf.UserMessage(content=message)] if isinstance(message, str) else \
                [parse_message(m) if isinstance(m, dict) else m for m in message]
            for m in new:
                self._add(m)
            texts += [content_text(m.content) for m in new]
        if await self._refused():
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        reply = await self.seat.episode.ask("\n\n".join(t for t in texts if t))
        msg = vf.AssistantMessage(content=reply)
        self._add(msg, sampled=True)
        return vf.Segment(messages=[msg])

    async def steer(self, *a: Any, **k: Any) -> Any:
        raise PostrlError("environment verifiers_v1: interaction.steer is not supported (postrl plays whole turns)")

    send = steer

    async def close(self) -> Any:
        if self.closed:
            return self.trace
        self.closed = True
        if self.trace.stop_condition is None:
            self.trace.stop("user_closed")
        await self.task.score(self.trace)
        self.trace.ok = True
        self.seat.episode.traces.append(self.trace)
        return self.trace


class _Agents:
    def __init__(self, seats: dict[str, _Seat]):
        self._seats = seats

    def __getattr__(self, name: str) -> _Seat:
        seats = self.__dict__.get("_seats") or {}
        if name not in seats:
            raise AttributeError(f"no agent {name!r}; postrl plays {sorted(seats)}")
        return seats[name]


class _Episode:
    """One verifiers episode in its own thread and event loop; ``ask`` hands an observation to postrl and waits for
    the model's reply (postrl's next ``step``)."""

    def __init__(self, adapter: "VerifiersV1Environment", task: Any):
        self.adapter, self.task = adapter, task
        self.events: queue.Queue = queue.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: asyncio.Future | None = None
        self.traces: list = []
        self.thread = threading.Thread(target=self._main, daemon=True, name="postrl-verifiers-episode")
        self.thread.start()

    async def ask(self, observation: str) -> str:
        self.pending = asyncio.get_running_loop().create_future()
        self.events.put(("ask", observation))
        return await self.pending

    def reply(self, action: str) -> None:
        fut, loop = self.pending, self.loop
        self.pending = None
        if fut is None or loop is None:
            raise PostrlError("environment verifiers_v1: the episode is not waiting for a model turn")
        loop.call_soon_threadsafe(fut.set_result, action)

    def cancel(self) -> None:
        fut, loop = self.pending, self.loop
        self.pending = None
        if fut is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(Cancelled()))
        self.thread.join(5.0)

    def next_event(self) -> tuple:
        try:
            return self.events.get(timeout=self.adapter.timeout)
        except queue.Empty:
            raise TimeoutError(f"environment verifiers_v1: the episode did not answer within "
                               f"{self.adapter.timeout:g}s") from None

    def _main(self) -> None:
        try:
            out = asyncio.run(self._run())
            self.events.put(("done", *out))
        except Cancelled:
            self.events.put(("cancelled",))
        except BaseException as e:  # noqa: BLE001 - handed to postrl's step, which ends the episode (counted)
            self.events.put(("error", e))

    async def _run(self) -> tuple[float, dict]:
        self.loop = asyncio.get_running_loop()
        a = self.adapter
        seat = _Seat(a.seat, a.seat_spec, self)
        agents = _Agents({a.seat: seat})
        env = a.make_env()
        if env is None:
            await seat.run(self.task)
        else:
            await env.setup(agents)
            await env.run(self.task, agents)
            from verifiers.v1.episode import EnvInfo, Episode
            from verifiers.v1.trace import TraceTask

            t = self.task
            episode = Episode(env=EnvInfo(id=type(env).__name__),
                              task=TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash),
                              traces=list(self.traces))
            await env.finalize(self.task, episode)
        if not self.traces:
            raise PostrlError(f"environment verifiers_v1: the env's run() ran no turn of the seat '{a.seat}'")
        trace = self.traces[-1]
        scores = {str(k): float(v) for k, v in trace.metrics.items() if v is not None}
        scores.update({f"reward_{k}": float(r.score) for k, r in trace.rewards.items() if r is not None})
        info: dict = {"scores": scores}
        if trace.is_truncated:
            info["failure_cause"] = "env_truncated"
        return float(trace.reward), info


@register("environment", "verifiers_v1",
          source="verifiers v1 (PrimeIntellect verifiers >= 0.4): Taskset, Task rewards/metrics/stops, Env.run / "
                 "finalize, Interaction")
class VerifiersV1Environment(Environment):
    """A verifiers v1 taskset (and env) played by postrl's policy (see the module docstring).

    ``taskset``: import path of the ``vf.Taskset`` class (or of a function returning a taskset); ``args``: its
    config fields; ``env``: import path of a ``vf.Env`` class whose ``setup`` / ``run`` / ``finalize`` drive the
    episode (default: one ``run`` of the seat); ``env_args``: its config fields; ``seat``: the env's seat postrl
    plays (default: its only seat; ``agent`` without ``env``); ``index_key``: the row key naming a task's position in
    the taskset (``vf_index``); ``timeout``: seconds the episode may take between two model turns (60).
    """

    observation_role = "user"

    def __init__(self, *, taskset: str, args: dict[str, Any] | None = None, env: str | None = None,
                 env_args: dict[str, Any] | None = None, seat: str | None = None, index_key: str = "vf_index",
                 timeout: Annotated[float, Gt(0)] = 60.0):
        vf = _vf()
        self.args = dict(args or {})
        self.key = (taskset, json.dumps(self.args, sort_keys=True, default=str))
        self.taskset = load_taskset(taskset, self.args)
        task_cls = type(self.taskset).task_type()
        if self.taskset.toolsets(self.taskset.config) or task_cls.toolsets(self.taskset.config.task):
            raise ConfigError(f"environment.taskset: {taskset} has tool servers (toolsets); the verifiers_v1 adapter "
                              f"plays tool-less harnesses only")
        probe = task_cls.__new__(task_cls)  # the task type's scoring hooks (decorated and config-plugged)
        probe.config, probe.data = self.taskset.config.task, None
        self._check_scoring(probe, taskset)
        self.env_cls, self.env_config = None, None
        seats = {"agent": vf.AgentConfig()}
        if env is not None:
            from verifiers.v1.configs.agent import agent_config_fields
            from verifiers.v1.utils.generic import concrete_type

            cls = resolve(env, "env")
            if not (isinstance(cls, type) and issubclass(cls, vf.Env)):
                raise ConfigError(f"environment.env: '{env}' is not a verifiers v1 Env class")
            config_cls = concrete_type(cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
            try:
                self.env_config = config_cls.model_validate(dict(env_args or {}))
            except ValueError as e:
                raise ConfigError(f"environment.env_args: {env}: {str(e).splitlines()[0]}") from None
            self.env_cls, seats = cls, agent_config_fields(self.env_config)
        elif env_args:
            raise ConfigError("environment.env_args: only with environment.env")
        if len(seats) > 1:
            raise ConfigError(f"environment.env: {env} declares the seats {', '.join(seats)}; postrl's policy plays one "
                              f"seat and has no model for the others")
        if seat is None:
            seat = next(iter(seats))
        if seat not in seats:
            raise ConfigError(f"environment.seat: expected {', '.join(seats)}, got {seat!r}")
        self.seat, self.seat_spec = seat, seats[seat]
        self.index_key, self.timeout = index_key, float(timeout)
        self.episode: _Episode | None = None

    def make_env(self) -> Any:
        """A ``vf.Env`` of the configured class with its config and the taskset, without ``Env.__init__`` (which
        loads the harnesses postrl replaces), or None."""
        if self.env_cls is None:
            return None
        env = self.env_cls.__new__(self.env_cls)
        env.config, env.taskset = self.env_config, self.taskset
        return env

    def task_for(self, row: dict) -> Any:
        """The row's task (see the module docstring)."""
        if self.index_key in row:
            i = int(row[self.index_key])
            cache = _TASKS.setdefault(self.key, [])
            if len(cache) <= i:
                cache += list(itertools.islice(iter(self.taskset), len(cache), i + 1))
            if len(cache) <= i:
                raise PostrlError(f"environment: row {self.index_key}={i} but the taskset has {len(cache)} tasks")
            task = cache[i]
        else:
            task_cls = type(self.taskset).task_type()
            data_cls = task_cls.data_type()
            data = data_cls.model_validate({k: v for k, v in row.items() if k in data_cls.model_fields})
            task = task_cls(data, self.taskset.config.task)
        self._check_scoring(task, "the row's task", PostrlError)
        return task

    @staticmethod
    def _check_scoring(task: Any, what: str, error: type = ConfigError) -> None:
        bad = [fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind) if _needs_runtime(fn)]
        if bad or task.config.judges:
            raise error(f"environment.taskset: {what} scores with {', '.join(bad) or 'judges'}, which need a runtime "
                        f"(sandbox box) or a judge model; the verifiers_v1 adapter provides neither")

    def reset(self, row: dict) -> str:
        self.close()
        self.episode = _Episode(self, self.task_for(row))
        event = self.episode.next_event()
        if event[0] == "ask":
            return event[1]
        self._raise(event, "before the first model turn")
        return ""

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        if self.episode is None:
            raise PostrlError("environment verifiers_v1: step before reset")
        self.episode.reply(action)
        event = self.episode.next_event()
        if event[0] == "ask":
            return event[1], None, False, {}
        if event[0] == "done":
            self.episode = None
            return "", event[1], True, event[2]
        self._raise(event, "")
        return "", None, True, {}

    def _raise(self, event: tuple, when: str) -> None:
        self.episode = None
        if event[0] == "error":
            raise event[1]
        raise PostrlError(f"environment verifiers_v1: the episode ended {when} ({event[0]})")

    def close(self) -> None:
        episode, self.episode = self.episode, None
        if episode is not None and episode.thread.is_alive():
            episode.cancel()
