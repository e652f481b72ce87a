"""Turn-level advantages for multi-turn episodes (``postrl.environments.episodes``): each model turn's tokens get the
advantage of that turn's return, normalised among the episodes of the same prompt at the same turn."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge, Le

from postrl.advantages import Eps
from postrl.groups import group_index, group_stats, valid_mask
from postrl.registry import register


def turn_of_token(turn_ends: torch.Tensor, T: int) -> torch.Tensor:
    """[N, T] long: the model turn each completion token belongs to, k(t) = #{k : 0 <= e_k < t} (an
    observation's tokens count with the turn after them; tokens after the last turn get the last index)."""
    t = torch.arange(T)
    before = (turn_ends[:, None, :] < t[None, :, None]) & (turn_ends[:, None, :] >= 0)
    return before.sum(-1).clamp(max=max(turn_ends.shape[1] - 1, 0))


def _last_turn(has: torch.Tensor) -> torch.Tensor:
    """[N, K] bool: the episode's last turn (``has``: the turns the episode has)."""
    return has & ~torch.cat([has[:, 1:], torch.zeros((has.shape[0], 1), dtype=torch.bool)], 1)


@register("advantage", "turn_mapo", source="MAPO: Mixed Advantage Policy Optimization for Long-Horizon Multi-Turn "
          "Dialogue (turn level); G-RA: Stabilizing Long-term Multi-turn RL with Gated Rewards", needs=("groups",))
def turn_mapo(turn_rewards: torch.Tensor, turn_ends: torch.Tensor, group_ids: torch.Tensor,
              completion_mask: torch.Tensor, reward: torch.Tensor, valid: torch.Tensor | None = None, *,
              gamma: Annotated[float, Ge(0), Le(1)] = 1.0, mix: Annotated[float, Ge(0), Le(1)] = 1.0,
              gate: float | None = None, scale: Literal["group", "none"] = "group", eps: Eps = 1e-6) -> torch.Tensor:
    """Token advantages [N, T] from per-turn returns: A_{i,t} = A_{i,k(t)} on model tokens.

    For episode i with turns k = 0..K_i-1 (``turn_ends`` >= 0) and environment rewards r_{i,k} (``turn_rewards``,
    NaN read as 0):
      G-RA gate (``gate`` not None): r'_{i,k} = r_{i,k} * 1[R_i >= gate] for k < K_i - 1, r'_{i,K_i-1} = r_{i,K_i-1}
          (immediate rewards accumulate only when the episode's long-term reward R_i = ``reward`` meets the gate)
      G_{i,k} = sum_{j >= k} gamma^(j-k) r'_{i,j}                          (the turn's return)
      A_{i,k} = mix * (G_{i,k} - mean_c G) / (std_c G + eps) + (1 - mix) * (G_{i,k} - mean_B G) / (std_B G + eps)
    c = the cell (group of i, turn k): the episodes of the same prompt at the same turn, MAPO's turn-level
    normalisation; B = every valid (episode, turn); unbiased stds. ``scale='none'`` drops the divisions (centring
    only). mix=1 (default) is turn-level GRPO, mix=0 batch whitening of returns. Assumed (the abstracts leave them
    open): the cell definition, gamma 1, eps 1e-6. k(t): :func:`turn_of_token`. Rows with ``valid`` False or a
    non-finite ``reward`` get 0; observation tokens are 0 (``completion_mask``).
    Shapes: turn_rewards [N, K], turn_ends [N, K], group_ids [N], completion_mask [N, T], reward [N] -> [N, T].
    """
    N, K = turn_ends.shape
    v = valid_mask(reward, valid)
    has = turn_ends >= 0
    r = torch.where(has, torch.nan_to_num(turn_rewards.to(torch.float64), nan=0.0), torch.zeros((N, K),
                                                                                              dtype=torch.float64))
    if gate is not None:
        last = _last_turn(has)
        ok = (torch.nan_to_num(reward.to(torch.float64), nan=-float("inf")) >= gate)[:, None]
        r = torch.where(last | ok, r, torch.zeros_like(r))
    G = r.clone()
    for k in range(K - 2, -1, -1):  # G_k = r'_k + gamma G_{k+1} (K is at most environment.max_turns)
        G[:, k] += gamma * G[:, k + 1]
    inv, _ = group_index(group_ids)
    cell = (inv[:, None] * K + torch.arange(K)[None, :]).flatten()
    g, ok = G.flatten(), (has & v[:, None]).flatten()
    mean, std, _ = group_stats(g, cell, ok)
    turn = g - mean
    if scale == "group":
        turn = turn / (std + eps)
    gv = g[ok]
    bmean = gv.mean() if gv.numel() else torch.zeros((), dtype=torch.float64)
    batch = g - bmean
    if scale == "group":
        batch = batch / ((gv.std() if gv.numel() > 1 else torch.zeros((), dtype=torch.float64)) + eps)
    adv = torch.where(ok, mix * turn + (1 - mix) * batch, torch.zeros_like(g)).reshape(N, K)
    k_t = turn_of_token(turn_ends, completion_mask.shape[1])
    return (adv.gather(1, k_t) * completion_mask.to(torch.float64)).to(torch.float32)


@register("advantage", "turn_igpo", source="Information Gain-based Policy Optimization: A Simple and Effective "
          "Approach for Multi-Turn LLM Agents (IGPO)", needs=("groups",))
def turn_igpo(turn_info_gain: torch.Tensor, turn_ends: torch.Tensor, group_ids: torch.Tensor,
              completion_mask: torch.Tensor, reward: torch.Tensor, valid: torch.Tensor | None = None, *,
              gamma: Annotated[float, Ge(0), Le(1)] = 1.0, scale: Literal["group", "none"] = "group",
              eps: Eps = 1e-6) -> torch.Tensor:
    """IGPO token advantages [N, T]: dense turn rewards (information gain, outcome on the last turn), group
    normalised, discounted returns per turn, broadcast to the turn's model tokens.

    For episode i with turns k = 0..K_i-1 (``turn_ends`` >= 0):
      r_{i,k} = IG_{i,k} for k < K_i - 1     (``turn_info_gain``: pi(a* | q, h_k) - pi(a* | q, h_{k-1}), a probability
                                             increase, :func:`postrl.fields.turn_info_gain`; non-finite read as 0)
      r_{i,K_i-1} = R_i                      (the outcome ``reward``: the answer turn is scored by the outcome)
      r^_{i,k} = (r_{i,k} - mean_g r) / (std_g r + eps)   over every valid (episode, turn) of the group g of i
                                             (the turn rewards and the outcomes of the group together; unbiased std)
      A_{i,k} = sum_{j >= k} gamma^(j-k) r^_{i,j},  A_{i,t} = A_{i,k(t)} on model tokens (:func:`turn_of_token`)
    ``scale='none'`` centres without dividing. Assumed (the abstract leaves them open): the joint normalisation of
    intrinsic and outcome rewards in the group, gamma 1, eps 1e-6. ``answer_column`` and ``answer_prob`` are the
    producer's parameters. Rows with ``valid`` False or a non-finite ``reward`` get 0; observation tokens get 0.
    Shapes: turn_info_gain [N, K], turn_ends [N, K], group_ids [N], completion_mask [N, T], reward [N] -> [N, T].
    """
    N, K = turn_ends.shape
    v = valid_mask(reward, valid)
    has = turn_ends >= 0
    last = _last_turn(has)
    ig = torch.nan_to_num(turn_info_gain.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    R = torch.nan_to_num(reward.to(torch.float64), nan=0.0)[:, None].expand(N, K)
    r = torch.where(last, R, torch.where(has, ig, torch.zeros_like(ig)))
    ok = has & v[:, None]
    inv, _ = group_index(group_ids)
    mean, std, _ = group_stats(r.flatten(), inv[:, None].expand(N, K).flatten(), ok.flatten())
    rn = r.flatten() - mean
    if scale == "group":
        rn = rn / (std + eps)
    rn = torch.where(ok.flatten(), rn, torch.zeros_like(rn)).reshape(N, K)
    G = rn.clone()
    for k in range(K - 2, -1, -1):  # G_k = r^_k + gamma G_{k+1} (K is at most environment.max_turns)
        G[:, k] += gamma * G[:, k + 1]
    k_t = turn_of_token(turn_ends, completion_mask.shape[1])
    return (G.gather(1, k_t) * completion_mask.to(torch.float64)).to(torch.float32)
