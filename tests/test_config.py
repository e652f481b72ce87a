"""Config loading, overrides and one-line errors (through the CLI too)."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from postrl import registry
from postrl.cli import main
from postrl.config import Config, dump_yaml, load_config
from postrl.errors import ConfigError


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: 0.001\nrollout:\n  group_size: 4\n")
    cfg = load_config(f, ["optim.lr=1e-5", "train.steps=7", "rewards.0.weight=2", 'rollout.stop=["\\n"]'])
    assert cfg.optim.lr == 1e-5 and cfg.train.steps == 7 and cfg.rollout.group_size == 4
    assert cfg.rewards[0].weight == 2.0 and cfg.rollout.stop == ["\n"]
    assert cfg.advantage.name == "grpo" and cfg.loss.agg == "token_mean"


def test_stage_params_travel():
    cfg = load_config(None, ["advantage.scale=batch", "advantage.eps=1e-4", "loss.eps_high=0.28"])
    assert cfg.advantage.params == {"scale": "batch", "eps": 1e-4}
    assert cfg.loss.params == {"eps_high": 0.28}


@pytest.mark.parametrize("override, message", [
    (["optim.lrr=1"], "unknown key 'optim.lrr'"),
    (["bogus=1"], "unknown key 'bogus'"),
    (["optim.lr=abc"], "optim.lr: input should be a valid number"),
    (["train.steps=0"], "train.steps"),
    (["advantage.name=grpoo"], "unknown advantage 'grpoo'; valid: .*grpo"),
    (["advantage.scal=batch"], "advantage: unknown parameter 'scal' for advantage 'grpo'; valid: scale, eps"),
    (["loss.agg=nope"], "unknown aggregation 'nope'; valid: .*token_mean"),
    (["task.name=nosuchtask"], "unknown task 'nosuchtask'; valid: .*arithmetic"),
    (["rewards.0.name=nosuch"], "unknown reward 'nosuch'"),
    (["optim.lr"], "expected KEY=VALUE"),
])
def test_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, override)
    assert "\n" not in str(e.value)


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="config file .* does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_cli_prints_one_line_error_without_traceback():
    r = subprocess.run([sys.executable, "-m", "postrl", "train", "optim.lrr=1"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "postrl: error: unknown key 'optim.lrr'"
    r = subprocess.run([sys.executable, "-m", "postrl", "train", "model.path=/no/such/model", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("postrl: error: model.path '/no/such/model': no such folder "
                                "(expected a folder written by save_pretrained)")


def test_config_show_resolves(capsys):
    assert main(["config", "show", "train.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out
    Config.model_validate(__import__("yaml").safe_load(out))  # what it prints is itself a valid config


def test_methods_json(capsys):
    import json

    assert main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {(r["kind"], r["name"]) for r in rows}
    assert ("advantage", "grpo") in names and ("loss", "ppo_clip") in names and ("task", "arithmetic") in names
    from postrl import registry

    own = {(e.kind, e.name) for e in registry.all_entries() if getattr(e.fn, "__module__", "").startswith("postrl.")}
    assert all(r["description"] for r in rows if (r["kind"], r["name"]) in own)  # every postrl stage says what it is


def test_config_reference_doc_is_current():
    """docs/config.md is generated from the code (postrl config reference > docs/config.md): keep it true."""
    from pathlib import Path

    from postrl.cli.reference import reference_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert doc.read_text().strip() == reference_markdown().strip(), "regenerate: postrl config reference > docs/config.md"


def test_changing_a_stage_name_drops_the_old_stage_params(tmp_path):
    # the default task is arithmetic with chatty=0.6; countdown has no such parameter
    assert load_config(None, ["task.name=countdown"]).task.params == {}
    assert load_config(None, ["task.digits=3"]).task.params == {"chatty": 0.6, "digits": 3}  # same stage: merged
    f = tmp_path / "run.yaml"
    f.write_text("task: {name: countdown, numbers: 4}\n")
    assert load_config(f).task.params == {"numbers": 4}


# ------------------------------------------------------------------------------------------------ fuzzed inputs
# Issue 21: inputs that were accepted (or reached torch and raised there); each must be one ConfigError naming the key.

@registry.register("reward", "config_kw_param", source="test: a TRL-style reward with a parameter and **columns")
def config_kw_param(prompts, completions, *, threshold: float = 0.5, **columns):
    """1.0 when the completion is longer than ``threshold`` characters."""
    return [float(len(c) > threshold) for c in completions]


@registry.register("reward", "config_verl_kwargs", source="test: a verl compute_score taking reward_kwargs")
def config_verl_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl style: its **kwargs are parameters (verl's reward_kwargs)."""
    return float(solution_str.strip() == str(ground_truth)) * kwargs.get("scale", 1.0)


FUZZ = [
    # ranges that reached torch.optim.AdamW
    (["optim.eps=-1"], r"optim\.eps: input should be greater than 0 \(got -1\)"),
    (["optim.eps=0"], r"optim\.eps: input should be greater than 0"),
    (["optim.betas=[2, 2]"], r"optim\.betas: each beta must be in \[0, 1\), got \[2\.0, 2\.0\]"),
    (["optim.betas=[0.9, 1.0]"], r"optim\.betas: each beta must be in \[0, 1\)"),
    (["optim.betas=[-0.1, 0.9]"], r"optim\.betas: each beta must be in \[0, 1\)"),
    (["optim.betas=[.nan, 0.9]"], r"optim\.betas"),
    (["optim.lr=.inf"], r"optim\.lr: expected a finite number, got inf"),
    (["optim.max_grad_norm=-1"], r"optim\.max_grad_norm: input should be greater than 0"),
    # NaN / inf anywhere, stage parameters and sections defined elsewhere included
    (["rollout.temperature=.inf"], r"rollout\.temperature: expected a finite number, got inf"),
    (["rewards.0.weight=.nan"], r"rewards\.0\.weight: expected a finite number, got nan"),
    (["regularizers=[{name: entropy_bonus, coef: .inf}]"], r"regularizers\.0\.coef: expected a finite number"),
    (["advantage.eps=.nan"], r"advantage\.eps: expected a finite number, got nan"),
    (["task.chatty=-.inf"], r"task\.chatty: expected a finite number, got -inf"),
    (["reward.weights=[1.0, .nan]"], r"reward\.weights\.1: expected a finite number"),
    (["kl.coef=.inf"], r"kl\.coef: expected a finite number"),
    # booleans are not integers, integers and strings are not booleans
    (["rollout.group_size=true"], r"rollout\.group_size: input should be a valid integer \(got True\)"),
    (["train.steps=false"], r"train\.steps: input should be a valid integer \(got False\)"),
    (["train.steps='3'"], r"train\.steps: input should be a valid integer \(got '3'\)"),
    (["train.steps=3.0"], r"train\.steps: input should be a valid integer \(got 3\.0\)"),
    (["reward.strict=1"], r"reward\.strict: input should be a valid boolean \(got 1\)"),
    (["reward.strict='true'"], r"reward\.strict: input should be a valid boolean \(got 'true'\)"),
    (["diagnostics.nan_guard.enabled=0"], r"diagnostics\.nan_guard\.enabled: input should be a valid boolean"),
    (["sft.lr=true"], r"sft\.lr: input should be a valid number"),
    # unknown keys under a reward entry (the reward then failed on every row)
    (["rewards.0.bogus=1"], r"rewards\.0: unknown parameter 'bogus' for reward 'correct'; valid: \(none\)"),
    (["rewards=[{name: correct}, {name: config_kw_param, treshold: 3}]"],
     r"rewards\.1: unknown parameter 'treshold' for reward 'config_kw_param'; valid: threshold"),
    # what would exhaust memory or never end
    (["train.prompts_per_step=10000000"], r"train\.prompts_per_step: input should be less than or equal to 65536"),
    (["rollout.group_size=100000"], r"rollout\.group_size: input should be less than or equal to 1024"),
    (["train.prompts_per_step=4096", "rollout.group_size=32"],
     r"train\.prompts_per_step: 4096 prompts x rollout\.group_size 32 = 131072 rows per step, more than 65536"),
    (["rollout.max_new_tokens=10000000"], r"rollout\.max_new_tokens: input should be less than or equal to 131072"),
    (["train.prompts_per_step=64", "rollout.group_size=1024", "rollout.max_new_tokens=8192"],
     r"rollout\.max_new_tokens: 65536 rows per step x 8192 new tokens = 536870912 tokens per step, more than 268435456"),
    (["train.eval_size=20000"], r"train\.eval_size: 20000 prompts x train\.eval_k 4 = 80000 rows per evaluation"),
    (["sft.batch_size=100000"], r"sft\.batch_size: input should be less than or equal to 65536"),
    (["train.mini_batches=300"], r"train\.mini_batches: 300 optimizer steps per epoch but only 256 rows per step"),
    # warmup: one of steps or ratio
    (["optim.warmup_ratio=0.1", "optim.warmup_steps=5"],
     r"optim\.warmup_ratio: set either optim\.warmup_steps \(5\) or optim\.warmup_ratio \(0\.1\), not both"),
    (["optim.warmup_ratio=1.5"], r"optim\.warmup_ratio: input should be less than or equal to 1"),
    # a length stage that can never apply with the run's lengths
    (["shaping=[{name: overlong_soft, max_length: 20480, buffer: 4096}, {name: weighted_sum}]"],
     r"shaping\.0: overlong_soft never applies: it punishes completions longer than max_length - buffer = 16384 "
     r"tokens and rollout\.max_new_tokens is 16"),
    (["shaping=[{name: overlong_soft, buffer: 0}, {name: weighted_sum}]"],
     r"shaping\.0\.buffer: expected a value >= 1, got 0"),
    (["shaping=[{name: overlong_soft, max_length: 16.5}, {name: weighted_sum}]"],
     r"shaping\.0\.max_length: expected an integer, got 16\.5"),
    # validators' own messages stay one line that starts with the key
    (["rewards=[]"], r"^rewards: at least one reward source is required$"),
    (["kl.controller=adaptive"], r"^kl\.controller=adaptive needs kl\.coef > 0"),
    # stage parameters: refused from their annotations (or the stage's registered check) when the config is read
    (["loss.eps_low=-1"], r"^loss\.eps_low: expected a value >= 0 and < 1, got -1$"),
    (["loss.eps_low=5"], r"^loss\.eps_low: expected a value >= 0 and < 1, got 5$"),
    (["loss.eps_low=true"], r"^loss\.eps_low: expected a number, got True$"),
    (["loss.dual_clip=0.5"], r"^loss\.dual_clip: expected a value > 1, got 0\.5$"),
    (["loss.name=dispo", "loss.mode=nope"], r"^loss\.mode: expected 'mask' or 'clip', got 'nope'$"),
    (["advantage.scale=sideways"], r"^advantage\.scale: expected 'group', 'batch' or 'none', got 'sideways'$"),
    (["advantage.eps=-1"], r"^advantage\.eps: expected a value >= 0, got -1$"),
    (["advantage.singleton=verl"], r"^advantage\.singleton: expected 'zero' or 'raw', got 'verl'$"),
    (["advantage.name=gae", "advantage.value_epochs=0"], r"^advantage\.value_epochs: expected a value >= 1, got 0$"),
    (["advantage.name=gae", "advantage.value_epochs=2.5"], r"^advantage\.value_epochs: expected an integer, got 2\.5$"),
    (["rewards=[{name: format, pattern: '('}]"],
     r"^rewards\.0\.pattern: expected a valid regular expression \(missing \), unterminated subpattern at "
     r"position 0\), got '\('$"),
    (["rewards=[{name: format, pattern: 5}]"], r"^rewards\.0\.pattern: expected a string, got 5$"),
    (["rewards=[{name: format, tags: think}]"], r"^rewards\.0\.tags: expected a list, got 'think'$"),
    (["rewards=[{name: exact, extract: nope}]"],
     r"^rewards\.0\.extract: expected 'none', 'answer_tag', 'boxed', 'last_number' or 'auto', got 'nope'$"),
    (["task.digits=0"], r"^task\.digits: expected a value >= 1 and <= 1000, got 0$"),
    (["task.digits=2", "task.min_digits=3"], r"^task\.min_digits: expected a value <= digits \(2\), got 3$"),
    (["task.ops=/"], r"^task\.ops: expected a non-empty string of '\+', '-', '\*', got '/'$"),
    (["filters=[{name: range_filter, low: 1, high: 0}]"],
     r"^filters\.0\.high: expected a value > low \(1\.0\), got 0\.0$"),
    (["filters=[{name: pcl, epochs: 0}]"], r"^filters\.0\.epochs: expected a value >= 1, got 0$"),
    (["regularizers=[{name: top_entropy_tokens, q: 0}]"],
     r"^regularizers\.0\.q: expected a value > 0 and <= 1, got 0$"),
    (["shaping=[{name: ensemble_brme, lam: 2}, {name: weighted_sum}]"],
     r"^shaping\.0\.lam: expected a value >= 0 and <= 1, got 2$"),
]


@pytest.mark.parametrize("overrides, message", FUZZ, ids=[" ".join(o) for o, _ in FUZZ])
def test_fuzzed_overrides_give_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_fuzzed_yaml_files_give_one_line_naming_the_key(tmp_path):
    cases = {
        "rollout: {group_size: true}\n": r"rollout\.group_size: input should be a valid integer",
        "rewards:\n  - {name: correct, bogus: 1}\n": r"rewards\.0: unknown parameter 'bogus'",
        "optim: {betas: [0.9, 2]}\n": r"optim\.betas: each beta must be in \[0, 1\)",
        "diagnostics: {length_drift: {max_growth: .inf}}\n": r"diagnostics\.length_drift\.max_growth: expected a finite",
        "train: {prompts_per_step: 100000}\n": r"train\.prompts_per_step",
    }
    for i, (text, message) in enumerate(cases.items()):
        f = tmp_path / f"run{i}.yaml"
        f.write_text(text)
        with pytest.raises(ConfigError, match=message) as e:
            load_config(f)
        assert "\n" not in str(e.value)


VALID = [
    (["train.steps=3"], lambda c: c.train.steps == 3),
    (["reward.strict=yes"], lambda c: c.reward.strict is True),  # YAML 1.1's yes is a boolean
    (["reward.strict=false"], lambda c: c.reward.strict is False),
    (["optim.lr=1"], lambda c: c.optim.lr == 1.0 and isinstance(c.optim.lr, float)),  # an int where a float goes
    (["optim.betas=[0, 0.5]"], lambda c: c.optim.betas == (0.0, 0.5)),
    (["optim.max_grad_norm=null"], lambda c: c.optim.max_grad_norm is None),
    (["rollout.temperature=0"], lambda c: c.rollout.temperature == 0.0),
    (["rollout.top_p=1"], lambda c: c.rollout.top_p == 1.0),
    # the limits themselves are allowed: 64 x 1024 = 65536 rows, x 4096 tokens = 2**28
    (["train.prompts_per_step=64", "rollout.group_size=1024", "rollout.max_new_tokens=4096"],
     lambda c: c.train.prompts_per_step * c.rollout.group_size == 65536),
    (["train.eval_size=16384", "train.eval_k=4"], lambda c: c.train.eval_size == 16384),
    (["train.mini_batches=256"], lambda c: c.train.mini_batches == 256),
    (["optim.warmup_ratio=0.1"], lambda c: c.optim.warmup_ratio == 0.1 and c.optim.warmup_steps == 0),
    (["rewards=[{name: format, tags: [think, answer]}]"], lambda c: c.rewards[0].params == {"tags": ["think", "answer"]}),
    (["rewards=[{name: config_kw_param, threshold: 3}]"], lambda c: c.rewards[0].params == {"threshold": 3}),
    (["rewards=[{name: config_verl_kwargs, scale: 2.0}]"], lambda c: c.rewards[0].params == {"scale": 2.0}),
    (["output_dir=runs/x", "seed=7"], lambda c: c.output_dir == "runs/x" and c.seed == 7),
]


@pytest.mark.parametrize("overrides, check", VALID, ids=[" ".join(o) for o, _ in VALID])
def test_valid_inputs_still_load(overrides, check):
    assert check(load_config(None, overrides))


def test_config_show_and_train_refuse_a_stage_parameter_in_the_same_line(tmp_path):
    """``config show`` accepted what ``train`` then refused with a raw ValueError (issue 26): now both refuse it
    when the config is read, exit 2, and print the same one line."""
    lines = []
    for cmd in (["config", "show"], ["train", "train.steps=1", f"output_dir={tmp_path / 'run'}"]):
        r = subprocess.run([sys.executable, "-m", "postrl", *cmd, "loss.eps_low=-1"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        lines.append(r.stderr)
    assert lines[0] == lines[1] == "postrl: error: loss.eps_low: expected a value >= 0 and < 1, got -1\n"
    assert not (tmp_path / "run").exists()


def test_every_stage_parameter_is_typed_and_its_default_valid():
    """The annotations are the whole schema: every keyword-only parameter of every registered stage has one that
    resolves, and its default satisfies it (pydantic does not check defaults)."""
    import inspect
    from typing import Any

    from pydantic import ConfigDict, TypeAdapter

    from postrl import stages

    for e in registry.all_entries():
        for name, (ann, default) in stages.parameters(e.fn).items():
            assert ann is not Any, f"{e.kind} {e.name}: parameter '{name}' has no resolvable annotation"
            if default is not inspect.Parameter.empty:
                TypeAdapter(ann, config=ConfigDict(strict=True, arbitrary_types_allowed=True)).validate_python(default)


def test_cli_refuses_the_hang_and_the_silent_exit_at_once():
    """The two inputs that hung (prompts_per_step=10000000) or exited silently (group_size=100000) before."""
    for arg, key in (("train.prompts_per_step=10000000", "train.prompts_per_step"),
                     ("rollout.group_size=100000", "rollout.group_size")):
        r = subprocess.run([sys.executable, "-m", "postrl", "config", "show", arg], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.startswith(f"postrl: error: {key}: ") and r.stderr.count("\n") == 1


def test_strict_types_hold_for_models_built_in_code():
    with pytest.raises(ValidationError):
        Config(rollout={"group_size": True})
    with pytest.raises(ValidationError):
        Config(optim={"lr": float("nan")})
    cfg = Config()
    with pytest.raises(ValidationError):  # validate_assignment: the same rules on assignment
        cfg.train.steps = True


def test_warmup_ratio_resolves_to_optimizer_steps():
    """ceil(ratio x total optimizer steps), total = steps x epochs x mini_batches (transformers' get_warmup_steps)."""
    cfg = load_config(None, ["optim.warmup_ratio=0.1", "train.steps=60", "train.epochs=2", "train.mini_batches=3"])
    total = cfg.train.steps * cfg.train.epochs * cfg.train.mini_batches
    assert total == 360 and cfg.optim.warmup_for(total) == 36
    assert cfg.optim.warmup_for(15) == 2  # ceil(1.5)
    assert load_config(None, ["optim.warmup_ratio=0"]).optim.warmup_for(360) == 0
    assert load_config(None, ["optim.warmup_steps=7"]).optim.warmup_for(360) == 7  # no ratio: the steps
    assert load_config(None, []).optim.warmup_for(360) == 0


def test_overlong_soft_lengths_follow_max_new_tokens():
    """max_length defaults to rollout.max_new_tokens, buffer to a fifth of it (DAPO 20480 / 4096)."""
    shaping = "shaping=[{name: overlong_soft}, {name: weighted_sum}]"
    for new, (max_length, buffer) in ((16, (16, 3)), (20480, (20480, 4096)), (1, (1, 1)), (100, (100, 20))):
        cfg = load_config(None, [shaping, f"rollout.max_new_tokens={new}", "train.prompts_per_step=8"])
        assert cfg.shaping[0].params == {"max_length": max_length, "buffer": buffer}
    cfg = load_config(None, ["shaping=[{name: overlong_soft, buffer: 8}, {name: weighted_sum}]",
                             "rollout.max_new_tokens=64"])
    assert cfg.shaping[0].params == {"max_length": 64, "buffer": 8}  # a given value is kept
    # the resolved config is itself a valid config that resolves to the same (resume reads it back)
    again = load_config(None, base=__import__("yaml").safe_load(dump_yaml(cfg)))
    assert again.shaping[0].params == cfg.shaping[0].params
