"""Reward sources.

Every reward source is called like a TRL reward function, ``f(prompts, completions, **columns) -> list[float |
None]``, once per batch; a verl-style ``compute_score(data_source, solution_str, ground_truth, extra_info)`` is
detected by its signature and called once per completion. Built-in sources take their configuration as
keyword-only arguments. :func:`score_batch` builds the named reward matrix ``[N, K]``.
"""

from postrl.rewards.core import RewardOutcome, score_batch  # noqa: F401
from postrl.rewards import builtin  # noqa: F401  (registers the built-in sources)
