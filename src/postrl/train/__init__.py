"""Training: the RL trainer, the SFT warm start, checkpoints."""
