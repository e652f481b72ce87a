"""Advantage estimators over token rewards [N, T] from a reward model: RED and attention credit.

The token rewards are batch fields produced from the estimator's own reward model (the ``reward_model`` parameter
of their producer, a folder written by ``postrl rm train``; :mod:`postrl.rewards.dense`); the run's scalar
reward is not read (the reward model's redistributed score replaces it).
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge, Le

from postrl.advantages import masked_whiten
from postrl.registry import register


def token_return_advantage(token_rewards: torch.Tensor, completion_mask: torch.Tensor, valid: torch.Tensor,
                           gamma: Annotated[float, Ge(0), Le(1)] = 1.0, whiten: bool = True) -> torch.Tensor:
    """G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s} over the completion's tokens, whitened over the valid tokens
    of the batch (``masked_whiten``: unbiased var, eps 1e-8) when ``whiten``; 0 on padding and invalid rows."""
    m = completion_mask.to(torch.float64) * valid.to(torch.float64).unsqueeze(-1)
    r = torch.nan_to_num(token_rewards.to(torch.float64)) * m
    if gamma == 1.0:
        G = r.flip(-1).cumsum(-1).flip(-1)
    else:
        T = r.shape[-1]
        pos = torch.arange(T, dtype=torch.float64)
        w = torch.pow(gamma, pos)  # G_t = gamma^-t sum_{s >= t} gamma^s r_s
        G = (r * w).flip(-1).cumsum(-1).flip(-1) / w
    G = G * m
    return (masked_whiten(G, m) if whiten else G).to(torch.float32)


_OPTS = """
    Options: ``gamma`` 1.0 (discount of the token returns); ``whiten`` True (whiten the returns over the batch's
    valid tokens, as REINFORCE++ does with token rewards; False: the raw returns); the token rewards' producer's
    (:mod:`postrl.rewards.dense`): ``reward_model`` (required) the reward model's folder, ``device`` 'cpu',
    ``rm_batch_size`` 8 (the reward model's forward).
    Works with any group size. Rows with ``valid`` False get 0."""


def red(red_token_reward: torch.Tensor, completion_mask: torch.Tensor, valid: torch.Tensor | None = None, *,
        gamma: Annotated[float, Ge(0), Le(1)] = 1.0, whiten: bool = True) -> torch.Tensor:
    v = torch.ones(completion_mask.shape[0], dtype=torch.bool) if valid is None else valid.bool()
    return token_return_advantage(red_token_reward, completion_mask, v, gamma, whiten)


red.__doc__ = """RED token rewards r_t = RM(o_<=t) - RM(o_<t) of a reward model; A = their whitened returns.

    RED ("Unleashing Token-Level Rewards from Holistic Feedback via Reward Redistribution") credits each token
    with the change it makes to an off-the-shelf reward model's score, with no change to the reward model:
      r_{i,t} = RM(q, o_<=t) - RM(q, o_<t)     (``red_token_reward``, one forward of the causal reward model)
      G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s}   (gamma = 1: RM(q, o) - RM(q, o_<t), the final score against
                                                    the score of the prefix before t)
      A_{i,t} = (G_{i,t} - mean) / sqrt(var + 1e-8) over the valid tokens of the batch.
    The paper trains with PPO; here the returns take the place of the critic's advantages (assumed, as the
    abstract fixes only the token reward).""" + _OPTS + """
    Shapes: red_token_reward [N, T], completion_mask [N, T], valid [N] -> [N, T].
    """
register("advantage", "red", source="RED: Unleashing Token-Level Rewards from Holistic Feedback via Reward "
         "Redistribution")(red)


def attention_credit(attention_token_reward: torch.Tensor, completion_mask: torch.Tensor,
                     valid: torch.Tensor | None = None, *, gamma: Annotated[float, Ge(0), Le(1)] = 1.0,
                     whiten: bool = True) -> torch.Tensor:
    v = torch.ones(completion_mask.shape[0], dtype=torch.bool) if valid is None else valid.bool()
    return token_return_advantage(attention_token_reward, completion_mask, v, gamma, whiten)


attention_credit.__doc__ = """A reward model's score spread over the tokens by its attention; A = whitened returns.

    "Dense Reward for Free in Reinforcement Learning from Human Feedback": the reward model's last-layer attention
    from the scoring position to the completion tokens redistributes its scalar R (potential-based shaping):
      r_{i,t} = beta * R_i * a_{i,t} + (1 - beta) * R_i * 1[t = last]   (``attention_token_reward``; sum_t = R_i)
      G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s};  A = G whitened over the batch's valid tokens.
    a_t: attention of the last token, mean over heads, renormalised over the completion's tokens; beta 1.0
    (assumed; see :func:`postrl.rewards.dense.attention_token_rewards`).""" + _OPTS + """
    Shapes: attention_token_reward [N, T], completion_mask [N, T], valid [N] -> [N, T].
    """
register("advantage", "attention_credit", source="Dense Reward for Free in Reinforcement Learning from Human "
         "Feedback")(attention_credit)
