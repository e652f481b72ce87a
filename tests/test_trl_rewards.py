"""TRL-style reward functions in postrl, called exactly as TRL's GRPOTrainer calls them.

The reward functions below are the examples of TRL's documentation, unchanged (quick start ``reward_len``; GRPO
trainer docs "Using a custom reward function": examples 1.1, 2, 3, 4, 5), each kept as its source text and run
in its own namespace. What is checked: the keyword call (``prompts=``, ``completions=``, ``completion_ids=``,
columns, ``trainer_state``, ``log_extra``, ``log_metric``) against TRL 1.x's own ``_calculate_rewards``; the
conversational format (message-list prompts, completions ``[{"role": "assistant", "content": ...}]``); TRL's None
semantics (a reward that returns None does not apply to that row: the others are summed, ``nansum``; a row no
reward applies to has no reward); a reward that raises on every completion of the first step stops the run with
one line naming it; and ``postrl train`` end to end with them.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import postrl
from postrl.errors import RewardError
from postrl.rewards.core import score_batch, trainer_state
from postrl.shaping import weighted_sum

SRC = Path(postrl.__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ TRL's examples
# verbatim from TRL's README quick start and docs/source/grpo_trainer.md ("Using a custom reward function")
TRL_DOCS = {
    "quickstart": '''
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
''',
    "example_1_1": '''
def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]
''',
    "example_2": '''
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
''',
    "example_3": '''
import re

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \\boxed{}
    matches = [re.search(r"\\\\boxed\\{(.*?)\\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
''',
    "example_4": '''
def check_math_solution(prompt, completion):  # (the docs leave these two to the reader)
    return completion.strip() == "4"

def test_code_solution(prompt, completion):
    return "return" in completion

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards
''',
    "example_5": '''
import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
''',
}


def doc(name: str) -> dict:
    ns: dict = {"__name__": f"trl_docs_{name}"}  # a module name, as an imported file would have
    exec(textwrap.dedent(TRL_DOCS[name]), ns)  # noqa: S102 - the documentation's own code, as a user pastes it
    return ns


def spec(name: str):
    return SimpleNamespace(name=name, params={})


def score(fns: dict, prompts, completions, columns=None, **kw):
    columns = {"group_ids": list(range(len(completions))), **(columns or {})}
    return score_batch(prompts, completions, columns, [spec(n) for n in fns], built=[(f, {}) for f in fns.values()],
                       **kw)


# ------------------------------------------------------------------------------------------------ the calls


def test_quickstart_reward_len_is_called_by_keyword():
    """TRL's quick-start reward takes ``completions`` and ``**kwargs`` only: a positional call
    ``fn(prompts, completions)`` raised TypeError on every row (the run went on without learning)."""
    fn = doc("quickstart")["reward_len"]
    out = score({"reward_len": fn}, ["p0", "p1"], ["abc", "x" * 25])
    assert not out.failures and not out.raised
    assert out.matrix[:, 0].tolist() == [-17.0, -5.0]  # -|20 - 3|, -|20 - 25|


def test_documentation_examples_give_the_documented_values():
    # example 1.1: "reward_func(prompts=prompts, completions=completions, completions_ids=...) -> [6.0, 12.0]"
    out = score({"chars": doc("example_1_1")["reward_func"]}, ["The sky is", "The sun is"],
                [" blue.", " in the sky."], completion_ids=[[6303, 13], [304, 279, 12884, 13]])
    assert out.matrix[:, 0].tolist() == [6.0, 12.0]
    # example 2 (conversational): "format_reward_func(prompts=prompts, completions=completions) -> [1.0, 0.0]"
    prompts = [[{"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}],
               [{"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}]]
    texts = ["<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12"
             "</answer>", "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."]
    out = score({"format": doc("example_2")["format_reward_func"]}, prompts, texts)
    assert not out.failures and out.matrix[:, 0].tolist() == [1.0, 0.0]
    # example 3: "reward_func(prompts=..., completions=..., ground_truth=["2", "5"]) -> [1.0, 0.0]"
    out = score({"boxed": doc("example_3")["reward_func"]},
                ["Problem: Solve the equation $2x + 3 = 7$. Solution:", "Problem: Solve the equation $3x - 5 = 10$."],
                [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."], {"ground_truth": ["2", "5"]})
    assert out.matrix[:, 0].tolist() == [1.0, 0.0]
    # example 5: async, awaited
    out = score({"async": doc("example_5")["async_reward_func"]}, ["a", "b"], ["x", ""])
    assert out.matrix[:, 0].tolist() == [1.0, 0.0]


def test_postrl_builtins_read_text_in_a_conversational_batch():
    """postrl's own sources (``format``) read the completion text while a user's function gets messages."""
    from postrl import registry

    prompts = [[{"role": "user", "content": "2+2="}]] * 2
    fmt = registry.get("reward", "format")
    out = score({"format": fmt, "trl": doc("example_2")["format_reward_func"]}, prompts, ["4", "<think>a</think>"])
    assert out.matrix.tolist() == [[1.0, 0.0], [0.0, 0.0]] and not out.failures


def test_the_call_matches_trls_calculate_rewards():
    """TRL's own ``GRPOTrainer._calculate_rewards`` (on a stand-in trainer) and postrl's ``score_batch`` pass a
    reward function the same keywords with the same values, and give the same matrix (None -> NaN)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    import logging

    from transformers import TrainerState

    calls: dict[str, list[dict]] = {"trl": [], "postrl": []}
    who = ["trl"]

    def spy(**kwargs):  # records what it was called with, then scores like TRL's multi-task math reward
        calls[who[0]].append(kwargs)
        return [float(len(c)) if t == "math" else None for c, t in zip(kwargs["completions"], kwargs["task"])]

    ex4 = doc("example_4")
    funcs = [spy, ex4["math_reward_func"], ex4["coding_reward_func"]]
    inputs = [{"prompt": "What is 2+2?", "task": "math", "answer": "4"},
              {"prompt": "Write a function that returns the sum of two numbers.", "task": "coding", "answer": ""},
              {"prompt": "Write a poem.", "task": "poetry", "answer": ""}]
    prompts, comps, ids = [r["prompt"] for r in inputs], ["4", "def f(a, b): return a + b", "roses"], [[1], [2, 3], [4]]
    state = TrainerState(global_step=3, max_steps=10)
    extra_logs, metric_logs = [], []
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True, process_index=0),
        reward_funcs=funcs, reward_processing_classes=[None] * 3, reward_func_names=["spy", "math", "coding"],
        state=state, environments=None, args=SimpleNamespace(report_to=[]),
        _log_completion_extra=lambda c, v: extra_logs.append((c, v)), _log_metric=lambda n, v: metric_logs.append(n))
    quiet = logging.getLogger("postrl.test.trl")
    old, trl_grpo.logger = trl_grpo.logger, quiet  # its "all reward functions returned None" warning needs accelerate
    try:
        trl_matrix = trl_grpo.GRPOTrainer._calculate_rewards(fake, inputs, prompts, comps, ids)
    finally:
        trl_grpo.logger = old
    who[0] = "postrl"
    cols = {"task": [r["task"] for r in inputs], "answer": [r["answer"] for r in inputs], "group_ids": [0, 1, 2]}
    out = score_batch(prompts, comps, cols, [spec(n) for n in ("spy", "math", "coding")],
                      built=[(f, {}) for f in funcs], completion_ids=ids,
                      trainer_state=trainer_state(state.global_step, state.max_steps))
    (trl_kw,), (ours,) = calls["trl"], calls["postrl"]
    assert set(trl_kw) == {"prompts", "completions", "completion_ids", "task", "answer", "trainer_state",
                           "log_extra", "log_metric"}
    assert set(ours) - set(trl_kw) == {"group_ids"}  # postrl adds the group ids; nothing TRL passes is missing
    for key in ("prompts", "completions", "completion_ids", "task", "answer"):
        assert ours[key] == trl_kw[key], key
    assert ours["trainer_state"].global_step == 3 and ours["trainer_state"].max_steps == 10
    assert isinstance(ours["trainer_state"], TrainerState) and callable(ours["log_extra"])
    nan_equal = torch.testing.assert_close
    nan_equal(out.matrix, trl_matrix, equal_nan=True)  # [[1, 1, nan], [25, nan, 1], [5, nan, nan]]
    # the scalar reward: TRL's nansum over the functions that returned a value, NaN where none did
    w = torch.tensor([1.0, 0.5, 2.0])
    trl_reward = (trl_matrix * w).nansum(1)
    trl_reward[torch.isnan(trl_matrix).all(1)] = float("nan")
    nan_equal(weighted_sum(out.matrix, w, out.skipped)["reward"], trl_reward, equal_nan=True)
    assert out.skipped.tolist() == [[False, False, True], [True, True, False], [True, True, True]]
    assert not out.failures  # None is not a failure


def test_none_does_not_apply_and_a_failure_still_excludes():
    """weighted_sum: row 0 (1, None) -> 1 x 1 = 1; row 1 (None, 2) -> 0.5 x 2 = 1; row 2 (None, None) -> NaN (no
    source applies: unscorable); row 3 (NaN: a failure, 1) -> NaN (excluded, never read as 0)."""
    def a(prompts, completions, **kw):
        return [1.0, None, None, float("nan")]

    def b(prompts, completions, **kw):
        return [None, 2.0, None, 1.0]

    out = score({"a": a, "b": b}, ["p"] * 4, ["c"] * 4)
    assert out.failures == {"a": 1} and out.skipped.tolist() == [[False, True], [True, False], [True, True],
                                                                  [False, False]]
    r = weighted_sum(out.matrix, torch.tensor([1.0, 0.5]), out.skipped)["reward"].tolist()
    assert r[:2] == [1.0, 1.0] and math.isnan(r[2]) and math.isnan(r[3])
    # a shaping stage's appended column (K > K0) applies everywhere: row 0 = 1 + 3 x 1 = 4
    wide = torch.cat([out.matrix, torch.ones(4, 1)], 1)
    assert weighted_sum(wide, torch.tensor([1.0, 0.5, 3.0]), out.skipped)["reward"][0].item() == 4.0


def test_trainer_state_reads_as_trls_state_and_as_a_dict():
    """TRL passes its ``TrainerState`` (``trainer_state.global_step``); postrl's earlier dict form still reads."""
    seen = []

    def curriculum(completions, trainer_state, **kwargs):  # a dynamic reward as TRL's docs describe it
        seen.append((trainer_state.global_step, trainer_state["max_steps"], trainer_state.get("epoch")))
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    out = score({"curriculum": curriculum}, ["p", "q"], ["a", "b"], trainer_state=trainer_state(3, 12))
    assert out.matrix[:, 0].tolist() == [0.25, 0.25] and seen == [(3, 12, 0)]


def test_log_extra_and_log_metric_are_kept_per_row_and_only_from_calls_that_return():
    """With chunks of 2 rows and a call that raises on row 3, rows are bisected: the logged column holds one value
    per row at its own position, and what the raising calls logged is dropped (row 3 logs nothing)."""
    def logs(prompts, completions, log_extra, log_metric, **kwargs):
        log_extra("why", [f"len={len(c)}" for c in completions])
        log_metric("length_mean", sum(map(len, completions)) / len(completions))
        if "boom" in completions:
            raise ValueError("boom")
        return [float(len(c)) for c in completions]

    comps = ["a", "bb", "ccc", "boom", "eeeee", "ffffff"]
    out = score({"logs": logs}, ["p"] * 6, comps, chunk_size=2)
    assert out.failures == {"logs": 1} and out.raised == {"logs": 1}
    assert out.logged_columns == {"why": ["len=1", "len=2", "len=3", None, "len=5", "len=6"]}
    # returning calls: rows (0, 1) -> 1.5, (4, 5) -> 5.5, then the bisected (2) -> 3.0 (row 3's call raised)
    assert sorted(out.logged_metrics["length_mean"]) == [1.5, 3.0, 5.5]


def test_the_older_positional_form_still_works():
    """A function whose positional parameters have other names (``def f(p, c)``) is called positionally."""
    out = score({"pos": lambda p, c: [float(len(x)) for x in c]}, ["p", "q"], ["ab", "c"])
    assert out.matrix[:, 0].tolist() == [2.0, 1.0] and not out.failures


def test_a_reward_that_raises_on_every_row_of_the_first_step_stops_the_scorer(tmp_path):
    """Scorer level: a TRL conversational reward on plain-text data raises TypeError on every completion of the
    first batch: one RewardError line naming it; with reward.on_all_failed=continue a notice instead."""
    from postrl.config import load_config
    from postrl.models.tiny import build_tokenizer
    from postrl.rewards import RewardContext
    from postrl.step.scoring import Scorer
    from postrl import registry

    registry.register("reward", "t_trl_format", source="test: TRL docs example 2")(
        doc("example_2")["format_reward_func"])
    said = []
    batch = _batch(["<think>a</think><answer>1</answer>", "2"])
    cfg = load_config(None, ["rewards=[{name: correct}, {name: t_trl_format}]"])
    scorer = Scorer(cfg.reward, cfg.rewards, cfg.shaping, RewardContext(), build_tokenizer(),
                    notice=lambda m, **kw: said.append(m))
    with pytest.raises(RewardError) as e:
        scorer.score(batch)
    msg = str(e.value)
    assert msg.startswith("reward 't_trl_format' raised TypeError: string indices must be integers") and \
        "every completion of the first step" in msg and "\n" not in msg and not said
    cfg = load_config(None, ["rewards=[{name: correct}, {name: t_trl_format}]", "reward.on_all_failed=continue"])
    scorer = Scorer(cfg.reward, cfg.rewards, cfg.shaping, RewardContext(), build_tokenizer(),
                    notice=lambda m, **kw: said.append(m))
    info = scorer.score(_batch(["1", "2"]))
    assert info["failures"] == {"t_trl_format": 2} and any("t_trl_format" in m and "TypeError" in m for m in said)
    said.clear()
    scorer.score(_batch(["1", "2"]))  # a later step: no stop, and the notice is not repeated
    assert not [m for m in said if "raised" in m]


def _batch(completions: list[str]):
    from postrl.batch import RolloutBatch

    n = len(completions)
    return RolloutBatch(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                        completion_ids=torch.ones(n, 2, dtype=torch.long), completion_mask=torch.ones(n, 2),
                        group_ids=torch.zeros(n, dtype=torch.long), sampler_logprobs=torch.zeros(n, 2),
                        truncated=torch.zeros(n, dtype=torch.bool), prompts=["1+1="] * n, completions=completions,
                        columns={"answer": ["2"] * n, "task": ["arithmetic"] * n}, extra={"step": 0, "max_steps": 3})


# ------------------------------------------------------------------------------------------------ postrl train


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(SRC)
    return env


def _train(tmp_path: Path, *args: str, model: Path | None = None) -> subprocess.CompletedProcess:
    small = ["train.steps=2", "train.prompts_per_step=2", "rollout.group_size=2", "train.eval_size=2",
             "train.eval_k=1", "rollout.max_new_tokens=8", "--quiet"]
    if model is not None:
        small.append(f"model.path={model}")
    return subprocess.run([sys.executable, "-m", "postrl", "train", *args, *small], cwd=tmp_path,
                          capture_output=True, text=True, env=_env(), timeout=600)


def test_postrl_train_with_trls_quickstart_reward(tmp_path):
    """``postrl train 'rewards=[{name: trl_rewards:reward_len}]'`` as a new user runs it: every completion scored,
    the reward is -|20 - len(completion)|, and what a reward logs (log_metric, log_extra) reaches metrics.jsonl
    and samples.jsonl. Before: TypeError on every call, reward_all_failed at every step, no update."""
    (tmp_path / "trl_rewards.py").write_text(TRL_DOCS["quickstart"] + textwrap.dedent('''
        def logged(completions, log_extra, log_metric, **kwargs):
            log_extra("n_chars", [len(c) for c in completions])
            log_metric("mean_chars", sum(len(c) for c in completions) / len(completions))
            return [0.0] * len(completions)
        '''))
    run = tmp_path / "run"
    r = _train(tmp_path, "rewards=[{name: trl_rewards:reward_len}, {name: trl_rewards:logged}]", f"output_dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/trl_rewards:reward_len/failures"] for m in rows] == [0.0, 0.0]
    assert all(m["valid"] == 1.0 and "mean_chars" in m for m in rows)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        assert s["rewards"]["trl_rewards:reward_len"] == -abs(20 - len(s["completion"]))
        assert s["extra"]["n_chars"] == len(s["completion"])


def test_postrl_train_stops_at_once_on_a_reward_that_raises_everywhere(tmp_path):
    """TRL's conversational format reward on plain-text prompts raises TypeError on every completion: the run
    stops at step 1 with exit status 2 and one line naming the reward and the exception."""
    (tmp_path / "trl_rewards.py").write_text(TRL_DOCS["example_2"])
    r = _train(tmp_path, "rewards=[{name: trl_rewards:format_reward_func}]", f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "postrl: error: reward 'trl_rewards:format_reward_func' raised TypeError: string indices must be integers")


def test_postrl_train_continues_on_purpose_and_says_so_under_quiet(tmp_path):
    """reward.on_all_failed=continue: the run goes on, and --quiet still says it (stderr and notices.jsonl)."""
    (tmp_path / "trl_rewards.py").write_text(TRL_DOCS["example_2"])
    run = tmp_path / "run"
    r = _train(tmp_path, "rewards=[{name: correct}, {name: trl_rewards:format_reward_func}]",
               "reward.on_all_failed=continue", f"output_dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    said = [x for x in r.stderr.splitlines() if x.startswith("notice: reward 'trl_rewards:format_reward_func'")]
    assert len(said) == 1 and "TypeError" in said[0]
    notices = [json.loads(x) for x in (run / "notices.jsonl").read_text().splitlines()]
    assert any("format_reward_func" in n["message"] and n["step"] == 1 for n in notices)


def test_postrl_train_on_conversational_prompts_with_trls_format_reward(tmp_path):
    """A JSONL file of conversational prompts (TRL's format) trains with a chat-template model; TRL's example 2
    reads ``completion[0]["content"]`` and scores every completion as its regex says."""
    from postrl.models.tiny import build_local

    model = tmp_path / "model"
    _, tok = build_local(model, size="nano")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(model)
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}+{i}="}],
             "answer": str(2 * i)} for i in range(6)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trl_rewards.py").write_text(TRL_DOCS["example_2"])
    run = tmp_path / "run"
    r = _train(tmp_path, "task={name: file, path: data.jsonl, eval_fraction: 0.34}",
               "rewards=[{name: trl_rewards:format_reward_func}]", f"output_dir={run}", model=model)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/trl_rewards:format_reward_func/failures"] for m in rows] == [0.0, 0.0]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["prompt"], list) for s in samples)
    for s in samples:
        want = 1.0 if re.match(r"^<think>.*?</think><answer>.*?</answer>$", s["completion"]) else 0.0
        assert s["rewards"]["trl_rewards:format_reward_func"] == want
