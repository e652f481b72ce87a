"""Learned turn-level credit for multi-turn episodes: SPA's progress estimator, ArCHer's hierarchical critic and
OPRL's online implicit process reward model. Each is an advantage estimator (kind ``advantage``) with state.

Turn states. For episode i and model turn k (``turn_ends`` e_{i,k} >= 0; b_{i,k} = the turn's first model token),
the learned parts read the policy's last hidden state (``completion_hidden`` [N, T, H], detached, from a no-grad
forward: the field producer of GAE's value head):
    s_{i,k} = h[i, b_{i,k}]   the state before the turn (it has read the prompt and everything before the turn)
    x_{i,k} = h[i, e_{i,k}]   the state and the turn's action (everything up to the turn's last token)
(``h[i, t]`` is the hidden state at the position that predicts completion token t.)

State rule: ``__call__`` reads the learned part and never changes it; ``observe`` records the batch's turn
features and outcomes; ``end_step`` trains on every process's records (gathered, in rank order) with a seeded,
deterministic update, so every process holds the same weights; ``state_dict`` carries weights and optimizer (and
ArCHer's replay buffer) through checkpoints (``postrl.jsonstate``).
"""

from __future__ import annotations

import copy
import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Le

from postrl import jsonstate
from postrl.heads import ScalarHead, scalar_module
from postrl.advantages import masked_whiten
from postrl.advantages.turns import turn_mapo, turn_of_token
from postrl.errors import ConfigError
from postrl.groups import group_index, group_stats, valid_mask
from postrl.registry import register
from postrl.seeding import stable_hash
from postrl.stages import StepEnd, Stateful
from postrl.generation import left_pad
from postrl.logprobs import completion_logprobs


def turn_starts(turn_ends: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """b_{i,k} [N, K] long: the first model token of turn k (-1 for a turn the episode does not have)."""
    N = turn_ends.shape[0]
    T = completion_mask.shape[1]
    t = torch.arange(T)
    prev = torch.cat([torch.full((N, 1), -1, dtype=turn_ends.dtype), turn_ends[:, :-1]], 1)       # e_{k-1}
    inside = (t[None, None, :] > prev[:, :, None]) & (t[None, None, :] <= turn_ends[:, :, None]) \
        & (completion_mask[:, None, :] > 0)                                                        # [N, K, T]
    first = torch.where(inside, t, T).amin(-1)
    return torch.where((turn_ends >= 0) & (first < T), first, torch.full_like(first, -1))


def turn_features(hidden: torch.Tensor, turn_ends: torch.Tensor, completion_mask: torch.Tensor):
    """(s [N, K, H], x [N, K, H], has [N, K]): the hidden state before each turn and at its last token (module
    docstring), float32, detached; zeros where the episode has no such turn."""
    starts = turn_starts(turn_ends, completion_mask)
    has = (turn_ends >= 0) & (starts >= 0)
    H = hidden.shape[-1]
    h = hidden.detach().float()

    def at(pos: torch.Tensor) -> torch.Tensor:
        idx = pos.clamp(min=0)[:, :, None].expand(-1, -1, H)
        return torch.gather(h, 1, idx) * has[:, :, None]

    return at(starts), at(turn_ends), has


def _last(has: torch.Tensor) -> torch.Tensor:
    return has & ~torch.cat([has[:, 1:], torch.zeros((has.shape[0], 1), dtype=torch.bool)], 1)


# ================================================================================================ SPA


@register("advantage", "spa", source="SPA-RL: Reinforcing LLM Agents via Stepwise Progress Attribution",
          needs=("groups",))
class SPA(Stateful):
    """SPA's turn rewards (a learned progress estimator's per-turn contributions, summing to the outcome, plus a
    grounding signal) turned into token advantages by ``turn_mapo``.

    Progress estimator P (a scalar head on x_{i,k}, the state and action of turn k: module docstring) gives each
    turn a contribution c_{i,k} = P(x_{i,k}), trained so that the contributions of an episode add up to its outcome:
        L = mean_i (sum_k c_{i,k} - R_i)^2                    (R_i = ``reward``; valid episodes with a turn)
    With ``exact`` (default) the residual is spread evenly so the sum is exactly the outcome:
        c'_{i,k} = c_{i,k} + (R_i - sum_j c_{i,j}) / K_i       (an untrained estimator gives c' = R_i / K_i)
    Turn reward r_{i,k} = c'_{i,k} + ``grounding`` * g_{i,k}, g_{i,k} = 1 when the turn's action was carried out by
    the environment (none of its tool calls malformed or failed: ``turn_tool_errors`` + ``turn_malformed_calls``
    = 0), else 0. The advantage is ``turn_mapo`` on these turn rewards (``gamma``, ``mix``, ``scale``, ``eps`` as
    there). The estimator is trained at the end of each step: ``epochs`` (50) full-batch AdamW steps at ``lr``
    (1e-2) on the step's episodes (every process's); ``units`` 0 makes it linear (default), else one ReLU layer.
    After SPA-RL (assumed where the abstract gives no formula: the estimator reads the policy's hidden state at
    the turn's last token, not a separate LM; the even residual split; grounding 0.1 = 0/1 executability).
    Metrics ``advantage/spa/loss`` (before the step's fit), ``advantage/spa/abs_error`` (mean |sum c - R|).
    Shapes: reward [N], completion_hidden [N, T, H], turn_ends / turn_* [N, K], group_ids [N],
    completion_mask [N, T] -> [N, T].
    """

    def __init__(self, *, grounding: Annotated[float, Ge(0)] = 0.1, exact: bool = True,
                 lr: Annotated[float, Gt(0)] = 1e-2, epochs: Annotated[int, Ge(1)] = 50,
                 units: Annotated[int, Ge(0)] = 0, gamma: Annotated[float, Ge(0), Le(1)] = 1.0,
                 mix: Annotated[float, Ge(0), Le(1)] = 1.0, scale: Literal["group", "none"] = "group",
                 eps: Annotated[float, Gt(0)] = 1e-6):
        self.grounding, self.exact, self.lr, self.epochs, self.units = grounding, exact, lr, epochs, units
        self.turn_params = {"gamma": gamma, "mix": mix, "scale": scale, "eps": eps}
        self.head = ScalarHead(lr, units, name="postrl.credit.head")  # the progress estimator

    def contributions(self, x: torch.Tensor, has: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
        """c' [N, K] (0 outside the episode's turns): the estimator's contributions, made exact when ``exact``."""
        with torch.no_grad():
            c = self.head(x).double() * has
        if self.exact:
            k = has.sum(-1).clamp(min=1)
            R = torch.nan_to_num(reward.double(), nan=0.0)
            c = torch.where(has, c + ((R - c.sum(-1)) / k)[:, None], torch.zeros_like(c))
        return c

    def turn_rewards(self, reward, completion_hidden, turn_ends, turn_tool_errors, turn_malformed_calls,
                     completion_mask) -> torch.Tensor:
        """r [N, K] of the module docstring (NaN outside the episode's turns)."""
        _, x, has = turn_features(completion_hidden, turn_ends, completion_mask)
        c = self.contributions(x, has, reward)
        g = ((turn_tool_errors + turn_malformed_calls) == 0).double()
        r = c + self.grounding * g
        return torch.where(has, r, torch.full_like(r, math.nan))

    def __call__(self, reward: torch.Tensor, completion_hidden: torch.Tensor, turn_ends: torch.Tensor,
                 turn_tool_errors: torch.Tensor, turn_malformed_calls: torch.Tensor, group_ids: torch.Tensor,
                 completion_mask: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        r = self.turn_rewards(reward, completion_hidden, turn_ends, turn_tool_errors, turn_malformed_calls,
                              completion_mask)
        return turn_mapo(r, turn_ends, group_ids, completion_mask, reward, valid, **self.turn_params)

    def observe(self, reward: torch.Tensor, completion_hidden: torch.Tensor, turn_ends: torch.Tensor,
                turn_tool_errors: torch.Tensor, turn_malformed_calls: torch.Tensor, group_ids: torch.Tensor,
                completion_mask: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Record (turn features [K_i, H], outcome) of each valid episode with a turn."""
        _, x, has = turn_features(completion_hidden, turn_ends, completion_mask)
        v = valid_mask(reward, valid)
        for i in range(len(reward)):
            if v[i] and has[i].any():
                self.record((x[i][has[i]].clone(), float(reward[i])))

    def end_step(self, step: StepEnd) -> dict:
        if not self.observed:
            return {}
        feats = [f for f, _ in self.observed]
        R = torch.tensor([r for _, r in self.observed], dtype=torch.float32)
        flat = torch.cat(feats)
        owner = torch.cat([torch.full((len(f),), j, dtype=torch.long) for j, f in enumerate(feats)])
        def loss_now() -> torch.Tensor:
            c = self.head(flat)
            total = torch.zeros(len(feats)).index_add(0, owner, c)
            return ((total - R) ** 2).mean()

        first = None
        for _ in range(self.epochs):
            loss = loss_now()  # (the first call makes the head)
            self.head.optimizer.zero_grad(set_to_none=False)
            first = float(loss.detach()) if first is None else first
            loss.backward()
            self.head.optimizer.step()
        with torch.no_grad():
            total = torch.zeros(len(feats)).index_add(0, owner, self.head(flat))
        return {"loss": first, "abs_error": float((total - R).abs().mean())}

    def state_dict(self) -> dict:
        return self.head.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state)


# ================================================================================================ ArCHer


@register("advantage", "archer", source="ArCHer: Training Language Model Agents via Hierarchical Multi-Turn RL")
class ArCHer(Stateful):
    """ArCHer's hierarchy: an utterance-level critic trained off-policy by TD over turns; its turn advantage
    Q(s_k, a_k) - V(s_k) is every token's advantage within the turn (the token-level policy-gradient update).

    Critic: Q(x_{i,k}) and V(s_{i,k}), scalar heads on the turn features (module docstring), with target copies
    Q', V' (Polyak averaging, ``tau`` 0.1). Turn reward r_{i,k}: ``turn_reward='outcome'`` (default) the episode's
    ``reward`` on its last turn, 0 before; ``'environment'`` the environment's ``turn_rewards`` (NaN read as 0).
    TD over turns, on minibatches of ``batch_size`` (64) transitions drawn (seeded, without replacement) from a
    replay buffer of the last
    ``buffer_size`` (512) transitions of every process, ``critic_steps`` (20) AdamW steps at ``lr`` (1e-3) per RL
    step (off-policy: the buffer holds earlier policies' turns):
        L_Q = mean (Q(x_k) - [r_k + gamma (1 - d_k) V'(s_{k+1})])^2      (d_k = 1 on the episode's last turn)
        L_V = mean (V(s_k) - Q'(x_k))^2                                     (V regresses on the target Q of the
                                                                            logged action)
        Q' <- (1 - tau) Q' + tau Q,  V' <- (1 - tau) V' + tau V             (after each critic step)
    Advantage A_{i,t} = Q(x_{i,k(t)}) - V(s_{i,k(t)}) on the model tokens of turn k(t) (``turn_of_token``); 0 on
    environment tokens and invalid rows; ``whiten`` (False) whitens over the batch's model tokens. gamma 0.95.
    After ArCHer (assumed where the abstract gives no formula: heads on the policy's hidden states in place of
    separate critic LMs, V trained on the logged action's target Q, the last turn terminal, these defaults).
    Metrics ``advantage/archer/q_loss``, ``v_loss``, ``buffer``. The replay buffer is part of the checkpoint
    (``buffer_size`` x (2H + 3) numbers). Any group size.
    Shapes: reward [N], completion_hidden [N, T, H], turn_ends, turn_rewards [N, K], completion_mask [N, T] ->
    [N, T].
    """

    def __init__(self, *, gamma: Annotated[float, Ge(0), Le(1)] = 0.95, tau: Annotated[float, Gt(0), Le(1)] = 0.1,
                 lr: Annotated[float, Gt(0)] = 1e-3, critic_steps: Annotated[int, Ge(1)] = 20,
                 batch_size: Annotated[int, Ge(1)] = 64, buffer_size: Annotated[int, Ge(1)] = 512,
                 turn_reward: Literal["outcome", "environment"] = "outcome", whiten: bool = False,
                 units: Annotated[int, Ge(0)] = 0, seed: int = 0):
        self.gamma, self.tau, self.lr, self.critic_steps = gamma, tau, lr, critic_steps
        self.batch_size, self.buffer_size, self.turn_reward = batch_size, buffer_size, turn_reward
        self.whiten, self.units, self.seed = whiten, units, seed
        self.q = self.v = self.q_target = self.v_target = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.buffer: dict[str, torch.Tensor] = {}
        self.updates = 0

    def _make(self, dim: int) -> None:
        self.q, self.v = (scalar_module(dim, self.units, "postrl.credit.head") for _ in range(2))
        self.q_target, self.v_target = copy.deepcopy(self.q), copy.deepcopy(self.v)
        self.optimizer = torch.optim.AdamW([*self.q.parameters(), *self.v.parameters()], lr=self.lr,
                                           weight_decay=0.0)

    def turn_advantages(self, completion_hidden, turn_ends, completion_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q(x) - V(s) [N, K] float64 (0 outside the turns), has [N, K])."""
        s, x, has = turn_features(completion_hidden, turn_ends, completion_mask)
        if self.q is None:
            self._make(s.shape[-1])
        with torch.no_grad():
            a = (self.q(x) - self.v(s)).squeeze(-1).double()
        return torch.where(has, a, torch.zeros_like(a)), has

    def __call__(self, reward: torch.Tensor, completion_hidden: torch.Tensor, turn_ends: torch.Tensor,
                 turn_rewards: torch.Tensor, completion_mask: torch.Tensor,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        a, _ = self.turn_advantages(completion_hidden, turn_ends, completion_mask)
        v = valid_mask(reward, valid)
        k_t = turn_of_token(turn_ends, completion_mask.shape[1])
        mask = completion_mask.double() * v[:, None]
        adv = a.gather(1, k_t) * mask
        if self.whiten:
            adv = masked_whiten(adv, mask)
        return adv.float()

    def transitions(self, reward, completion_hidden, turn_ends, turn_rewards, completion_mask, valid=None) -> dict:
        """The batch's turn transitions (s, x, r, s_next, done) of valid episodes, as flat tensors."""
        s, x, has = turn_features(completion_hidden, turn_ends, completion_mask)
        v = valid_mask(reward, valid)
        last = _last(has)
        if self.turn_reward == "outcome":
            R = torch.nan_to_num(reward.double(), nan=0.0)[:, None].expand_as(last)
            r = torch.where(last, R, torch.zeros_like(R))
        else:
            r = torch.nan_to_num(turn_rewards.double(), nan=0.0)
        s_next = torch.cat([s[:, 1:], torch.zeros_like(s[:, :1])], 1)
        keep = has & v[:, None]
        return {"s": s[keep], "x": x[keep], "r": r[keep].float(), "s_next": s_next[keep],
                "done": last[keep].float()}

    def observe(self, reward: torch.Tensor, completion_hidden: torch.Tensor, turn_ends: torch.Tensor,
                turn_rewards: torch.Tensor, completion_mask: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        self.record(self.transitions(reward, completion_hidden, turn_ends, turn_rewards, completion_mask, valid))

    def add(self, batch: dict) -> None:
        """Append transitions to the replay buffer (the oldest leave beyond ``buffer_size``)."""
        for k, t in batch.items():
            old = self.buffer.get(k)
            self.buffer[k] = (t if old is None else torch.cat([old, t]))[-self.buffer_size:]

    def td_step(self, idx: torch.Tensor) -> tuple[float, float]:
        """One critic step on the buffer's transitions ``idx``; (L_Q, L_V)."""
        b = {k: t[idx] for k, t in self.buffer.items()}
        with torch.no_grad():
            target_q = b["r"] + self.gamma * (1 - b["done"]) * self.v_target(b["s_next"]).squeeze(-1)
            target_v = self.q_target(b["x"]).squeeze(-1)
        self.optimizer.zero_grad(set_to_none=False)
        lq = ((self.q(b["x"]).squeeze(-1) - target_q) ** 2).mean()
        lv = ((self.v(b["s"]).squeeze(-1) - target_v) ** 2).mean()
        (lq + lv).backward()
        self.optimizer.step()
        with torch.no_grad():
            for net, tgt in ((self.q, self.q_target), (self.v, self.v_target)):
                for p, pt in zip(net.parameters(), tgt.parameters()):
                    pt.mul_(1 - self.tau).add_(p, alpha=self.tau)
        return float(lq.detach()), float(lv.detach())

    def end_step(self, step: StepEnd) -> dict:
        for batch in self.observed:
            if len(batch["r"]):
                self.add(batch)
        n = len(self.buffer.get("r", ()))
        if not n:
            return {}
        if self.q is None:
            self._make(self.buffer["s"].shape[-1])
        lq = lv = 0.0
        for _ in range(self.critic_steps):
            gen = torch.Generator().manual_seed(stable_hash(self.seed, self.updates) % 2**63)
            idx = torch.randperm(n, generator=gen)[:self.batch_size]
            lq, lv = self.td_step(idx)
            self.updates += 1
        return {"q_loss": lq, "v_loss": lv, "buffer": float(n)}

    def state_dict(self) -> dict:
        if self.q is None:
            return {}
        nets = {k: getattr(self, k).state_dict() for k in ("q", "v", "q_target", "v_target")}
        return jsonstate.encode({"nets": nets, "optimizer": self.optimizer.state_dict(), "buffer": self.buffer,
                                 "updates": self.updates})

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        st = jsonstate.decode(state)
        w = next(v for k, v in st["nets"]["q"].items() if k.endswith("weight"))
        self._make(w.shape[-1])
        for k in ("q", "v", "q_target", "v_target"):
            getattr(self, k).load_state_dict(st["nets"][k])
        self.optimizer.load_state_dict(st["optimizer"])
        self.buffer, self.updates = dict(st["buffer"]), int(st["updates"])


# ================================================================================================ OPRL

def _prm_check(params: dict, run, where: str) -> dict:
    from pathlib import Path

    path = params.get("prm_model")
    if path is not None and not (Path(str(path)) / "config.json").is_file():
        raise ConfigError(f"{where}.prm_model: '{path}' is not a model folder (no config.json)")
    return params


def _load_lm(path: str):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"advantage.prm_model: '{path}' is not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@register("advantage", "oprl", source="Online Process Reward Learning for Agentic Reinforcement Learning",
          needs=("groups",), check=_prm_check)
class OPRL(Stateful):
    """OPRL: an implicit process reward model trained online by trajectory-level DPO; its per-turn rewards
    beta log(pi_prm / pi_ref) give step advantages added to the episode's GRPO advantage.

    The PRM pi_prm is a causal LM (``prm_model``: its initial folder, sharing the policy's tokenizer; the paper
    starts it from the policy's model, so give the policy's folder) and pi_ref a frozen copy of its initial weights.
    For episode i and turn k (model tokens t of the turn, environment tokens excluded):
        r_{i,k} = beta * sum_{t in turn k} [log pi_prm(o_t | q, o_<t) - log pi_ref(o_t | q, o_<t)]
        A^E_i = (R_i - mean_g R) / (std_g R + eps)                  (the outcome ``reward``, GRPO within the group)
        A^S_{i,k} = (r_{i,k} - mean_g r) / (std_g r + eps)          (over every (episode, turn) of the group g)
        A_{i,t} = A^E_i + ``step_weight`` * A^S_{i,k(t)}            on model tokens; 0 elsewhere and on invalid rows
    The PRM learns at the end of each step from the step's episodes (every process's): within each group, pairs
    (tau+, tau-) with R+ > R- (at most ``max_pairs`` per group, in batch order) and the trajectory-level DPO loss
        L = -log sigmoid(beta [sum_t (log pi_prm - log pi_ref)(tau+) - sum_t (log pi_prm - log pi_ref)(tau-)])
    for ``epochs`` (1) passes of AdamW at ``lr`` in minibatches of ``pair_batch`` pairs, so the turn rewards sum to
    the trajectory's implicit reward (the DPO-consistent, potential-based credit of the paper). beta 0.05, lr 1e-6,
    step_weight 1.0, eps 1e-6 (assumed: the abstract gives no constants; the group normalisation of step rewards and
    the additive combination are the most direct reading of "combined with episode-level advantages").
    The PRM runs on the CPU in this process; its weights and optimizer are in the checkpoint (a PRM is a whole LM:
    use a small one). Metrics ``advantage/oprl/dpo_loss``, ``pair_accuracy`` (before the update), ``pairs``.
    Shapes: reward [N], prompt_ids / prompt_mask [N, P], completion_ids / completion_mask [N, T], turn_ends [N, K],
    group_ids [N] -> [N, T].
    """

    def __init__(self, *, prm_model: str, beta: Annotated[float, Gt(0)] = 0.05,
                 step_weight: Annotated[float, Ge(0)] = 1.0, lr: Annotated[float, Gt(0)] = 1e-6,
                 epochs: Annotated[int, Ge(1)] = 1, max_pairs: Annotated[int, Ge(1)] = 8,
                 pair_batch: Annotated[int, Ge(1)] = 8, scale: Literal["group", "none"] = "group",
                 eps: Annotated[float, Gt(0)] = 1e-6):
        self.path, self.beta, self.step_weight, self.lr = str(prm_model), beta, step_weight, lr
        self.epochs, self.max_pairs, self.pair_batch, self.scale, self.eps = epochs, max_pairs, pair_batch, scale, eps
        self.prm = self.ref = None
        self.optimizer: torch.optim.Optimizer | None = None

    def _ensure(self) -> None:
        if self.prm is None:
            self.prm, self.ref = _load_lm(self.path), _load_lm(self.path)
            for p in self.ref.parameters():
                p.requires_grad_(False)
            self.optimizer = torch.optim.AdamW(self.prm.parameters(), lr=self.lr, weight_decay=0.0)

    def _logratio(self, prompt_ids, prompt_mask, completion_ids, grad: bool = False) -> torch.Tensor:
        """log pi_prm - log pi_ref per completion token [n, T] (temperature 1)."""
        self._ensure()
        vocab = self.prm.get_output_embeddings().weight.shape[0]
        top = int(max(completion_ids.max(), prompt_ids.max())) if completion_ids.numel() else 0
        if top >= vocab:
            raise ConfigError(f"advantage.prm_model: its vocabulary ({vocab}) does not cover the policy's token ids "
                              f"(up to {top}); the PRM must share the policy's tokenizer")
        with torch.no_grad():
            ref = completion_logprobs(self.ref, prompt_ids, prompt_mask, completion_ids, 1.0)[0]
        with torch.set_grad_enabled(grad):
            lp = completion_logprobs(self.prm, prompt_ids, prompt_mask, completion_ids, 1.0)[0]
        return lp - ref

    def step_rewards(self, prompt_ids, prompt_mask, completion_ids, completion_mask, turn_ends) -> torch.Tensor:
        """r [N, K] = beta * the turn's summed log-ratio (NaN outside the episode's turns)."""
        lr = self._logratio(prompt_ids, prompt_mask, completion_ids).double() * completion_mask.double()
        K = turn_ends.shape[1]
        k_t = turn_of_token(turn_ends, completion_mask.shape[1])
        r = torch.zeros((len(lr), K), dtype=torch.float64).scatter_add(1, k_t, lr) * self.beta
        return torch.where(turn_ends >= 0, r, torch.full_like(r, math.nan))

    def __call__(self, reward: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 completion_ids: torch.Tensor, completion_mask: torch.Tensor, turn_ends: torch.Tensor,
                 group_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        N, K = turn_ends.shape
        v = valid_mask(reward, valid)
        inv, _ = group_index(group_ids)
        R = torch.nan_to_num(reward.double(), nan=0.0)
        mean, std, _ = group_stats(R, inv, v)
        ae = R - mean
        if self.scale == "group":
            ae = ae / (std + self.eps)
        r = self.step_rewards(prompt_ids, prompt_mask, completion_ids, completion_mask, turn_ends)
        ok = (turn_ends >= 0) & v[:, None]
        smean, sstd, _ = group_stats(torch.nan_to_num(r, nan=0.0).flatten(), inv[:, None].expand(N, K).flatten(),
                                     ok.flatten())
        a_s = torch.nan_to_num(r, nan=0.0).flatten() - smean
        if self.scale == "group":
            a_s = a_s / (sstd + self.eps)
        a_s = torch.where(ok.flatten(), a_s, torch.zeros_like(a_s)).reshape(N, K)
        k_t = turn_of_token(turn_ends, completion_mask.shape[1])
        adv = (ae[:, None] + self.step_weight * a_s.gather(1, k_t)) * completion_mask.double() * v[:, None]
        return adv.float()

    def observe(self, reward: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                completion_ids: torch.Tensor, completion_mask: torch.Tensor, turn_ends: torch.Tensor,
                group_ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Record (group, outcome, prompt ids, completion ids, loss mask) of each valid episode."""
        v = valid_mask(reward, valid)
        for i in range(len(reward)):
            if v[i]:
                L = int(torch.nonzero(completion_mask[i]).max()) + 1 if completion_mask[i].any() else 0
                self.record((int(group_ids[i]), float(reward[i]), prompt_ids[i][prompt_mask[i].bool()].tolist(),
                             completion_ids[i, :L].tolist(), completion_mask[i, :L].tolist()))

    def pairs(self, records: list) -> list[tuple[int, int]]:
        """(chosen, rejected) record indices: within each group, R_chosen > R_rejected, at most ``max_pairs``."""
        groups: dict[int, list[int]] = {}
        for j, rec in enumerate(records):
            groups.setdefault(rec[0], []).append(j)
        out = []
        for members in groups.values():
            found = [(a, b) for a in members for b in members if records[a][1] > records[b][1]]
            out += found[:self.max_pairs]
        return out

    def _tensors(self, recs: list):
        p_ids, p_mask = left_pad([r[2] for r in recs], 0)
        W = max(max(len(r[3]) for r in recs), 1)
        c_ids = torch.zeros((len(recs), W), dtype=torch.long)
        c_mask = torch.zeros((len(recs), W))
        for j, r in enumerate(recs):
            c_ids[j, :len(r[3])] = torch.tensor(r[3], dtype=torch.long)
            c_mask[j, :len(r[4])] = torch.tensor(r[4])
        return p_ids, p_mask, c_ids, c_mask

    def end_step(self, step: StepEnd) -> dict:
        recs = list(self.observed)
        pairs = self.pairs(recs)
        if not pairs:
            return {"pairs": 0.0}
        self._ensure()
        losses, correct = [], 0
        for epoch in range(self.epochs):
            for a in range(0, len(pairs), self.pair_batch):
                chunk = pairs[a:a + self.pair_batch]
                p_ids, p_mask, c_ids, c_mask = self._tensors([recs[c] for c, _ in chunk] + [recs[r] for _, r in chunk])
                s = (self._logratio(p_ids, p_mask, c_ids, grad=True) * c_mask).sum(-1)
                margin = self.beta * (s[:len(chunk)] - s[len(chunk):])
                loss = -torch.nn.functional.logsigmoid(margin).mean()
                self.optimizer.zero_grad(set_to_none=False)
                loss.backward()
                self.optimizer.step()
                if epoch == 0:
                    losses.append(float(loss.detach()) * len(chunk))
                    correct += int((margin.detach() > 0).sum())
        return {"dpo_loss": sum(losses) / len(pairs), "pair_accuracy": correct / len(pairs),
                "pairs": float(len(pairs))}

    def state_dict(self) -> dict:
        if self.prm is None:
            return {}
        return jsonstate.encode({"prm": self.prm.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self._ensure()
        st = jsonstate.decode(state)
        self.prm.load_state_dict(st["prm"])
        self.optimizer.load_state_dict(st["optimizer"])
