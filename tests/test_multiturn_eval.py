"""Held-out evaluation of multi-turn episodes: a model that calls the calculator correctly scores 1."""

from __future__ import annotations

import re

import torch

from postrl.config import load_config
from postrl.data import load_source
from postrl.evaluate import episode_runner, evaluate
from postrl.models.tiny import build_tokenizer
from postrl.generation import Generation


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


def test_trainer_and_postrl_eval_score_an_environment_run_by_episodes(tmp_path, capsys):
    """A calculator run's eval.jsonl and `postrl eval RUN` are episode evaluations (scored_by: environment)."""
    import json

    from postrl.cli import main
    from postrl.models.tiny import build_local
    from postrl.train.trainer import Trainer

    model = tmp_path / "nano"
    build_local(model, size="nano", seed=0)
    out = tmp_path / "run"
    cfg = load_config(None, [f"model.path={model}", f"output_dir={out}", "task.name=calculator", "task.digits=2",
                             "environment={name: calculator, max_turns: 2, max_total_tokens: 20}",
                             "rewards=[{name: environment}]", "rollout.max_new_tokens=8", "rollout.group_size=2",
                             "train.prompts_per_step=2", "train.steps=1", "train.eval_size=3", "train.eval_k=2"])
    Trainer(cfg, out).train()
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in evals] == ["before", "after"]
    for e in evals:
        assert e["scored_by"] == "environment" and e["n"] == 3 and 1.0 <= e["turns"] <= 2.0 and "pass@2" in e
    assert main(["eval", str(out), "--n", "3", "--k", "2", "--max-new-tokens", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["scored_by"] == "environment" and res["n"] == 3 and 1.0 <= res["turns"] <= 2.0
