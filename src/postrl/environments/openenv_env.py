"""The environment ``openenv``: an OpenEnv environment (the interface TRL integrates) run in postrl's rollout.

OpenEnv (``pip install openenv``, the ``openenv`` extra; tested against openenv 0.4.1) defines environments with a
Gym-style API over typed pydantic messages: ``reset(seed=None, episode_id=None, **kwargs) -> Observation`` and
``step(action: Action) -> Observation``, the observation carrying ``done``, ``reward`` and ``metadata`` besides its own
fields. The same API is reached in-process (an ``openenv.core.env_server.Environment`` subclass) or through a client
of a running server (an ``EnvClient`` subclass, whose ``reset`` / ``step`` return a ``StepResult(observation, reward,
done, metadata)``; an async client is used through its ``.sync()`` wrapper). The config names the object by its import
path and its constructor arguments, e.g.

    environment: {name: openenv, env: my_env.server:WordleEnvironment, action: my_env.models:WordleAction}
    environment: {name: openenv, env: my_env.client:WordleEnv, args: {base_url: "http://localhost:8000"},
                  action: my_env.models:WordleAction}
    environment: {name: openenv, env: my_env.server:CalendarEnvironment}          # MCP tools (no ``action``)

One object is made per episode (``env(**args)``, when postrl makes the episode's environment: a tools-mode
environment's tools are listed then) and closed when the episode ends. The mapping:

* ``reset(row)``: ``env.reset(**kw)`` with ``kw`` the row's ``reset_keys`` (and ``seed=row[seed_key]`` when
  ``seed_key`` is set; a reward or ``done`` on the reset observation is ignored); the first observation is, by ``prompt``: ``both`` (default) the row's prompt, a blank line,
  then the reset observation's text (only the prompt when that text is empty); ``row``: the prompt alone;
  ``observation``: the observation's text alone.
* text mode (``action`` given: an Action class, or a function from the model's text to an action): each model turn
  becomes ``action(**{action_field: text})`` (``action_field``: by default the action's one required field other
  than ``metadata``) and ``env.step`` gives the next observation (its text, see below), the turn's reward
  (``reward``; None stays None, a bool counts 0/1) and ``done``.
* tools mode (no ``action``: an OpenEnv MCP environment, ``MCPEnvironment`` or a client of one): the adapter
  lists the tools (``ListToolsAction``) and shows their schemas to the model through the chat template, as
  postrl's tool environments do; each ``<tool_call>`` of a turn (:mod:`postrl.environments.tools` format) becomes a
  ``CallToolAction(tool_name, arguments)``; the results, each in ``result_format``, are the next observation (role
  ``tool``); the turn's reward is the sum of the calls' rewards (None when none gave one), ``done`` when any call's
  observation is done; a call the environment reports as an error counts in ``tool_errors``, a call that does not
  parse or names an unknown tool in ``malformed_calls`` (not sent). A turn without a tool call ends the episode
  without a reward (the environment rewards through its tools).
* an observation's text: the field ``observation_field`` when set; else the observation's fields other than
  ``done``, ``reward``, ``metadata``: the one field's value when there is one (a string as it is, anything else as
  JSON), all of them as a JSON object otherwise.
* OpenEnv has no truncation flag: an observation whose ``metadata`` has ``truncated: true`` ends the episode (the
  environment's own limit) with ``info['failure_cause'] = 'env_truncated'``; an episode postrl cuts
  (``max_turns``, ``max_total_tokens``) keeps the rewards given so far (the reward source ``environment``).

A foreign environment that raises (in its constructor, ``reset`` or ``step``) ends its episode: ``env_errors``
counts it and the episode's reward is NaN (postrl's fault isolation).
"""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any, Callable, Literal

from annotated_types import Ge

from postrl.environments import Environment, call
from postrl.environments.adapters import resolve
from postrl.environments.tools import parse_tool_calls
from postrl.errors import ConfigError, PostrlError
from postrl.registry import register

OWN_FIELDS = ("done", "reward", "metadata")
_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def observation_text(obs: Any, field: str | None = None) -> str:
    """The text shown to the model for an OpenEnv observation (see the module docstring)."""
    if obs is None:
        return ""
    if field is not None:
        value = obs.get(field) if isinstance(obs, dict) else getattr(obs, field, None)
        if value is None and not (isinstance(obs, dict) and field in obs) and not hasattr(obs, field):
            raise PostrlError(f"environment.observation_field: the observation {type(obs).__name__} has no field "
                              f"'{field}'")
        return value if isinstance(value, str) else json.dumps(value, default=str)
    if isinstance(obs, str):
        return obs
    if isinstance(obs, dict):
        data = {k: v for k, v in obs.items() if k not in OWN_FIELDS}
    elif hasattr(obs, "model_dump"):
        data = obs.model_dump(exclude=set(OWN_FIELDS))
    else:
        return str(obs)
    if len(data) == 1:
        (value,) = data.values()
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(data, default=str) if data else ""


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def step_result(out: Any) -> tuple[Any, float | None, bool, dict]:
    """(observation, reward, done, metadata) of a ``StepResult`` (a client's) or an ``Observation`` (in-process;
    a plain dict of the same fields is read alike)."""
    if hasattr(out, "observation") and hasattr(out, "done"):
        obs, reward, done = out.observation, out.reward, bool(out.done)
        if reward is None:
            reward = _get(obs, "reward")
        meta = dict(out.metadata or _get(obs, "metadata") or {})
    else:
        obs, reward, done = out, _get(out, "reward"), bool(_get(out, "done"))
        meta = dict(_get(out, "metadata") or {})
    return obs, (None if reward is None else float(reward)), done, meta


def _action_field(cls: type) -> str:
    fields = getattr(cls, "model_fields", None)
    if fields is None:
        raise ConfigError(f"environment.action: {cls.__name__} is not a pydantic Action class; name its text field "
                          f"with action_field or pass a function text -> action")
    required = [n for n, f in fields.items() if n != "metadata" and f.is_required()]
    if len(required) != 1:
        raise ConfigError(f"environment.action_field: {cls.__name__} has {len(required)} required fields "
                          f"({', '.join(required) or 'none'}); name the one the model's text fills")
    return required[0]


def tool_function(tool: Any) -> Callable:
    """A Python stand-in for an MCP tool (``name``, ``description``, ``input_schema``): its signature, type hints
    and ``Args:`` docstring come from the schema, so :func:`postrl.environments.tools.schemas` renders it and
    :func:`~postrl.environments.tools.parse_tool_calls` binds calls to it. Calling it is an error (the adapter sends
    the call to the environment instead)."""
    schema = dict(getattr(tool, "input_schema", None) or {})
    props = dict(schema.get("properties") or {})
    required = set(schema.get("required") or [])
    params, hints, doc = [], {}, []
    for name, spec in sorted(props.items(), key=lambda kv: kv[0] not in required):
        hint = _JSON_TYPES.get((spec or {}).get("type"), str)
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=inspect.Parameter.empty if name in required else None,
                                        annotation=hint))
        hints[name] = hint
        doc.append(f"    {name}: {(spec or {}).get('description') or name}")

    def fn(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("an OpenEnv tool runs in its environment")

    fn.__name__ = fn.__qualname__ = str(tool.name)
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = hints
    description = (getattr(tool, "description", None) or str(tool.name)).strip()
    fn.__doc__ = description + ("\n\nArgs:\n" + "\n".join(doc) if doc else "")
    return fn


def _tool_result(obs: Any) -> tuple[str, bool]:
    """(text, ok) of a ``CallToolObservation``: the error's message, or the result's data / text content."""
    error = getattr(obs, "error", None)
    if error is not None:
        return f"error: {getattr(error, 'message', error)}", False
    result = getattr(obs, "result", obs)
    data = getattr(result, "data", None)
    if data is not None:
        return (data if isinstance(data, str) else json.dumps(data, default=str)), True
    content = getattr(result, "content", None)
    if isinstance(content, list):
        return "".join(str(getattr(c, "text", c)) for c in content), not bool(getattr(result, "is_error", False))
    return (result if isinstance(result, str) else json.dumps(result, default=str)), True


@register("environment", "openenv",
          source="OpenEnv (huggingface/OpenEnv, TRL's environment interface): reset, step, Action, Observation, "
                 "MCP tools")
class OpenEnvEnvironment(Environment):
    """An OpenEnv environment (in-process ``Environment`` or ``EnvClient``) run as a postrl environment (see the
    module docstring).

    ``env``: import path of the environment / client class or of a function returning one; ``args``: its keyword
    arguments (``base_url`` for a client); ``action``: import path of the Action class (or of a function text ->
    action); omit it for an MCP environment (tools mode); ``action_field``: the action field the model's text fills
    (default: the action's one required field); ``observation_field``: the observation field shown to the model
    (default: see the module docstring); ``reset_keys``: row keys passed to ``reset`` as keyword arguments;
    ``seed_key``: the row key passed as ``reset(seed=...)``; ``prompt``: the first observation (``both``, ``row``,
    ``observation``); ``result_format``: how a tool's result is shown (tools mode).
    """

    def __init__(self, *, env: str, args: dict[str, Any] | None = None, action: str | None = None,
                 action_field: str | None = None, observation_field: str | None = None,
                 reset_keys: list[str] | None = None, seed_key: str | None = None,
                 prompt: Literal["both", "row", "observation"] = "both",
                 max_calls: Annotated[int, Ge(0)] = 8, result_format: str = "<result>{}</result>"):
        make = resolve(env, "env")
        if not callable(make):
            raise ConfigError(f"environment.env: '{env}' is not callable (expected an OpenEnv environment or client "
                              f"class, or a function returning one)")
        self.make, self.args = make, dict(args or {})
        self.to_action: Callable[[str], Any] | None = None
        if action is not None:
            act = resolve(action, "action")
            if isinstance(act, type):
                name = action_field or _action_field(act)
                if getattr(act, "model_fields", None) is not None and name not in act.model_fields:
                    raise ConfigError(f"environment.action_field: {act.__name__} has no field '{name}'")
                self.to_action = lambda text, act=act, name=name: act(**{name: text})
            elif callable(act):
                self.to_action = act
            else:
                raise ConfigError(f"environment.action: '{action}' is neither an Action class nor a function")
        elif action_field is not None:
            raise ConfigError("environment.action_field: only with environment.action (the tools mode sends tool "
                              "calls)")
        else:
            try:
                import openenv.core.env_server.mcp_types  # noqa: F401
            except ImportError:
                raise ConfigError("environment openenv: the tools mode (no environment.action) needs the openenv "
                                  "package ('pip install postrl[openenv]')") from None
        self.observation_field, self.reset_keys, self.seed_key = observation_field, list(reset_keys or []), seed_key
        self.prompt, self.max_calls, self.result_format = prompt, int(max_calls), result_format
        self.observation_role = "user" if self.to_action is not None else "tool"
        self.tools: list[Callable] = []
        self._by_name: dict[str, Callable] = {}
        self.env: Any = None
        self.calls = 0
        self.failed: BaseException | None = None
        # the rollout reads the tools before reset: the episode's environment is opened (and its tools listed) here;
        # a failure is raised by reset, so that it ends this episode only
        try:
            self.env = self._open()
            if self.to_action is None:
                from openenv.core.env_server.mcp_types import ListToolsAction

                listed, _, _, _ = step_result(call(lambda: self.env.step(ListToolsAction())))
                self.tools = [tool_function(t) for t in getattr(listed, "tools", None) or []]
                self._by_name = {fn.__name__: fn for fn in self.tools}
        except Exception as e:  # noqa: BLE001 - the foreign environment's failure ends its episode (in reset)
            self.failed = e

    def _open(self) -> Any:
        env = self.make(**self.args)
        if callable(getattr(env, "sync", None)):
            env = env.sync()  # an EnvClient: its synchronous wrapper runs the client on an event loop of its own
        return env

    def reset(self, row: dict) -> str:
        if self.failed is not None:
            raise self.failed
        if self.env is None:  # a second episode on this object
            self.env = self._open()
        self.calls = 0
        kw = {k: row[k] for k in self.reset_keys if k in row}
        if self.seed_key is not None and self.seed_key in row:
            kw["seed"] = row[self.seed_key]
        obs, _, _, _ = step_result(call(lambda: self.env.reset(**kw)))
        text = observation_text(obs, self.observation_field) if self.prompt != "row" else ""
        if self.prompt == "observation":
            return text
        return str(row["prompt"]) + (f"\n\n{text}" if text else "")

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        if self.to_action is not None:
            obs, reward, done, meta = step_result(call(lambda: self.env.step(self.to_action(action))))
            info: dict = {}
            if meta.get("truncated"):
                done, info["failure_cause"] = True, "env_truncated"
            return ("" if done else observation_text(obs, self.observation_field)), reward, done, info
        return self._tool_step(action)

    def _tool_step(self, action: str) -> tuple[str, float | None, bool, dict]:
        from openenv.core.env_server.mcp_types import CallToolAction

        calls = parse_tool_calls(action, self._by_name)
        info: dict = {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0}
        if not calls:
            return "", None, True, info
        texts, rewards, done = [], [], False
        for c in calls:
            if c.error:
                info["malformed_calls"] += 1
                texts.append(f"error: {c.error}")
                continue
            info["tool_calls"] += 1
            self.calls += 1
            if self.calls > self.max_calls:
                info["tool_errors"] += 1
                texts.append(f"error: more than {self.max_calls} tool calls")
                continue
            args = {k: v for k, v in (c.arguments or {}).items() if v is not None}
            act = CallToolAction(tool_name=c.name, arguments=args)
            obs, reward, call_done, meta = step_result(call(lambda act=act: self.env.step(act)))
            text, ok = _tool_result(obs)
            info["tool_errors"] += int(not ok)
            texts.append(text)
            if reward is not None:
                rewards.append(reward)
            if meta.get("truncated"):
                call_done, info["failure_cause"] = True, "env_truncated"
            done = done or call_done
            if done:
                break
        reward = sum(rewards) if rewards else None
        return ("" if done else "".join(self.result_format.format(t) for t in texts)), reward, done, info

    def close(self) -> None:
        env, self.env = self.env, None
        if env is not None and callable(getattr(env, "close", None)):
            call(env.close)
