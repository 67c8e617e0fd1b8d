"""The algorithm contract shared by all losses: TokenBatch in, (loss, metrics) out.

Life cycle of one optimizer step, as the trainer drives it:
    adv  = alg.advantages(rewards, group_ids, reduce, lengths)        # per rollout batch; drop ~adv.keep
    w    = alg.token_weights(mask, group_ids, reduce)                 # [N, T], whole local batch, once per step
    alg.begin_update(old_logp, prox_logp, rollout_logp, mask, reduce)  # whole local batch, before the first loss
    for mb in micro_batches:                                          # any split, any DP layout
        loss, metrics = alg.loss(TokenBatch(..., token_weight=w[mb]), reduce); loss.backward()
    acc  = alg.finish_accumulation(reduce)                            # BEFORE optimizer.step()
    if acc.grad_scale != 1: scale every gradient by acc.grad_scale    # Megatron DDP: model.scale_gradients(s)
    optimizer.step()
    decision = alg.after_optimizer_step(acc.metrics)                  # e.g. decision.reset_ewma (PPO-EWMA)

Megatron must be configured to *sum* micro-batch losses and DP gradients (no averaging): the weights already
carry every global denominator, so the summed gradient is exact whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
from torch import Tensor

from mcore_rl.algorithms.advantages import (
    BATCH_STD_SOURCES,
    STD_NORMS,
    AdvantageResult,
    compute_advantages,
    overlong_penalty,
)
from mcore_rl.algorithms.aggregation import AGG_MODES, aggregation_weights
from mcore_rl.algorithms.correction import (
    CorrectionConfig,
    check_choice,
    correction_weights,
    mismatch_metrics,
)
from mcore_rl.algorithms.ops import k3, masked_mean, to_floats
from mcore_rl.algorithms.reduce import Reducer, identity_reduce, stack_sums
from mcore_rl.oldlogp.registry import SOURCES

SCHEDULES = ("sync", "staged", "async")
STALE_POLICIES = ("drop", "requeue")
RENORM_MODES = ("none", "deferred", "microbatch")


@dataclass
class TokenBatch:
    """One micro-batch; every tensor [B, T] float on one device. Padding must hold finite values."""

    logp: Tensor                       # current-policy log-prob of each response token (requires grad)
    mask: Tensor                       # 1.0 on response tokens that count, 0 elsewhere (padding, prompt)
    advantages: Tensor                 # per-token advantage (sequence advantage broadcast)
    rollout_logp: Tensor               # rollout engine log-probs (behaviour policy)
    token_weight: Tensor               # aggregation weights (a slice of Algorithm.token_weights)
    old_logp: Tensor | None = None     # trainer recompute at behaviour weights
    prox_logp: Tensor | None = None    # EWMA proximal policy (PPO-EWMA)
    ref_logp: Tensor | None = None     # reference policy, for KL
    entropy: Tensor | None = None      # per-token entropy (with grad), for the entropy bonus

    def check(self, alg: Algorithm) -> None:
        shape = self.logp.shape
        needed = {"old_logp": alg.needs_old_logp, "prox_logp": alg.needs_prox_logp,
                  "ref_logp": alg.needs_ref_logp, "entropy": alg.needs_entropy}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                if needed.get(f.name):
                    raise ValueError(f"TokenBatch.{f.name} is None but algorithm {alg.name!r} needs it "
                                     f"(see its needs_{f.name.removesuffix('_logp')} property / config)")
            elif t.shape != shape:
                raise ValueError(f"TokenBatch.{f.name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")


@dataclass
class PolicyTerms:
    """What an algorithm's policy objective contributes per token (before aggregation)."""

    pg: Tensor                          # policy-gradient loss; correction weights multiply this term only
    reg: Tensor | None = None           # extra per-token loss not touched by correction (e.g. P3O trust region)
    keep: Tensor | None = None          # [B, T] 0/1: tokens the objective drops (NAV veto, train-infer mask)
    metrics: dict[str, Tensor | float] = field(default_factory=dict)
    sums: dict[str, Tensor] = field(default_factory=dict)   # local sums accumulated until finish_accumulation


@dataclass
class AccumulationResult:
    grad_scale: float                   # multiply all gradients by this before optimizer.step()
    metrics: dict[str, float]           # global (all-reduced) metrics of the step


@dataclass
class StepDecision:
    reset_ewma: bool = False            # PPO-EWMA: reset the proximal weights to the current ones
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    """Fields common to every algorithm. The first group is read by the trainer, not by the loss."""

    name: str = ""
    # --- training loop (trainer reads these) ---
    schedule: str = "sync"             # sync: generate then updates | staged: Mu-GRPO stages | async: PipelineRL-k
    updates_per_rollout: int = 1       # sync: optimizer updates per rollout batch (mu)
    updates_per_stage: int = 1         # staged: optimizer updates per stage (mu of Mu-GRPO); trainer.steps counts
    #                                    updates, so a run has trainer.steps / updates_per_stage stages
    max_staleness: int = 0             # async: rounds generated ahead = max policy versions a sample may lag (k)
    stale_policy: str = "drop"         # async: a group lagging more than max_staleness is dropped | requeued
    old_logp_source: str = "recompute"  # rollout: anchor = rollout log-probs | recompute: trainer forward with
    #   the current weights before the first update (exact only on-policy) | snapshot: each token scored under
    #   the version that generated it (host copies of <= k+1 versions) | old_logit_model: a forward-only model
    #   holding the behaviour version scores samples as they finish (engine interrupt mode) | interrupt: the
    #   engine restarts in-flight samples at each weight update; scored at their one version (docs/old_logits.md)
    old_logp_audit_frac: float = 0.0   # > 0: measure the missing-old-logit error on this fraction of each round's
    #                                    rows (keeps host weight copies for sources that have none)
    dynamic_sampling: bool = False     # DAPO: keep sampling until the batch is full of non-zero-variance groups
    max_sampling_rounds: int = 3       # cap on those extra sampling rounds
    retire_pass_rate: float | None = None  # ScaleRL no-positive-resampling: retire prompts with pass rate >= this
    # --- advantages ---
    adv_std_norm: str = "group"        # group | none | batch (see advantages.py)
    adv_eps: float = 1e-6
    adv_std_unbiased: bool = True
    batch_std_source: str = "advantages"  # adv_std_norm=batch: std of centred advantages | of raw rewards
    filter_zero_variance: bool = False  # drop groups with all-equal rewards from the loss batch
    overlong_buffer_len: int = 0       # DAPO soft overlong penalty: ramp length (0 = off)
    overlong_penalty_factor: float = 1.0
    max_response_len: int | None = None  # L_max: overlong penalty and seq-mean-token-sum-norm; null = the
    #                                      rollout's trainer.max_new_tokens (filled in by the trainer)
    # --- loss ---
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0               # beta_KL * k3(theta || ref); > 0 needs ref_logp
    entropy_coef: float = 0.0          # -beta_H * entropy; > 0 needs entropy
    renorm_dropped: str = "none"       # tokens dropped inside the loss (veto, MIS/RS, train-infer mask):
    #   none: they leave the numerator only | deferred: also the denominator, exactly, via finish_accumulation's
    #   grad_scale | microbatch: also the denominator of the micro-batch (all-reduced; split-dependent)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)

    def __post_init__(self) -> None:
        owner = f"algorithm {self.name or type(self).__name__!r}"
        check_choice(owner, "schedule", self.schedule, SCHEDULES)
        check_choice(owner, "stale_policy", self.stale_policy, STALE_POLICIES)
        if self.schedule == "async" and self.max_staleness < 1:
            raise ValueError(f"{owner}: schedule=async needs max_staleness >= 1 (rounds generated ahead); "
                             "with 0 it is the sync schedule")
        check_choice(owner, "old_logp_source", self.old_logp_source, SOURCES.names())
        check_choice(owner, "adv_std_norm", self.adv_std_norm, STD_NORMS)
        check_choice(owner, "batch_std_source", self.batch_std_source, BATCH_STD_SOURCES)
        check_choice(owner, "loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        check_choice(owner, "renorm_dropped", self.renorm_dropped, RENORM_MODES)
        for key in ("updates_per_rollout", "updates_per_stage", "max_sampling_rounds"):
            if getattr(self, key) < 1:
                raise ValueError(f"{owner}: {key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_staleness", "overlong_buffer_len", "kl_coef", "entropy_coef", "adv_eps"):
            if getattr(self, key) < 0:
                raise ValueError(f"{owner}: {key} must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.old_logp_audit_frac <= 1.0:
            raise ValueError(f"{owner}: old_logp_audit_frac must be in [0, 1], got {self.old_logp_audit_frac}")
        if self.retire_pass_rate is not None and not 0 < self.retire_pass_rate <= 1:
            raise ValueError(f"{owner}: retire_pass_rate must be in (0, 1] or null, got {self.retire_pass_rate}")
        needs_len = self.overlong_buffer_len > 0 or self.loss_agg_mode == "seq-mean-token-sum-norm"
        if needs_len and (self.max_response_len is None or self.max_response_len <= 0):
            raise ValueError(f"{owner}: max_response_len must be set (> 0) for overlong_buffer_len > 0 or "
                             "loss_agg_mode=seq-mean-token-sum-norm")
        if self.overlong_buffer_len > (self.max_response_len or 0):
            raise ValueError(f"{owner}: overlong_buffer_len={self.overlong_buffer_len} exceeds max_response_len")
        if self.correction.ratio == "old" and self.correction.enabled and self.old_logp_source == "rollout":
            raise ValueError(f"{owner}: correction.ratio=old needs old_logp_source=recompute|snapshot "
                             "(or use correction.ratio=current)")


class Algorithm:
    """Base class: advantages, aggregation weights, the shared loss pipeline and the step hooks."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    sum_keys: ClassVar[tuple[str, ...]] = ()     # extra accumulators a subclass fills via PolicyTerms.sums
    # True where the policy-gradient term is the advantage times a finite factor, and no step-level decision reads
    # statistics of rows that carry no gradient: then such rows may leave the forward/backward (`inert_rows`)
    skips_inert_rows: ClassVar[bool] = False

    def __init__(self, config: AlgorithmConfig) -> None:
        if not isinstance(config, self.config_cls):
            raise TypeError(f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(config).__name__}")
        self.config = config
        self._device = torch.device("cpu")
        self.reset_accumulation()

    # ---- what the trainer must compute -------------------------------------------------------------
    @property
    def needs_old_logp(self) -> bool:
        return self.config.old_logp_source != "rollout"  # every other source yields a trainer-side old_logp

    @property
    def needs_prox_logp(self) -> bool:
        return False

    @property
    def needs_ref_logp(self) -> bool:
        return self.config.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.config.entropy_coef > 0

    @property
    def needs_step_logp(self) -> bool:
        """True: the trainer runs a no-grad forward over the update's whole local batch and passes the log-probs
        to `begin_step` before the first micro-batch loss (P3O ess_scope=batch)."""
        return False

    def begin_step(self, logp: Tensor, anchor: Tensor, mask: Tensor, reduce: Reducer = identity_reduce,
                   ) -> dict[str, float]:
        """Per-update statistics over the whole batch (all-reduced with `reduce`); returns metrics."""
        return {}

    def begin_update(self, old_logp: Tensor | None, prox_logp: Tensor | None, rollout_logp: Tensor, mask: Tensor,
                     reduce: Reducer = identity_reduce) -> dict[str, float]:
        """Statistics of the update's whole batch from the anchors alone (no forward), all-reduced with `reduce`,
        before the first micro-batch loss; returns metrics. The trainer calls it for every algorithm, on the ranks
        that compute the loss, with the anchors it has (old_logp is None where the loss takes it from its own
        forward). Why before: a per-update setting derived from the whole batch (PPO-EWMA's calibrated Train-Infer
        gate) then applies alike to every micro-batch and DP rank, so the loss stays split-invariant."""
        return {}

    def anchor_logp(self, batch: TokenBatch) -> Tensor:
        """The behaviour log-probs ratios are taken against: trainer recompute, or the rollout's own."""
        return batch.old_logp if self.needs_old_logp else batch.rollout_logp

    # ---- per rollout batch / per step --------------------------------------------------------------
    def shaped_rewards(self, rewards: Tensor, lengths: Tensor | None) -> Tensor:
        """The rewards advantages are computed from: plus DAPO's soft overlong penalty where configured."""
        c = self.config
        if c.overlong_buffer_len <= 0:
            return rewards
        if lengths is None:
            raise ValueError(f"algorithm {self.name!r}: overlong_buffer_len > 0 needs response lengths")
        return rewards.to(torch.float64) + overlong_penalty(
            lengths, c.max_response_len, c.overlong_buffer_len, c.overlong_penalty_factor)

    def advantages(self, rewards: Tensor, group_ids: Tensor, reduce: Reducer = identity_reduce,
                   lengths: Tensor | None = None) -> AdvantageResult:
        """Sequence advantages [N] and the zero-variance keep mask; `lengths` = response lengths (DAPO)."""
        c = self.config
        rewards = self.shaped_rewards(rewards, lengths)
        return compute_advantages(rewards, group_ids, std_norm=c.adv_std_norm, eps=c.adv_eps,
                                  unbiased=c.adv_std_unbiased, filter_zero_variance=c.filter_zero_variance,
                                  batch_std_source=c.batch_std_source, reduce=reduce)

    def token_weights(self, mask: Tensor, group_ids: Tensor, reduce: Reducer = identity_reduce,
                      keep: Tensor | None = None) -> Tensor:
        """Aggregation weights [N, T] for the whole local batch; `keep` [N] zeroes filtered sequences."""
        if keep is not None:
            mask = mask * keep.to(mask.dtype)[:, None]
        return aggregation_weights(mask, group_ids, self.config.loss_agg_mode, reduce, self.config.max_response_len)

    def inert_rows(self, advantages: Tensor, weights: Tensor) -> Tensor | None:
        """[N] bool: rows that add exactly zero to the update's loss, gradient and step scale, so the trainer
        may leave them out of the forward/backward (`trainer.skip_inert_rows`). None: this algorithm or config
        cannot promise it.

        Why it is exact: every global denominator is already in `weights` (computed over the whole batch), and
        the loss is sum(w * per-token loss). A row whose weights are all zero (zero-variance filtering, empty
        responses) adds nothing. A row with advantage exactly 0 adds nothing when the per-token loss is A x (...)
        alone: no KL or entropy term, and no deferred / per-micro-batch renormalisation (their sums count
        weights of rows that carry no gradient). Why it pays: late in a run most groups of a verifiable task
        are all-correct, and their rows are half or more of the batch.
        """
        c = self.config
        if not self.skips_inert_rows or self.needs_step_logp or c.renorm_dropped == "microbatch":
            return None
        inert = (weights == 0).all(dim=1)
        if c.kl_coef == 0 and c.entropy_coef == 0 and c.renorm_dropped == "none":
            inert = inert | (advantages == 0)
        return inert

    # ---- the loss ----------------------------------------------------------------------------------
    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        raise NotImplementedError

    def loss(self, batch: TokenBatch, reduce: Reducer = identity_reduce) -> tuple[Tensor, dict[str, float]]:
        """sum(token_weight * per_token_loss) over this micro-batch, and micro-batch-local metrics."""
        c = self.config
        batch.check(self)
        self._device = batch.logp.device
        m = (batch.mask > 0).to(batch.logp.dtype)
        terms = self.policy_terms(batch, reduce)
        metrics: dict[str, Tensor | float] = dict(terms.metrics)
        pg, keep = terms.pg, m if terms.keep is None else terms.keep * m
        train_logp = batch.old_logp if batch.old_logp is not None else batch.logp
        metrics.update(mismatch_metrics(train_logp, batch.rollout_logp, m))
        if c.correction.enabled:
            src = batch.old_logp if c.correction.ratio == "old" else batch.logp
            cr = correction_weights(src, batch.rollout_logp, m, c.correction)
            pg, keep = pg * cr.weight, keep * cr.keep
            metrics.update(cr.metrics)
        per_tok = pg if terms.reg is None else pg + terms.reg
        if c.kl_coef > 0:
            kl = k3(batch.logp, batch.ref_logp, m)
            per_tok = per_tok + c.kl_coef * kl
            metrics["kl_loss"] = masked_mean(kl.detach(), m)
        if c.entropy_coef > 0:
            per_tok = per_tok - c.entropy_coef * batch.entropy
        w = batch.token_weight.to(per_tok.dtype) * m
        w_eff = w * keep
        live = w_eff != 0
        zero = torch.zeros_like(per_tok)
        loss = (w_eff * torch.where(live, per_tok, zero)).sum()
        w_sum, w_kept = w.detach().sum(), w_eff.detach().sum()
        if c.renorm_dropped == "microbatch":
            s = reduce(stack_sums(w_sum, w_kept, device=self._device))
            loss = loss * torch.where(s[1] > 0, s[0] / s[1].clamp(min=1e-300), torch.ones_like(s[0])).to(loss.dtype)
        self._accumulate(w_total=w_sum, w_kept=w_kept, tok_total=m.sum(), tok_kept=(keep * m).sum(), **terms.sums)
        metrics["loss"] = loss.detach()
        metrics["pg_loss"] = (w_eff * torch.where(live, pg, zero)).detach().sum()
        metrics["ent_mc"] = -masked_mean(batch.logp.detach(), m)
        if batch.entropy is not None:
            metrics["entropy"] = masked_mean(batch.entropy.detach(), m)
        metrics["dropped_token_frac"] = 1.0 - (keep * m).sum() / m.sum().clamp(min=1)
        return loss, to_floats(metrics)

    # ---- accumulation across micro-batches, step hooks ---------------------------------------------
    def reset_accumulation(self) -> None:
        """Forget micro-batch sums (e.g. after an evaluation-only forward)."""
        self._sums: dict[str, Tensor] = {}

    def _accumulate(self, **sums: Tensor) -> None:
        for k, v in sums.items():
            v = v.detach().to(torch.float64)
            self._sums[k] = self._sums[k] + v if k in self._sums else v

    def finish_accumulation(self, reduce: Reducer = identity_reduce) -> AccumulationResult:
        """One all-reduce of the step's accumulated sums; call after the last backward, before the step.

        With renorm_dropped=deferred the returned grad_scale = sum(w) / sum(w * keep) makes the vetoed/masked
        tokens leave the denominator exactly. With pipeline parallelism only the last stage computes the loss:
        broadcast grad_scale to the other stages before scaling.
        """
        keys = sorted(set(("w_total", "w_kept", "tok_total", "tok_kept") + self.sum_keys))
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        vals = reduce(torch.stack([self._sums.get(k, zero).to(self._device) for k in keys])).tolist()
        sums = dict(zip(keys, vals))
        scale = 1.0
        if self.config.renorm_dropped == "deferred" and sums["w_kept"] > 0:
            scale = sums["w_total"] / sums["w_kept"]
        metrics = {"grad_scale": scale,
                   "step_dropped_token_frac": 1.0 - sums["tok_kept"] / sums["tok_total"] if sums["tok_total"] else 0.0}
        metrics.update(self.step_metrics(sums))
        self.reset_accumulation()
        return AccumulationResult(scale, metrics)

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Global metrics from the reduced sums (subclasses add theirs)."""
        return {}

    def after_optimizer_step(self, metrics: dict[str, float]) -> StepDecision:
        """Hook after optimizer.step(); the trainer acts on the returned decision."""
        return StepDecision()

    def state_dict(self) -> dict[str, float | int | None]:
        """Counters that must survive a resume (plain Python values, weights_only-safe)."""
        return {}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"algorithm {self.name!r}: unknown state keys {sorted(unknown)}")
        for k, v in state.items():
            setattr(self, k, v)
