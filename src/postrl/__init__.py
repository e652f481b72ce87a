"""postrl: reinforcement-learning post-training of language models as a pipeline of named, tested stages."""

__version__ = "0.1.0"
