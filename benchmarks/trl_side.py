"""The TRL side of ``postrl bench``: TRL's GRPOTrainer at equal work with postrl's side, timed per phase.

It patches TRL's internals (the generation, reward and reference-log-prob methods are wrapped with timers; EOS is
removed from the generation so that every completion runs to ``max_new_tokens``; a callback gates each step on the
benchmark's parent process), which is why it lives here, in the repository, and not in the installed package.
``postrl.benchmark.harness`` loads this file in the TRL worker process (``trl_side_path``).
"""

from __future__ import annotations

import time
from typing import Any

from postrl.benchmark.harness import REWARD_WEIGHTS, _bench_rows, _sync, correct_reward, digit_fraction


def trl_worker(spec, proto) -> None:
    import torch

    if spec.threads:
        torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from transformers.utils import logging as hf_logging
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:  # pragma: no cover - depends on the environment
        proto.send({"error": f"TRL side needs trl: pip install 'postrl[bench]' ({e})"})
        return
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # equal work: EOS does not end a completion
    E = spec.epochs
    args = GRPOConfig(
        output_dir=spec.work_dir, report_to="none", save_strategy="no", disable_tqdm=True,
        use_cpu=spec.device == "cpu",
        seed=spec.seed, max_steps=spec.total_steps * E, logging_steps=1,
        per_device_train_batch_size=spec.rows, gradient_accumulation_steps=1, num_generations=spec.group_size,
        shuffle_dataset=False,
        max_completion_length=spec.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"use_cache": True, "eos_token_id": None},
        num_iterations=E, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        reward_weights=list(REWARD_WEIGHTS), learning_rate=spec.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        gradient_checkpointing=False, bf16=False, fp16=False, dataloader_num_workers=0,
    )
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "task": r["task"]}
                            for r in _bench_rows(spec, spec.total_steps)])
    acc = {"generation": 0.0, "reward": 0.0, "ref": 0.0}
    lengths: list[int] = []  # completion lengths of the step's last generation
    clock: dict[str, Any] = {"t0": None}

    class Gate(TrainerCallback):
        """Blocks at the start of each postrl-equivalent step (E TRL optimizer steps) until the parent says go."""

        def _report(self):
            if clock["t0"] is None:
                return
            _sync(spec)
            proto.send({"wall": time.perf_counter() - clock["t0"], **acc, "len_min": min(lengths),
                        "len_max": max(lengths), "threads": torch.get_num_threads(),
                        "cpu_s": proto.cpu_s() - clock["cpu0"], "matmul": "torch"})
            clock["t0"] = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % E:
                return
            if not clock.get("ready"):
                # Ready only here, once train() has set itself up: had it said so before train(), its set-up
                # would run during the other side's first step (and skew the thread probe postrl runs there).
                clock["ready"] = True
                proto.find_children()
                proto.send({"ready": True, "init_s": time.perf_counter() - t0, "threads": torch.get_num_threads()})
            self._report()
            if proto.recv() != "step":
                control.should_training_stop = True
                raise SystemExit(0)
            for k in acc:
                acc[k] = 0.0
            _sync(spec)
            clock["t0"], clock["cpu0"] = time.perf_counter(), proto.cpu_s()

        def on_train_end(self, args, state, control, **kw):
            self._report()

    trainer = GRPOTrainer(model=model, reward_funcs=[digit_fraction, correct_reward], args=args, train_dataset=ds,
                          processing_class=tokenizer, callbacks=[Gate()])
    # equal work: no EOS cut in the completion mask either
    trainer.eos_token_ids = []
    trainer.generation_config.eos_token_id = None
    trainer.generation_kwargs["eos_token_id"] = None
    hf_generate = model.generate

    def generate_without_eos(*a, **k):
        # transformers fills a None eos_token_id of the generation config passed to generate from the model's
        # generation_config, which is EOS again by the time training starts: clear it for every call.
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
        gc = k.get("generation_config")
        if gc is not None and gc.eos_token_id is not None:
            raise RuntimeError("bench: TRL's generation config has an EOS (unequal work)")
        return hf_generate(*a, **k)

    model.generate = generate_without_eos

    def timed(name, fn, when=None):
        def wrapper(*a, **k):
            if when is not None and not when():
                return fn(*a, **k)
            _sync(spec)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _sync(spec)
                acc[name] += time.perf_counter() - t
        return wrapper

    generate = timed("generation", trainer._generate)

    def generate_and_count(prompts):
        out = generate(prompts)
        lengths[:] = [len(c) for c in out[1]]  # (prompt_ids, completion_ids, ...)
        return out

    trainer._generate = generate_and_count
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "ref", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled())
    try:
        trainer.train()
    except SystemExit:
        pass
    while proto.recv() == "step":  # asked for more steps than max_steps
        proto.send({"error": "no steps left"})
