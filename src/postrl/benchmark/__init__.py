"""``postrl bench``: postrl's Trainer against TRL's GRPOTrainer side by side (:mod:`postrl.benchmark.harness`)."""
