"""Scoring a batch with several named reward sources, in parallel, with fault isolation.

Calling conventions (detected from the signature, user functions work unchanged):

- TRL: ``f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=...,
  log_metric=...) -> list[float | None]``, once per batch (or per chunk), by keyword as TRL's
  ``GRPOTrainer._calculate_rewards`` calls it. ``completion_ids`` (each completion's token ids, a list of ints,
  when the caller of :func:`score_batch` gives them), every column of the prompt rows (``group_ids`` among them:
  completions of the same prompt share an id), ``trainer_state`` (a ``transformers.TrainerState``:
  ``global_step``, ``max_steps``; it also reads as a dict), ``log_extra(column, values)`` (a column of the
  completions table: ``samples.jsonl``) and ``log_metric(name, value)`` (a scalar metric: the step's mean in
  ``metrics.jsonl``) go to a function that names them or takes ``**kwargs``; ``steps`` (the completion split into
  reasoning steps) and ``context`` only to one that names them. A function whose required positional parameters
  have other names (``def f(p, c)``) is called ``f(prompts, completions, ...)``, positionally.
  Conversational prompts (a list of ``{"role", "content"}`` messages, TRL's conversational format) reach a
  user's function as message lists and each completion as ``[{"role": "assistant", "content": text}]``, as in
  TRL, or as the caller's own message lists (``completion_messages``: a driver that has them, e.g. the TRL
  adapter, whose completions may hold tool calls and tool results); postrl's own reward sources (modules
  ``postrl.*``) read the completion text, unless they set ``trl_format = True`` (they then get what a user's
  function gets).
- verl: ``compute_score(data_source, solution_str, ground_truth, extra_info)`` once per completion; a dict result
  contributes its ``"score"``. Each completion's call fails on its own: a call that raises fails that entry only.
- ``async def`` functions of either kind are awaited; the per-completion calls of an async verl function run
  concurrently in one event loop.
- A function that declares a ``context`` parameter receives a :class:`RewardContext` (the policy, tokenizer and
  device) from the trainer; no other function sees the model.
- A process reward returns, per completion, a list of step scores (one per entry of ``steps``); its column in the
  reward matrix holds their sum, and the scores themselves go to ``step_rewards`` [N, S] (NaN padded).

None (TRL's semantics): a batch function that returns None for a completion does not apply to it (multi-task data:
each task's reward returns None for the other tasks' rows). The entry is NaN in the matrix, marked in
``RewardOutcome.skipped`` and not a failure; ``weighted_sum`` sums the sources that apply (TRL's ``nansum``), and
a completion no source applies to has no reward (excluded, TRL's "unscorable" row). A verl ``compute_score`` must
return a number: None fails that entry.

Parallelism: every (source, chunk) call runs in its own worker thread, at most ``workers`` at a time, each with a
wall-clock ``timeout`` (a timed-out call is abandoned: its thread cannot be killed, but the run moves on and the
late result is ignored; an async call is cancelled). ``chunk_size`` splits the batch into chunks that end at group
boundaries, so group-aware sources (majority vote, novelty) always see whole groups.

Fault isolation: a batch (or chunk) call that raises is called again on the two halves of its rows, and each half
that raises again is halved in turn, down to single rows, so that only the inputs that make the function raise
fail (bisection: with f failing rows among n, about 2 f log2(n / f) extra calls, at most 2 n - 2). A source that
names ``group_ids`` is group-aware: it is split only at group boundaries and a group that raises fails whole.
Each level of the bisection runs in parallel like the first call. At most ``isolate_calls`` extra calls are made
per source and step; rows still unresolved then fail together. A call that times out fails all its entries (it is
not retried). An entry that is NaN, inf, not a number, None from a verl function, or (for a process reward) a step
list of the wrong length fails that entry (a source may put an exception instance in an entry to say why it
failed); the rows that failed by an exception are counted in ``RewardOutcome.raised``. Failed entries
are NaN in the reward matrix; they are then excluded from the advantage computation (never read as 0), counted per
source, and the first failing input (lowest row) is reported. ``strict=True`` raises a one-line
:class:`RewardError` naming the reward and the input at the first failure instead.

Contract errors stop the run whatever ``strict`` says (a programming error, not a data fault): a call that returns
the wrong number of values, or something that is not a list of values, raises :class:`RewardError` naming the
reward, the expected and the returned count. A source that raises :class:`~postrl.errors.DataError` (a row of
the data is not what it needs, e.g. a malformed gold value) stops the run with that one-line error too.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from postrl import stages
from postrl.errors import DataError, RewardError
from postrl.stages import signature

_VERL_PARAMS = {"data_source", "solution_str", "ground_truth"}
ISOLATE_CALLS = 256  # default bound on the extra calls that isolate the failing rows, per source and step


@dataclass
class RewardContext:
    """What a reward source that declares a ``context`` parameter receives from the trainer.

    ``model`` is the policy (unwrapped, not under DDP); use it under ``torch.no_grad()``. ``chat_template`` is the
    run's ``model.chat_template`` so that prompts are encoded exactly as for generation.
    """

    model: Any = None
    tokenizer: Any = None
    device: Any = "cpu"
    chat_template: str = "auto"
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ calling


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _is_verl(fn: Callable) -> bool:
    try:
        params = set(signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return _VERL_PARAMS <= params


def _accepts(fn: Callable) -> tuple[frozenset[str], bool]:
    """(names of the parameters ``fn`` takes by keyword, whether it takes ``**kwargs``)."""
    try:
        sig = signature(fn)  # (cached per function: postrl.stages)
    except (TypeError, ValueError):
        return frozenset(), True
    names = frozenset(p.name for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def wants(fn: Callable, name: str) -> bool:
    """True when ``fn`` names the parameter ``name`` explicitly (``**kwargs`` does not count)."""
    return name in _accepts(fn)[0]


async def _await_all(coros: list, timeout: float | None) -> list:
    async def one(c):
        return await (asyncio.wait_for(c, timeout) if timeout else c)

    return await asyncio.gather(*(one(c) for c in coros))


async def _await_rows(calls: list[Callable[[], Any]], timeout: float | None) -> list:
    """Await one coroutine per row concurrently; a row whose call raises (or times out) gives its exception."""
    async def one(call):
        try:
            c = call()
            return await (asyncio.wait_for(c, timeout) if timeout else c)
        except Exception as e:  # noqa: BLE001 - one row's failure is that row's entry
            return e

    return await asyncio.gather(*(one(call) for call in calls))


def _resolve(value: Any, timeout: float | None) -> Any:
    if inspect.isawaitable(value):
        return asyncio.run(_await_all([value], timeout))[0]
    return value


def _row(call: Callable[[], Any], timeout: float | None) -> Any:
    """One per-row call; its exception, if it raises, is the row's entry (a failure of that row only)."""
    try:
        return _resolve(call(), timeout)
    except Exception as e:  # noqa: BLE001 - one row's failure is that row's entry
        return e


class _ContractError(TypeError):
    """A reward source returned something that is not a list of values (a programming error, never isolated)."""


# what a TRL-style call passes besides the columns (a column of the same name does not reach the function)
_RESERVED = frozenset({"prompts", "completions", "trainer_state", "log_extra", "log_metric", "context", "steps"})


def is_conversational(prompts: list) -> bool:
    """TRL's test (``trl.data_utils.is_conversational``) on the first prompt: a list of messages with a ``role``."""
    first = prompts[0] if prompts else None
    return isinstance(first, list) and bool(first) and isinstance(first[0], dict) and "role" in first[0]


def postrl_own(fn: Callable) -> bool:
    """True for postrl's own reward sources (defined in a ``postrl.*`` module): they read completion text. A source
    that sets ``trl_format = True`` reads TRL's format instead (conversational completions as messages)."""
    if getattr(fn, "trl_format", False):
        return False
    mod = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""
    return mod == "postrl" or mod.startswith("postrl.")


def _by_keyword(fn: Callable, known: set[str]) -> bool:
    """TRL calls a reward function by keyword. A function whose required positional parameters are not all among
    the names passed (``def f(p, c)``: postrl's older positional form) is called ``f(prompts, completions, ...)``;
    so is a class called as a function (its signature is its constructor's)."""
    if inspect.isclass(fn):
        return False
    try:
        params = signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    for p in params:
        if p.kind is p.POSITIONAL_ONLY:
            return False
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty and p.name not in known:
            return False
    return True


class CallLog:
    """What one call of a reward function logged through TRL's ``log_extra`` / ``log_metric``; kept only when the
    call returns (a call that raises is isolated again, and logs again)."""

    def __init__(self):
        self.columns: dict[str, list] = {}
        self.metrics: list[tuple[str, float]] = []

    def log_extra(self, column: str, values: list) -> None:
        """TRL ``log_extra``: ``values`` (one per completion of the call, in order) as column ``column`` of the
        completions table (samples.jsonl)."""
        self.columns.setdefault(str(column), []).extend(list(values))

    def log_metric(self, name: str, value: float) -> None:
        """TRL ``log_metric``: a scalar; the values a step logs under ``name`` are averaged into metrics.jsonl."""
        self.metrics.append((str(name), float(value)))


def call_reward(fn: Callable, prompts: list, completions: list[str], columns: dict[str, list], params: dict,
                context: RewardContext | None = None, timeout: float | None = None,
                trainer_state: Any = None, log: CallLog | None = None, conversational: bool | None = None,
                messages: list | None = None) -> list:
    """Call one reward source on a batch; returns its raw list of values (one per completion).

    A TRL-style source is called by keyword as TRL calls it (module docstring); ``trainer_state`` and ``log``'s
    ``log_extra`` / ``log_metric`` go to a source that names them or takes ``**kwargs``; with conversational
    prompts (``conversational`` None: :func:`is_conversational` of ``prompts``) a user's source gets each completion
    as ``messages`` gives it (one message list per completion), else as ``[{"role": "assistant", "content": text}]``. ``timeout`` bounds each awaited coroutine of an async source
    (sync sources are bounded by the caller's thread timeout). A verl-style source is called once per completion
    and each call fails alone: its exception becomes that completion's entry. Raises ``_ContractError`` when a
    batch source returns something other than a list of values.
    """
    names, var_kw = _accepts(fn)
    extra = dict(params)
    if context is not None and "context" in names:
        extra["context"] = context
    if _is_verl(fn):
        calls = []
        for i, c in enumerate(completions):
            row = {k: v[i] for k, v in columns.items()}
            gt = row.get("ground_truth", row.get("answer"))
            calls.append(lambda c=c, row=row, gt=gt: fn(
                data_source=row.get("data_source", row.get("task", "")), solution_str=c, ground_truth=gt,
                extra_info=row, **extra))
        if _is_async(fn):
            out = asyncio.run(_await_rows(calls, timeout))
        else:
            out = [_row(call, timeout) for call in calls]
        return [r.get("score", r) if isinstance(r, dict) else r for r in out]
    if trainer_state is not None and (var_kw or "trainer_state" in names):
        extra["trainer_state"] = trainer_state
    if log is not None:
        for key in ("log_extra", "log_metric"):
            if var_kw or key in names:
                extra[key] = getattr(log, key)
    kwargs = {k: v for k, v in columns.items()
              if k not in _RESERVED and (var_kw or k in names)} if columns else {}
    if "steps" in columns and "steps" in names:
        kwargs["steps"] = columns["steps"]
    kwargs.update(extra)
    if conversational is None:
        conversational = is_conversational(prompts)
    if conversational and not postrl_own(fn):
        completions = list(messages) if messages is not None else \
            [[{"role": "assistant", "content": c}] for c in completions]
    if _by_keyword(fn, {"prompts", "completions", *kwargs}):
        res = fn(prompts=prompts, completions=completions, **kwargs)
    else:
        res = fn(prompts, completions, **kwargs)
    res = _resolve(res, timeout)
    if isinstance(res, torch.Tensor):
        res = res.tolist()
    if res is None or isinstance(res, (str, bytes, dict)) or not isinstance(res, Sized):
        raise _ContractError(f"returned {type(res).__name__}, expected a list of {len(completions)} values "
                            "(one per completion; None where the reward does not apply)")
    return list(res)


_STATE_CLASS: list = []


def trainer_state(global_step: int, max_steps: int, **fields: Any) -> Any:
    """The ``trainer_state`` TRL passes to a reward function: a ``transformers.TrainerState`` (``global_step``:
    the optimizer steps before this batch, postrl: RL steps; ``max_steps``: the run's steps), which also reads as
    a dict (``state["global_step"]``, ``state.get(...)``), the form earlier postrl versions passed."""
    if not _STATE_CLASS:
        from dataclasses import dataclass as _dc

        from transformers import TrainerState

        @_dc
        class State(TrainerState):
            def __getitem__(self, key: str) -> Any:
                try:
                    return getattr(self, key)
                except AttributeError:
                    raise KeyError(key) from None

            def get(self, key: str, default: Any = None) -> Any:
                return getattr(self, key, default)

            def __contains__(self, key: str) -> bool:
                return hasattr(self, key)

        State.__name__ = State.__qualname__ = "TrainerState"
        _STATE_CLASS.append(State)
    return _STATE_CLASS[0](global_step=int(global_step), max_steps=int(max_steps), **fields)


# ------------------------------------------------------------------------------------------------ threads


class _Threads:
    """Daemon threads reused across :func:`run_parallel` calls (starting a thread per call cost ~0.2 ms a step for
    two cheap reward sources: 238 vs 65 us). A thread stuck in a timed-out call is simply never idle again; the
    next submission starts a new one. Daemon threads: a hung reward never blocks the interpreter's exit."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if start:
                self._started += 1
            else:
                self._idle -= 1  # an idle thread will take this task
        self._tasks.put(task)
        if start:
            threading.Thread(target=self._loop, daemon=True, name=f"postrl-reward-{self._started}").start()

    def _loop(self) -> None:
        while True:
            self._tasks.get()()  # the task catches its own exceptions
            with self._lock:
                self._idle += 1


_THREADS = _Threads()


def run_parallel(calls: list[Callable[[], Any]], workers: int, timeout: float | None) -> list[tuple[str, Any]]:
    """Run zero-argument ``calls`` on at most ``workers`` threads, each with its own wall-clock ``timeout``.

    Returns, in order, ``("ok", value)``, ``("error", exception)`` or ``("timeout", None)``. A timed-out call is
    abandoned (its daemon thread may finish later; the result is dropped) and frees its slot at once.
    ``workers=1`` without a timeout runs the calls inline, in order, in the calling thread.
    """
    n = len(calls)
    if workers <= 1 and timeout is None:
        out = []
        for c in calls:
            try:
                out.append(("ok", c()))
            except Exception as e:  # noqa: BLE001 - isolation is the point
                out.append(("error", e))
        return out
    results: list[tuple[str, Any] | None] = [None] * n
    cond = threading.Condition()

    def runner(i: int) -> None:
        try:
            r: tuple[str, Any] = ("ok", calls[i]())
        except BaseException as e:  # noqa: BLE001
            r = ("timeout", None) if isinstance(e, (asyncio.TimeoutError, TimeoutError)) else ("error", e)
        with cond:
            if results[i] is None:
                results[i] = r
            cond.notify_all()

    pending = list(range(n))
    running: dict[int, float] = {}
    with cond:
        while pending or running:
            while pending and len(running) < max(1, workers):
                i = pending.pop(0)
                running[i] = time.monotonic()
                _THREADS.submit(lambda i=i: runner(i))
            for i in [i for i in running if results[i] is not None]:
                del running[i]
            now = time.monotonic()
            if timeout is not None:
                for i, t0 in list(running.items()):
                    if now - t0 >= timeout:
                        results[i] = ("timeout", None)
                        del running[i]
            if running and (not pending or len(running) >= workers):
                wait = None if timeout is None else max(0.0, min(t0 + timeout for t0 in running.values()) - now)
                cond.wait(wait if wait is None else wait + 1e-3)
    return [r if r is not None else ("timeout", None) for r in results]


# ------------------------------------------------------------------------------------------------ values


def _to_float(v: Any) -> float:
    if v is None or isinstance(v, (str, bytes)):
        return math.nan
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


def _short(s: Any, n: int = 80) -> str:
    r = repr(s)
    return r if len(r) <= n else r[: n - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def group_chunks(n: int, group_ids: list | None, chunk_size: int | None) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges of about ``chunk_size`` rows that never split a group."""
    if not chunk_size or chunk_size >= n:
        return [(0, n)] if n else []
    out, start = [], 0
    for i in range(1, n + 1):
        boundary = i == n or group_ids is None or group_ids[i] != group_ids[i - 1]
        if i - start >= chunk_size and boundary:
            out.append((start, i))
            start = i
    if start < n:
        out.append((start, n))
    return out


def split_rows(a: int, b: int, group_ids: list | None, whole_groups: bool) -> list[tuple[int, int]]:
    """The two halves of rows [a, b) for isolating a failure: split at the middle row, or, with ``whole_groups``,
    at the group boundary nearest it; [] when [a, b) is one unit (one row, or one group)."""
    if b - a < 2:
        return []
    mid = (a + b) // 2
    if not whole_groups or group_ids is None:
        return [(a, mid), (mid, b)]
    cuts = [i for i in range(a + 1, b) if group_ids[i] != group_ids[i - 1]]
    if not cuts:
        return []
    c = min(cuts, key=lambda i: abs(i - mid))
    return [(a, c), (c, b)]


def _exc(e: BaseException) -> str:
    text = _one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class RewardOutcome:
    matrix: torch.Tensor  # [N, K], NaN where the entry failed or the source does not apply
    failures: dict[str, int] = field(default_factory=dict)  # per source: entries that failed
    first_failure: dict[str, str] = field(default_factory=dict)  # per source: the first failing input / error
    step_rewards: torch.Tensor | None = None  # [N, S] step scores of the process source, NaN padded
    step_source: str | None = None  # name of the source that returned step scores
    isolation_calls: dict[str, int] = field(default_factory=dict)  # per source: extra calls isolating failures
    skipped: torch.Tensor | None = None  # [N, K] bool: the source returned None (does not apply to the row)
    raised: dict[str, int] = field(default_factory=dict)  # per source: entries that failed by an exception
    first_exception: dict[str, str] = field(default_factory=dict)  # per source: 'TypeError: ...'
    logged_columns: dict[str, list] = field(default_factory=dict)  # log_extra: column -> one value per row
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)  # log_metric: name -> values
    names: list[str] = field(default_factory=list)  # the sources' names, in column order

    def failure_rate(self, name: str) -> float:
        n = self.matrix.shape[0]
        return self.failures.get(name, 0) / n if n else 0.0

    def skipped_rate(self, name: str) -> float:
        """The fraction of rows the source returned None for (it does not apply to them)."""
        n = self.matrix.shape[0]
        if not n or self.skipped is None or name not in self.names:
            return 0.0
        return float(self.skipped[:, self.names.index(name)].float().mean())


def score_batch(prompts: list, completions: list[str], columns: dict[str, list], specs: list, *,
                context: RewardContext | None = None, strict: bool = False, timeout: float | None = None,
                workers: int = 1, chunk_size: int | None = None,
                built: list[tuple[Any, dict]] | None = None, completion_ids: list[list[int]] | None = None,
                trainer_state: Any = None, isolate_calls: int = ISOLATE_CALLS,
                completion_messages: list | None = None) -> RewardOutcome:
    """Score ``completions`` with every reward spec (objects with ``.name`` and ``.params``).

    Returns the reward matrix [N, K] (NaN marks a failed entry, or one whose source returned None: ``skipped``)
    with per-source failure counts and the first failing input; see the module docstring for the calling
    convention and the fault rules (a call that raises is bisected to the rows that raise, at most
    ``isolate_calls`` extra calls per source). ``strict`` raises :class:`RewardError` at the first failure (in
    source order, then row order); a wrong number of values raises it always. ``built``: one (callable, call
    params) per spec, made once per run by the trainer (``postrl.stages.build``: a reward class is instantiated
    with its params and keeps its state across steps); without it each spec's registered function is called with
    ``spec.params``. ``completion_ids`` (one list of token ids per completion, without padding) becomes a column;
    ``trainer_state`` (:func:`trainer_state`, or the caller's ``transformers.TrainerState``) is passed whole to every
    call (TRL's keyword arguments). ``completion_messages``: with conversational prompts, each completion as the
    message list a user's function receives (default: one assistant message holding the text).
    """
    n = len(completions)
    if completion_ids is not None:
        if len(completion_ids) != n:
            raise ValueError(f"score_batch: {len(completion_ids)} completion_ids for {n} completions")
        columns = {**columns, "completion_ids": list(completion_ids)}
    if completion_messages is not None and len(completion_messages) != n:
        raise ValueError(f"score_batch: {len(completion_messages)} completion_messages for {n} completions")
    vals = [[math.nan] * len(specs) for _ in range(n)]  # the matrix, as lists (a tensor write costs ~2 us each)
    skipped = [[False] * len(specs) for _ in range(n)]
    out = RewardOutcome(torch.empty((n, len(specs))), names=[s.name for s in specs])
    if built is None:  # (a reward class becomes one instance: its state lives as long as the caller keeps it)
        built = [(st.fn, st.params) for st in (stages.build("reward", spec.name, spec.params) for spec in specs)]
    fns = [fn for fn, _ in built]
    call_params = [params for _, params in built]
    verl = [_is_verl(fn) for fn in fns]
    conversational = is_conversational(prompts)
    group_ids = columns.get("group_ids")
    whole_groups = [wants(fn, "group_ids") for fn in fns]
    steps: dict[int, list[float]] = {}
    failed: list[tuple[int, int, int, str]] = []  # (source, first row, end row, what): reported after every call
    raised: list[tuple[int, int, int, str]] = []  # (source, first row, end row, 'Type: message') of exceptions

    def call(k: int, a: int, b: int) -> Callable[[], tuple[list, CallLog]]:
        cols = {key: v[a:b] for key, v in columns.items()}

        def run() -> tuple[list, CallLog]:
            log = CallLog()
            return call_reward(fns[k], prompts[a:b], completions[a:b], cols, call_params[k], context, timeout,
                               trainer_state, log, conversational,
                               completion_messages[a:b] if completion_messages is not None else None), log
        return run

    def keep_log(a: int, b: int, log: CallLog) -> None:
        for column, values in log.columns.items():
            col = out.logged_columns.setdefault(column, [None] * n)
            for j, v in enumerate(values[: b - a]):
                col[a + j] = v
        for name, v in log.metrics:
            out.logged_metrics.setdefault(name, []).append(v)

    def take(k: int, a: int, value: list) -> None:
        name = specs[k].name
        for j, v in enumerate(value):
            i = a + j
            if isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() == 1):
                v = v.tolist() if isinstance(v, torch.Tensor) else list(v)
                if out.step_source not in (None, name):
                    raise RewardError(f"reward '{name}' returned step scores, but '{out.step_source}' already "
                                      "did; only one process reward source per run")
                out.step_source = name
                want = columns.get("steps")
                sv = [_to_float(x) for x in v]
                if want is not None and len(sv) != len(want[i]):
                    failed.append((k, i, i + 1, f"returned {len(sv)} step scores for {len(want[i])} steps"))
                    continue
                if not sv or any(math.isnan(x) for x in sv):
                    failed.append((k, i, i + 1, f"returned step scores {_short(v)}"))
                    continue
                steps[i] = sv
                vals[i][k] = sum(sv)
                continue
            if v is None and not verl[k]:  # TRL: the reward does not apply to this row
                skipped[i][k] = True
                continue
            if isinstance(v, BaseException):  # a source may report why one entry failed
                failed.append((k, i, i + 1, f"failed with {_exc(v)}"))
                raised.append((k, i, i + 1, _exc(v)))
                continue
            f = _to_float(v)
            if math.isnan(f):
                failed.append((k, i, i + 1, f"returned {_short(v, 40)}"))
                continue
            vals[i][k] = f

    extra = [0] * len(specs)
    level = [(k, a, b) for k in range(len(specs)) for a, b in group_chunks(n, group_ids, chunk_size)]
    while level:  # the calls, then each level of the bisection of the calls that raised
        results = run_parallel([call(k, a, b) for k, a, b in level], workers, timeout)
        bisect = []
        for (k, a, b), (status, value) in zip(level, results):
            name = specs[k].name
            if status == "timeout":
                failed.append((k, a, b, f"timed out after {timeout:g}s"))
            elif status == "error" and isinstance(value, _ContractError):
                raise RewardError(f"reward '{name}' {value}")
            elif status == "error" and isinstance(value, DataError):  # the data is wrong: no row to isolate
                raise value
            elif status == "error":
                halves = split_rows(a, b, group_ids, whole_groups[k])
                if halves and extra[k] + len(halves) <= isolate_calls:
                    extra[k] += len(halves)
                    bisect += [(k, h0, h1) for h0, h1 in halves]
                else:
                    stop = f" (not isolated further: {extra[k]} extra calls this step)" if halves else ""
                    failed.append((k, a, b, f"raised {_exc(value)}{stop}"))
                    raised.append((k, a, b, _exc(value)))
            elif len(value[0]) != b - a:
                raise RewardError(f"reward '{name}' returned {len(value[0])} values for {b - a} completions")
            else:
                take(k, a, value[0])
                keep_log(a, b, value[1])
        level = bisect
    for k, a, b, what in sorted(failed, key=lambda f: (f[0], f[1])):
        name = specs[k].name
        where = f"on completion {_short(completions[a])} (prompt {_short(prompts[a])})"
        if strict:
            raise RewardError(_one_line(f"reward '{name}' {what} {where}"))
        out.failures[name] = out.failures.get(name, 0) + b - a
        out.first_failure.setdefault(name, _one_line(f"{what} {where}"))
    for k, a, b, what in sorted(raised, key=lambda f: (f[0], f[1])):
        name = specs[k].name
        out.raised[name] = out.raised.get(name, 0) + b - a
        out.first_exception.setdefault(name, what)
    out.isolation_calls = {specs[k].name: c for k, c in enumerate(extra) if c}
    out.matrix = torch.tensor(vals, dtype=torch.float32).reshape(n, len(specs))
    out.skipped = torch.tensor(skipped, dtype=torch.bool).reshape(n, len(specs))
    if out.step_source is not None:
        S = max((len(v) for v in steps.values()), default=0)
        sr = torch.full((n, S), math.nan, dtype=torch.float32)
        for i, v in steps.items():
            sr[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
        out.step_rewards = sr
    return out


def columns_in_kwargs(fn: Callable) -> bool:
    """True when a reward function's ``**kwargs`` receive the prompt rows' columns (a TRL-style function), so its
    config parameters are its keyword-only arguments alone; False for a verl-style ``compute_score`` (whose
    ``**kwargs`` take its parameters, verl's ``reward_kwargs``) and for a reward class."""
    if inspect.isclass(fn) or _is_verl(fn):
        return False
    try:
        return any(p.kind is p.VAR_KEYWORD for p in signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
