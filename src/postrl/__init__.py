"""postrl: reinforcement-learning post-training of language models as a pipeline of named, tested stages."""

import os as _os

# The tokenizers library encodes a batch on a pool of Rayon threads that keep spinning for a while after each call,
# taking cores from the torch operators that follow (measured, 20M model: the decode step on 2 threads became as
# slow as on 1 right after a rollout's tokenisation; without the pool, 1.7x faster). Prompts are short: encode them
# on the calling thread, unless the user chose otherwise. Set at import, before any tokenizer has run.
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"
