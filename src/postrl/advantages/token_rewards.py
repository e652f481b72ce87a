"""Advantage estimators over token rewards [N, T]: RED and attention credit (a reward model), DRLC (an LLM critic),
teacher forcing (a separately trained MLE model), occlusion credit (the run's reward, attributed by occlusion).

The token rewards are batch fields produced from the estimator's own model: ``red_token_reward`` and
``attention_token_reward`` from a reward model folder (``reward_model``, written by ``postrl rm train``;
:mod:`postrl.rewards.dense`), whose score replaces the run's scalar reward; ``critic_token_reward`` from a critic
(:mod:`postrl.rewards.critic`) and ``mle_token_reward`` from an MLE model (:mod:`postrl.rewards.teacher`), which
may be added to the run's scalar reward on the last token (``outcome_coef``); ``occlusion_token_reward`` from
the run's own rewards re-scored on occluded copies (:mod:`postrl.shaping.attribution`).
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge, Le

from postrl.advantages import masked_whiten
from postrl.errors import ConfigError
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


# ------------------------------------------------------------------------------------------------ dense + outcome
def dense_plus_outcome(token_rewards: torch.Tensor, reward: torch.Tensor | None, completion_mask: torch.Tensor,
                       valid: torch.Tensor | None, dense_coef: float, outcome_coef: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(r [N, T], valid [N]): r_{i,t} = dense_coef * tok_{i,t} + outcome_coef * R_i * 1[t = last token of i]; a row
    whose token rewards hold a NaN (a failed producer row) or whose R is NaN (when used) is not valid."""
    m = completion_mask.to(torch.float64)
    tok = token_rewards.to(torch.float64)
    v = torch.ones(m.shape[0], dtype=torch.bool) if valid is None else valid.bool().clone()
    v &= ~torch.isnan(torch.where(m > 0, tok, torch.zeros_like(tok))).any(-1)
    r = dense_coef * torch.nan_to_num(tok) * m
    if outcome_coef:
        if reward is None:
            raise ValueError("advantage: outcome_coef > 0 needs the batch's scalar reward")
        R = reward.to(torch.float64)
        v &= torch.isfinite(R)
        last = (m.sum(-1).long() - 1).clamp(min=0)
        bonus = torch.zeros_like(r)
        bonus[torch.arange(r.shape[0]), last] = torch.nan_to_num(R) * (m.sum(-1) > 0).to(torch.float64)
        r = r + outcome_coef * bonus
    return r, v


def _one_critic(params: dict, run, where: str) -> dict:
    """``critic_dense``: exactly one of the producer's ``critic`` (an import path) and ``critic_url``."""
    if (params.get("critic") is None) == (params.get("critic_url") is None):
        raise ConfigError(f"{where}: set exactly one of critic (a function 'module:function' (system, user) -> "
                          "reply) and critic_url (an OpenAI-compatible endpoint)")
    return params


@register("advantage", "critic_dense", source="DRLC: Reinforcement Learning with Dense Rewards from LLM Critic",
          check=_one_critic)
def critic_dense(critic_token_reward: torch.Tensor, reward: torch.Tensor, completion_mask: torch.Tensor,
                 valid: torch.Tensor | None = None, *, dense_coef: Annotated[float, Ge(0)] = 1.0,
                 outcome_coef: Annotated[float, Ge(0)] = 1.0, gamma: Annotated[float, Ge(0), Le(1)] = 1.0,
                 whiten: bool = True) -> torch.Tensor:
    """DRLC: an LLM critic's span scores as dense token rewards, plus the holistic reward; A = whitened returns.

    "DRLC" (the abstract: a critic LM, prompted with the task description, the question, the policy's output and
    the environment's reward, "provides token or span-level dense rewards that reflect the quality of each segment
    of the output", used alongside the holistic reward in PPO):
      c_{i,t}   = the critic's span scores spread onto the tokens (``critic_token_reward``,
                  :mod:`postrl.rewards.critic`: 'uniform' splits a span's score over its tokens)
      r_{i,t}   = dense_coef * c_{i,t} + outcome_coef * R_i * 1[t = last token]     (R: the run's scalar reward)
      G_{i,t}   = sum_{s >= t} gamma^(s - t) r_{i,s};  A = G whitened over the batch's valid tokens (``whiten``)
    Defaults: dense_coef 1, outcome_coef 1, gamma 1, whiten True. The paper trains with PPO and a value function;
    here the returns take the critic's place (as ``red`` does). A row whose critic call failed (NaN) or whose
    reward failed gets 0. The producer's options (set in this entry): ``critic`` (a function (system, user) ->
    reply, by import path; a policy that critiques itself is the paper's "self-critique") or ``critic_url`` +
    ``critic_model`` (an endpoint), ``critic_task`` (the task description), ``critic_spread``
    (uniform | each | last), ``critic_api_key_env``, ``critic_timeout``, ``critic_concurrency``,
    ``critic_max_tokens``; exactly one of critic and critic_url.
    Shapes: critic_token_reward [N, T], reward [N], completion_mask [N, T], valid [N] -> [N, T].
    """
    r, v = dense_plus_outcome(critic_token_reward, reward, completion_mask, valid, dense_coef, outcome_coef)
    return token_return_advantage(r, completion_mask, v, gamma, whiten)


@register("advantage", "teacher_forcing", source="Teacher Forcing Recovers Reward Functions for Text Generation")
def teacher_forcing(mle_token_reward: torch.Tensor, completion_mask: torch.Tensor, reward: torch.Tensor | None = None,
                    valid: torch.Tensor | None = None, *, outcome_coef: Annotated[float, Ge(0)] = 0.0,
                    gamma: Annotated[float, Ge(0), Le(1)] = 1.0, whiten: bool = True) -> torch.Tensor:
    """Step-wise rewards induced by a teacher-forced model, r_t = log p_MLE(y_t | x, y_<t); A = whitened returns.

    "Teacher Forcing Recovers Reward Functions for Text Generation" (the abstract: a task-agnostic step-wise reward
    "derived directly from a model trained with teacher forcing"):
      r_{i,t} = log p_MLE(y_t | x, y_<t)   (``mle_token_reward``, :mod:`postrl.rewards.teacher`, from the
                                           separately trained model ``mle_model``, not the policy)
                + outcome_coef * R_i * 1[t = last token]   (default 0: the induced reward alone)
      G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s};  A = G whitened over the batch's valid tokens (``whiten``)
    ``mle_form='soft_q'`` reads the MLE logits as a soft Q-function instead (r_t = f(y_t|s_t) - logsumexp
    f(.|s_{t+1})), which differs from the log-prob by a potential-based term (the same optimal policy). The
    paper's modification for non-parallel data (its stabilisation) is not included. Producer options (set in this
    entry): ``mle_model`` (required: a folder written by save_pretrained), ``mle_form`` (logprob | soft_q),
    ``mle_device`` ('cpu'), ``mle_batch_size`` (8).
    Shapes: mle_token_reward [N, T], completion_mask [N, T], reward [N], valid [N] -> [N, T].
    """
    r, v = dense_plus_outcome(mle_token_reward, reward, completion_mask, valid, 1.0, outcome_coef)
    return token_return_advantage(r, completion_mask, v, gamma, whiten)


@register("advantage", "occlusion_credit", source="Learning Explainable Dense Reward Shapes via Bayesian Optimization")
def occlusion_credit(occlusion_token_reward: torch.Tensor, completion_mask: torch.Tensor,
                     valid: torch.Tensor | None = None, *, gamma: Annotated[float, Ge(0), Le(1)] = 1.0,
                     whiten: bool = True) -> torch.Tensor:
    """The sequence reward spread over the tokens by occlusion attribution (sum_t r_t = R); A = whitened returns.

    After "Learning Explainable Dense Reward Shapes via Bayesian Optimization":
      r_{i,t} = beta * c_{u(t)} / |u(t)| + (1 - beta) * R_i * 1[t = last]   (``occlusion_token_reward``,
                c_u = R~ - R(-u) made additive so that sum_u c_u = R_i; :mod:`postrl.shaping.attribution`)
      G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s};  A = G whitened over the batch's valid tokens (``whiten``).
    The occluded rewards come from the run's own rewards and shaping, re-scored on occluded copies of each row
    (``ModelContext.score``). Options: ``gamma`` 1.0, ``whiten`` True; the producer's (set in this entry):
    ``unit`` ('span' | 'step'), ``span`` (1: every token), ``delimiter`` ("\\n\\n", for steps), ``source``
    (None: the scalar reward; or a raw reward column), ``beta`` (0.5). Works with any group size. Rows with
    ``valid`` False, or whose reward or occluded rewards failed, get 0.
    Shapes: occlusion_token_reward [N, T], completion_mask [N, T], valid [N] -> [N, T].
    """
    r, v = dense_plus_outcome(occlusion_token_reward, None, completion_mask, valid, 1.0, 0.0)
    return token_return_advantage(r, completion_mask, v, gamma, whiten)
