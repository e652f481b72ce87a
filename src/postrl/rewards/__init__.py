"""Reward sources.

Every reward source is called like a TRL reward function, ``f(prompts, completions, **columns) -> list[float |
None]``, once per batch; a verl-style ``compute_score(data_source, solution_str, ground_truth, extra_info)`` is
detected by its signature and called once per completion; ``async def`` sources are awaited. Built-in sources take
their configuration as keyword-only arguments. :func:`score_batch` builds the named reward matrix ``[N, K]``
(parallel, with per-call timeouts and fault isolation; see :mod:`postrl.rewards.core`).

Built-in sources: ``correct`` (task verifier), ``format`` (regex / strict tags), ``exact``, ``numeric``, ``math``
(math-verify), ``reasoning_gym`` (builtin.py); ``majority_vote``, ``novelty``, ``co_reward`` (label_free.py);
``likelihood`` (likelihood.py); ``judge``, ``self_judge`` (judge.py); ``sql_execution`` (sql.py); ``bleu``, ``chrf``, ``mt_mixed``,
``reasoning_pattern`` (text.py); ``semantic_similarity`` (semantic.py); ``lexical_diversity`` (diversity.py);
``rubric_judge`` (rubric.py); ``template_format`` (builtin.py); ``rank_incentive`` (retrieval.py: BM25);
``dp_nn_votes`` (private.py). Token-reward producers (kind ``field``): ``red_token_reward``,
``attention_token_reward`` (dense.py), ``critic_token_reward`` (critic.py), ``mle_token_reward`` (teacher.py).
"""

from postrl.rewards.core import RewardContext, RewardOutcome, columns_in_kwargs, score_batch  # noqa: F401
from postrl.rewards import builtin, judge, label_free, likelihood  # noqa: F401  (register the built-in sources)
from postrl.rewards import model  # noqa: F401  (registers model, model/0..7: trained reward models)
from postrl.rewards import code  # noqa: F401  (registers code_tests, code_reshaped, verrpo_weighted_tests)
from postrl.rewards import dense  # noqa: F401  (registers the field producers red_token_reward, attention_token_reward)
from postrl.rewards import sql, text, semantic, diversity, rubric  # noqa: F401,E402  (issue 31's reward sources)
from postrl.rewards import critic, teacher  # noqa: F401,E402  (the producers critic_token_reward, mle_token_reward)
from postrl.rewards import private, retrieval  # noqa: F401,E402  (issue 31: DP-RFT's votes, ConvSearch-R1's rank)
