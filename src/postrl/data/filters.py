"""Data filters and prompt selection (kinds ``filter`` and ``selector``; config ``filters: [...]``).

Two kinds of stages, each with its own protocol (``postrl.stages``; the step's batch is assembled by
``postrl.train.sampling``, which calls each hook once per step):

* keep-mask filters (kind ``filter``, functions): ``fn(<batch fields>, *, <params>) -> bool [N]`` on the scored batch; rows with
  False are dropped. A filter with a ``max_attempts`` parameter asks the trainer to *refill*: it generates more
  prompts (fresh prompts drawn with a seed derived from (seed, step, attempt)), scores and filters them, until the
  batch holds as many groups as an unfiltered batch would, or ``max_attempts`` generation rounds were made. When the
  cap is hit, the shortfall is filled with dropped groups whose rows are masked (``valid`` False: advantage 0, no
  loss), a warning is logged and ``filter/cap_hit`` = 1. So every batch has the same number of groups, and under
  DDP every process ends with the same number of rows (the trainer also pads the shortest process with masked
  copies of rows when expansions make the counts differ); nothing silently shrinks.
  They judge the RAW reward column (``reward``, default ``correct``), never the shaped scalar reward.
* prompt selectors (kind ``selector``, :class:`PromptSelector`): choose the step's prompts from a candidate pool of
  ``pool_factor`` x ``prompts_per_step`` rows, before any rollout. Their running statistics are updated by
  ``update`` with the per-group outcomes of every process (gathered), so every process holds the same state and
  makes the same selection; the state is saved in checkpoints (``state_dict`` / ``load_state_dict``).
The rollout options (kinds ``sampling`` and ``expansion``) are in ``postrl.data.rollout_options``.
"""

from __future__ import annotations

import math

import torch

from postrl import jsonstate
from postrl.advantages import group_index, group_sum
from postrl.data.base import stable_hash
from postrl.registry import register
from postrl.stages import Stateful


def raw_column(rewards: torch.Tensor, reward_names: list, name: str, what: str,
               raw_rewards: torch.Tensor | None = None, raw_reward_names: tuple | None = None) -> torch.Tensor:
    """The raw reward column ``name`` [N] (NaN where that source failed): from the matrix as the sources returned
    it (the batch field ``raw_rewards``, kept by the trainer before shaping) when given, so a shaping stage that
    rewrites or appends columns changes nothing here; else from ``rewards``."""
    if raw_rewards is not None and raw_reward_names is not None:
        rewards, reward_names = raw_rewards, raw_reward_names
    names = list(reward_names)
    if name not in names:
        raise ValueError(f"{what}.reward: no reward source named '{name}' in this run; rewards: {', '.join(names)}")
    return rewards[:, names.index(name)]


def _group_moments(x: torch.Tensor, group_ids: torch.Tensor):
    """(per-row group mean, min, max, count) over the finite entries of x."""
    inv, ng = group_index(group_ids)
    ok = torch.isfinite(x)
    xd = torch.where(ok, x.to(torch.float64), torch.zeros_like(x, dtype=torch.float64))
    cnt = group_sum(ok.to(torch.float64), inv, ng)
    mean = group_sum(xd, inv, ng) / cnt.clamp(min=1)
    hi = torch.full((ng,), -math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(ok, xd, torch.full_like(xd, -math.inf)), "amax")
    lo = torch.full((ng,), math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(ok, xd, torch.full_like(xd, math.inf)), "amin")
    return mean[inv], lo[inv], hi[inv], cnt[inv]


# ------------------------------------------------------------------------------------------------ keep masks
@register("filter", "dynamic_sampling", source="DAPO (Yu et al. 2025) dynamic sampling; verl algorithm.filter_groups",
          needs=("groups",))
def dynamic_sampling(rewards: torch.Tensor, reward_names: list, group_ids: torch.Tensor,
                     raw_rewards: torch.Tensor | None = None, raw_reward_names: tuple | None = None, *,
                     reward: str = "correct", max_attempts: int = 10) -> torch.Tensor:
    """Keep the groups whose raw verifiable reward varies (std > 0); the trainer regenerates until the batch is full.

    DAPO ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale"): a group whose completions are all
    right or all wrong has zero advantage under group normalisation; it is dropped and more prompts are sampled
    (verl ``algorithm.filter_groups.enable=True, metric=acc``, ``max_num_gen_batches`` = ``max_attempts``,
    default 10). Judged on the raw column ``reward`` (default 'correct'), never on the shaped reward (a length or
    format term must not make an all-wrong group look informative): the column as the reward source returned it
    (``raw_rewards``), untouched by shaping stages. NaN entries (failed rewards) are ignored; a group with fewer
    than two finite values has no variance and is dropped.
    Shapes: rewards [N, K], reward_names [K], group_ids [N] (raw_rewards [N, K']) -> keep [N] bool.
    """
    if max_attempts < 1:
        raise ValueError(f"filters.dynamic_sampling.max_attempts: expected an integer >= 1, got {max_attempts}")
    x = raw_column(rewards, reward_names, reward, "filters.dynamic_sampling", raw_rewards, raw_reward_names)
    _, lo, hi, cnt = _group_moments(x, group_ids)
    return (cnt >= 2) & (hi > lo)


@register("filter", "range_filter", source="OpenRLHF --dynamic_filtering --dynamic_filtering_reward_range")
def range_filter(rewards: torch.Tensor, reward_names: list, group_ids: torch.Tensor,
                 raw_rewards: torch.Tensor | None = None, raw_reward_names: tuple | None = None, *,
                 reward: str = "correct", low: float = 0.0, high: float = 1.0, max_attempts: int = 10) -> torch.Tensor:
    """Keep the groups whose mean raw reward lies strictly inside (low, high); regenerate until the batch is full.

    OpenRLHF dynamic filtering: ``low + 1e-6 < mean_g r < high - 1e-6`` (``dynamic_filtering_reward_range``,
    default (0, 1): drops all-wrong and all-right groups of a 0/1 reward). Raw column ``reward`` (default
    'correct', before shaping); NaN entries ignored, a group with no finite value dropped. ``max_attempts``
    (default 10) as dynamic_sampling; 1 = filter without regenerating (the shortfall is masked).
    Shapes: rewards [N, K], reward_names [K], group_ids [N] -> keep [N] bool.
    """
    if not low < high:
        raise ValueError(f"filters.range_filter: expected low < high, got low={low}, high={high}")
    if max_attempts < 1:
        raise ValueError(f"filters.range_filter.max_attempts: expected an integer >= 1, got {max_attempts}")
    x = raw_column(rewards, reward_names, reward, "filters.range_filter", raw_rewards, raw_reward_names)
    mean, _, _, cnt = _group_moments(x, group_ids)
    return (cnt >= 1) & (mean > low + 1e-6) & (mean < high - 1e-6)


# ------------------------------------------------------------------------------------------------ selectors
def prompt_key(prompt: str) -> str:
    """Stable short key of a prompt for the selectors' state."""
    return format(stable_hash(prompt), "016x")


class PromptSelector(Stateful):
    """Shared parts of the selectors: the candidate pool, per-group outcome summaries, deterministic ties."""

    needs_prompt_features = False

    def __init__(self, reward: str, pool_factor: int):
        if pool_factor < 1:
            raise ValueError(f"filters.pool_factor: expected an integer >= 1, got {pool_factor}")
        self.reward = reward
        self.pool_factor = pool_factor

    def summarize(self, batch) -> list:
        """[(prompt key, successes, count)] per group of the scored batch: raw reward clipped to [0, 1], finite
        entries of valid rows only; rows generated by branching (``extra['branch']``) are left out."""
        x = raw_column(batch.rewards, batch.reward_names, self.reward, "filters", getattr(batch, "raw_rewards", None),
                       batch.extra.get("raw_reward_names"))
        ok = torch.isfinite(x)
        if batch.valid is not None:
            ok = ok & batch.valid
        if "branch" in batch.extra:
            ok = ok & ~batch.extra["branch"].bool()
        inv, ng = group_index(batch.group_ids)
        s = group_sum(torch.where(ok, x.clamp(0, 1).double(), torch.zeros_like(x, dtype=torch.float64)), inv, ng)
        n = group_sum(ok.double(), inv, ng)
        first = torch.full((ng,), len(x), dtype=torch.long).scatter_reduce(0, inv, torch.arange(len(x)), "amin")
        return [(prompt_key(batch.prompts[int(first[g])]), float(s[g]), float(n[g])) for g in range(ng) if n[g] > 0]

    @staticmethod
    def _top(score: torch.Tensor, k: int, seed: int) -> list[int]:
        """Indices of the k largest scores; ties broken by a permutation drawn from ``seed``."""
        perm = torch.randperm(len(score), generator=torch.Generator().manual_seed(seed % (2**63)))
        order = perm[torch.sort(-score.double()[perm], stable=True).indices]
        return order[:k].tolist()

    def metrics(self) -> dict:
        return {}


@register("selector", "pass_rate_curriculum", source="online difficulty curricula (running pass rate per prompt)")
class PassRateCurriculum(PromptSelector):
    """Sample the step's prompts from a pool with weight exp(-(p_q - target)^2 / (2 width^2)), p_q = running pass rate.

    p_q: exponential moving average of the group's mean raw reward (``reward``, default 'correct', clipped to
    [0, 1]) each time prompt q is trained on, ``ema`` 0.5 (the first observation sets it); unseen prompts count
    as ``target`` (explored first). Defaults: target 0.5, width 0.2, pool_factor 4. Sampling without replacement
    from the pool (``torch.multinomial``, seeded by (seed, step)). State: the pass-rate table (checkpointed).
    """

    def __init__(self, *, target: float = 0.5, width: float = 0.2, ema: float = 0.5, pool_factor: int = 4,
                 reward: str = "correct"):
        super().__init__(reward, pool_factor)
        if not 0 <= target <= 1 or width <= 0 or not 0 < ema <= 1:
            raise ValueError("filters.pass_rate_curriculum: expected 0 <= target <= 1, width > 0, 0 < ema <= 1")
        self.target, self.width, self.ema = target, width, ema
        self.rate: dict[str, float] = {}

    def select(self, rows: list, k: int, *, seed: int, group_size: int, features=None) -> list[int]:
        p = torch.tensor([self.rate.get(prompt_key(r["prompt"]), self.target) for r in rows], dtype=torch.float64)
        w = torch.exp(-0.5 * ((p - self.target) / self.width) ** 2) + 1e-12
        gen = torch.Generator().manual_seed(seed % (2**63))
        return torch.multinomial(w, k, replacement=False, generator=gen).tolist()

    def update(self, summaries: list) -> None:
        for key, s, n in summaries:
            acc = s / n
            old = self.rate.get(key)
            self.rate[key] = acc if old is None else (1 - self.ema) * old + self.ema * acc

    def metrics(self) -> dict:
        vals = list(self.rate.values())
        return {"filter/curriculum/tracked": float(len(vals)),
                "filter/curriculum/mean_rate": float(sum(vals) / len(vals)) if vals else 0.0}

    def state_dict(self) -> dict:
        return {"rate": dict(self.rate)}

    def load_state_dict(self, state: dict) -> None:
        self.rate = dict(state.get("rate", {}))


def beta_mutual_information(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """I(Y_1..n ; p) in nats for p ~ Beta(a, b) and Y_j ~ Bernoulli(p) i.i.d. (n rollouts of one prompt).

    I = H(Y_1..n) - n E[H_b(p)], with the beta-binomial predictive P(y) = B(k + a, n - k + b) / B(a, b) for a
    sequence with k successes and E[H_b(p)] = mu (psi(a+b+1) - psi(a+1)) + (1-mu) (psi(a+b+1) - psi(b+1)).
    """
    a, b = a.double().unsqueeze(-1), b.double().unsqueeze(-1)
    k = torch.arange(n + 1, dtype=torch.float64)
    lbeta = lambda x, y: torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)  # noqa: E731
    logp_seq = lbeta(k + a, n - k + b) - lbeta(a, b)
    logc = torch.lgamma(torch.tensor(n + 1.0)) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    h_y = -(torch.exp(logc + logp_seq) * logp_seq).sum(-1)
    a, b = a.squeeze(-1), b.squeeze(-1)
    mu = a / (a + b)
    psi = torch.special.digamma
    e_h = mu * (psi(a + b + 1) - psi(a + 1)) + (1 - mu) * (psi(a + b + 1) - psi(b + 1))
    return h_y - n * e_h


@register("selector", "insight",
          source="Efficient RLVR Training via Weighted Mutual Information Data Selection (InSight)")
class InSight(PromptSelector):
    """Pick the pool prompts with the largest weighted mutual information between the next group and the success rate.

    After "Efficient RLVR Training via Weighted Mutual Information Data Selection" (InSight): each prompt's success
    rate has a Beta(alpha_q, beta_q) posterior (prior ``prior_alpha``, ``prior_beta`` = 1, 1; every observed group
    adds its successes s and failures n - s, raw reward ``reward`` clipped to [0, 1]; earlier evidence is
    multiplied by ``decay`` (default 1.0 = none) at each new observation, to follow a moving policy). Score:
      score_q = (4 mu_q (1 - mu_q))^w * I(Y_1..G ; p_q),   mu_q = alpha_q / (alpha_q + beta_q) (the mean belief),
    I = the exact multi-rollout mutual information (``beta_mutual_information``; G = the run's group size); the
    top ``prompts_per_step`` of a pool of ``pool_factor`` (4) x prompts_per_step are trained on. I holds the
    evidence-dependent part (shrinks as alpha + beta grow), the weight the difficulty-dependent part.
    Assumed (the abstract names a "weighted" MI without the weight): w = ``difficulty_weight`` = 1.0 on the
    difficulty term 4 mu (1 - mu); w = 0 is plain mutual information.
    """

    def __init__(self, *, prior_alpha: float = 1.0, prior_beta: float = 1.0, difficulty_weight: float = 1.0,
                 decay: float = 1.0, pool_factor: int = 4, reward: str = "correct"):
        super().__init__(reward, pool_factor)
        if prior_alpha <= 0 or prior_beta <= 0 or difficulty_weight < 0 or not 0 < decay <= 1:
            raise ValueError("filters.insight: expected prior_alpha, prior_beta > 0, difficulty_weight >= 0, "
                             "0 < decay <= 1")
        self.a0, self.b0, self.w, self.decay = prior_alpha, prior_beta, difficulty_weight, decay
        self.post: dict[str, list[float]] = {}  # key -> [successes, failures] (evidence, without the prior)
        self._last_score = 0.0

    def scores(self, keys: list[str], group_size: int) -> torch.Tensor:
        ev = torch.tensor([self.post.get(k, [0.0, 0.0]) for k in keys], dtype=torch.float64).reshape(-1, 2)
        a, b = ev[:, 0] + self.a0, ev[:, 1] + self.b0
        mu = a / (a + b)
        return (4 * mu * (1 - mu)).clamp(min=0) ** self.w * beta_mutual_information(a, b, group_size)

    def select(self, rows: list, k: int, *, seed: int, group_size: int, features=None) -> list[int]:
        score = self.scores([prompt_key(r["prompt"]) for r in rows], group_size)
        idx = self._top(score, k, seed)
        self._last_score = float(score[idx].mean()) if idx else 0.0
        return idx

    def update(self, summaries: list) -> None:
        for key, s, n in summaries:
            old = self.post.get(key, [0.0, 0.0])
            self.post[key] = [self.decay * old[0] + s, self.decay * old[1] + (n - s)]

    def metrics(self) -> dict:
        return {"filter/insight/tracked": float(len(self.post)), "filter/insight/selected_score": self._last_score}

    def state_dict(self) -> dict:
        return {"post": {k: list(v) for k, v in self.post.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.post = {k: list(v) for k, v in state.get("post", {}).items()}


@register("selector", "pcl", source="Prompt Curriculum Learning for Efficient LLM Post-Training (PCL)")
class PromptCurriculum(PromptSelector):
    """Choose the pool prompts whose predicted success rate is closest to ``target``, with a learned value model.

    After "Prompt Curriculum Learning for Efficient LLM Post-Training" (PCL): a value model predicts each prompt's
    expected reward under the current policy, without rollouts, and is updated on-policy from the groups just
    trained on. Assumed: the value model is a logistic probe V(q) = sigmoid(w . h_q + b) on the policy's last
    hidden state at the prompt's last token (detached, from a no-grad forward of the pool), trained after every
    step with ``epochs`` (10) AdamW steps at ``lr`` (1e-2) on the squared error to the group's mean raw reward
    (``reward``, clipped to [0, 1]). Selection: the prompts_per_step pool prompts (pool_factor 4) with the smallest
    |V(q) - target|, target 0.5 (ties: seeded). State: probe weights and optimizer (checkpointed).
    """

    needs_prompt_features = True

    def __init__(self, *, target: float = 0.5, pool_factor: int = 4, lr: float = 1e-2, epochs: int = 10,
                 reward: str = "correct"):
        super().__init__(reward, pool_factor)
        if not 0 <= target <= 1 or lr <= 0 or epochs < 1:
            raise ValueError("filters.pcl: expected 0 <= target <= 1, lr > 0, epochs >= 1")
        self.target, self.lr, self.epochs = target, lr, epochs
        self.head: torch.nn.Linear | None = None
        self.optimizer = None
        self._features: dict[str, torch.Tensor] = {}
        self._stats = {"filter/pcl/value_loss": 0.0, "filter/pcl/predicted": 0.0}

    def _make(self, hidden: int) -> None:
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.lr, weight_decay=0.0)

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            self._make(features.shape[-1])
        return torch.sigmoid(self.head(features.float()).squeeze(-1))

    def select(self, rows: list, k: int, *, seed: int, group_size: int, features=None) -> list[int]:
        if features is None:
            raise ValueError("filters.pcl: needs prompt features (the trainer provides them)")
        pred = self.predict(features)
        idx = self._top(-(pred - self.target).abs(), k, seed)
        self._features.update({prompt_key(rows[i]["prompt"]): features[i].float() for i in idx})
        self._stats["filter/pcl/predicted"] = float(pred[idx].mean()) if idx else 0.0
        return idx

    def update(self, summaries: list) -> None:
        pairs = [(self._features[key], s / n) for key, s, n in summaries if key in self._features]
        self._features = {}  # the features of this step's selections
        if not pairs or self.head is None:
            return
        x = torch.stack([p[0] for p in pairs])
        y = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
        for _ in range(self.epochs):
            self.optimizer.zero_grad()
            loss = ((torch.sigmoid(self.head(x).squeeze(-1)) - y) ** 2).mean()
            loss.backward()
            self.optimizer.step()
        self._stats["filter/pcl/value_loss"] = float(loss.detach())

    def metrics(self) -> dict:
        return dict(self._stats)

    def state_dict(self) -> dict:
        if self.head is None:
            return {}
        return jsonstate.encode({"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        state = jsonstate.decode(state)
        self._make(state["head"]["weight"].shape[-1])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
