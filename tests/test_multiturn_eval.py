"""Held-out evaluation of multi-turn episodes: a model that calls the calculator correctly scores 1."""

from __future__ import annotations

import re

import torch

from postrl.config import load_config
from postrl.data import load_source
from postrl.evaluate import episode_runner, evaluate
from postrl.models.tiny import build_tokenizer
from postrl.rollout.base import Generation


class ScriptedCalculator:
    """A backend that, for each context, calls ``calc`` on the problem when no result is in it yet, then answers
    with the result (``wrong`` answers: it answers the result + 1); pad_id like HFGenerator."""

    def __init__(self, tok, wrong: bool = False):
        self.tok, self.wrong, self.pad_id, self.calls = tok, wrong, tok.pad_token_id, []

    def generate(self, prompts, n, params, seeds):
        self.calls.append(params.temperature)
        texts = []
        for p in prompts:
            ctx = self.tok.decode(p, skip_special_tokens=True)
            result = re.search(r"<result>(-?\d+)</result>", ctx)
            if result is None:
                texts.append(f'<tool_call>calc("{re.search(r"([0-9*+-]+)=", ctx).group(1)}")</tool_call>')
            else:
                texts.append(str(int(result.group(1)) + self.wrong))
        rows = [list(self.tok(t, add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id]
                for t in texts for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
        N = len(rows)
        return Generation(torch.zeros(N, 1, dtype=torch.long), torch.ones(N, 1, dtype=torch.long), ids, mask,
                          -0.5 * mask, torch.zeros(N, dtype=torch.bool), [t for t in texts for _ in range(n)])


def run_eval(wrong: bool, k: int = 2) -> tuple[dict, ScriptedCalculator]:
    cfg = load_config(None, [
        "task={name: calculator, digits: 2, min_digits: 2, ops: '*'}",
        "environment={name: calculator, max_turns: 3, max_total_tokens: 96}", "rewards=[{name: environment}]"])
    tok = build_tokenizer()
    backend = ScriptedCalculator(tok, wrong)

    source = load_source(cfg.task.model_dump())
    rows = source.eval_rows(6, 0)
    res = evaluate(backend, tok, source, rows, max_new_tokens=40, k=k, seed=0, chat_template="none",
                   episodes=episode_runner(backend, tok, cfg.environment, "none"))
    return res, backend


def test_calculator_episode_eval_scores_a_correct_tool_user_one():
    res, backend = run_eval(wrong=False)
    assert res["scored_by"] == "environment" and res["n"] == 6
    assert res["accuracy"] == 1.0 and res["reward"] == 1.0 and res["pass@1"] == 1.0 and res["pass@2"] == 1.0
    assert res["turns"] == 2.0 and res["truncated"] == 0.0
    # greedy episodes (two turns at temperature 0), then the sampled ones at the rollout temperature
    assert backend.calls == [0.0, 0.0, 1.0, 1.0]


def test_calculator_episode_eval_scores_a_wrong_answer_zero():
    res, _ = run_eval(wrong=True)
    assert res["accuracy"] == 0.0 and res["reward"] == 0.0 and res["pass@2"] == 0.0 and res["turns"] == 2.0


def test_single_turn_eval_of_the_same_model_is_not_scored_by_the_environment():
    """Without an episode runner the first turn (a tool call) is all that is scored: the old, wrong, 0."""
    cfg = load_config(None, ["task={name: calculator, digits: 2, min_digits: 2, ops: '*'}"])
    tok = build_tokenizer()

    source = load_source(cfg.task.model_dump())
    res = evaluate(ScriptedCalculator(tok), tok, source, source.eval_rows(6, 0), max_new_tokens=40, k=1,
                   chat_template="none")
    assert res["scored_by"] == "verifier" and res["accuracy"] == 0.0
    assert episode_runner(ScriptedCalculator(tok), tok, cfg.environment) is None
