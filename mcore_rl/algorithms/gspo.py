"""GSPO (Group Sequence Policy Optimization, Zheng et al. 2025, arXiv 2507.18071) and its GSPO-token variant.

Why a sequence ratio: the reward, and so the advantage, belongs to a whole response, but GRPO weights each token by
its own ratio pi_theta(y_t) / pi_old(y_t): one sample of an importance weight, whose noise accumulates over long
responses (and jumps when an MoE router changes its experts). GSPO weights, clips and optimises the response as a
unit, with the response's likelihood ratio normalised by its length (a geometric mean of the token ratios), so
that one clip range fits responses of every length:

    s_i   = exp( (1/|y_i|) sum_t m_it (log pi_theta(y_it) - log pi_old(y_it)) )        m = the loss mask
    l_i   = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    J     = (1/G) sum_i -l_i                                     (the paper's group mean)

|y_i| counts policy tokens only (environment and tool tokens have mask 0), and pi_old is the anchor the old-logit
source gives (`anchor_logp`). Because s_i averages log-ratios, a clip range of a few 1e-4 (the paper's 3e-4 / 4e-4)
already bounds a response's drift; the paper clips two orders of magnitude more tokens than GRPO and learns faster.

How it enters the shared pipeline: `PolicyTerms.pg` is per token, so l_i is broadcast to the tokens of row i and
the aggregation weights w sum it back: the loss is sum_i W_i l_i with W_i = sum_t w_it. seq-mean-token-mean
(W_i = 1/N_seq, the default) is the paper's objective; the other modes weight each response by its policy-token
length (token-mean: |y_i| / N_tok, as TRL's sequence-level importance sampling under its token-normalised losses;
prompt-mean: |y_i| / (|G(x)| N_prompt) with |G(x)| the group's token count; seq-mean-token-sum-norm:
|y_i| / (N_seq L_max)). The gradient reaches every token of the row through s_i. s_i needs the whole row, which
every micro-batch holds: the trainer splits batches by rows (`policy/step.py` `split_micro_batches`, packing cuts
a row only after its last scored token) and DP ranks by prompt groups, so the loss is exact under any split.

GSPO-token (`variant: gspo_token`): s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)], the per-token loss
-min(s_it A_it, clip(s_it) A_it). Its value is s_i on every token and its gradient is sg[s_i] grad log pi(y_it) on
token t alone: with one advantage per response (what this trainer's advantages are) it equals GSPO in value and
gradient under every aggregation mode (the row's weights are equal across its tokens); it differs where a token's
term is weighted or dropped on its own: token-level advantages, or a token-level correction / veto
(`correction.*`), whose weight then moves only that token's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mcore_rl.algorithms.base import Algorithm, AlgorithmConfig, PolicyTerms, TokenBatch
from mcore_rl.algorithms.correction import check_choice
from mcore_rl.algorithms.grpo import ppo_clip_loss
from mcore_rl.algorithms.ops import log_ratio, masked_mean
from mcore_rl.algorithms.reduce import Reducer
from mcore_rl.algorithms.registry import register_algorithm

VARIANTS = ("gspo", "gspo_token")


def sequence_log_ratio(logp: Tensor, anchor: Tensor, mask: Tensor) -> Tensor:
    """log s_i [B, 1]: the mean over the row's policy tokens of log pi_theta - log pi_old (0 for an empty row).
    Token log-ratios are clamped to +-20 and zeroed off the mask first (`ops.log_ratio`), so the mean is finite
    whatever the padding holds."""
    m = (mask > 0).to(logp.dtype)
    lr = log_ratio(logp, anchor, mask)
    return lr.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)


def token_log_ratio(logp: Tensor, seq_log_ratio: Tensor, mask: Tensor, variant: str) -> Tensor:
    """The log-ratio each token's clipped surrogate takes, [B, T]. gspo: log s_i on every token (the gradient
    flows through the row's mean). gspo_token: sg[log s_i] + log pi_theta - sg[log pi_theta], the same value with
    the gradient of the token's own log-prob."""
    if variant == "gspo":
        return seq_log_ratio.expand_as(logp)
    m = (mask > 0).to(logp.dtype)
    return seq_log_ratio.detach() + (logp - logp.detach()) * m


@dataclass
class GspoConfig(AlgorithmConfig):
    name: str = "gspo"
    updates_per_rollout: int = 4       # the paper splits each rollout batch into 4 mini-batches
    loss_agg_mode: str = "seq-mean-token-mean"  # W_i = 1/N_seq: the paper's mean over responses
    eps_low: float = 3e-4              # sequence clip [1 - eps_low, 1 + eps_high]; the paper's ranges
    eps_high: float = 4e-4
    variant: str = "gspo"              # gspo | gspo_token (sg[s_i] * pi_theta / sg[pi_theta] per token)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(f"algorithm {self.name!r}", "variant", self.variant, VARIANTS)
        if not (0 <= self.eps_low <= 1 and self.eps_high >= 0):
            raise ValueError(f"algorithm {self.name!r}: need 0 <= eps_low <= 1 and eps_high >= 0, "
                             f"got eps_low={self.eps_low}, eps_high={self.eps_high}")


def _sequence_stats(seq_lr: Tensor, clip_active: Tensor, m: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-response metrics (micro-batch) and the sums that make them exact over the step: a response is clipped
    when its clipped branch binds (its surrogate carries no gradient) on any of its policy tokens; with one
    advantage per response that is all of them or none."""
    rows = m.sum(dim=1) > 0
    s = torch.exp(seq_lr.detach().squeeze(1))
    clipped = (clip_active & (m > 0)).any(dim=1) & rows
    n, ratio_sum = rows.sum(), torch.where(rows, s, torch.zeros_like(s)).sum()
    one = torch.ones((), dtype=s.dtype, device=s.device)
    if s.numel() == 0:
        s, rows = one[None], torch.ones(1, dtype=torch.bool, device=s.device)
    metrics = {
        "seq_clipfrac": clipped.sum().to(s.dtype) / n.clamp(min=1).to(s.dtype),
        "seq_ratio_mean": torch.where(n > 0, ratio_sum / n.clamp(min=1).to(s.dtype), one),
        "seq_ratio_max": torch.where(n > 0, torch.where(rows, s, torch.full_like(s, -torch.inf)).max(), one),
        "seq_ratio_min": torch.where(n > 0, torch.where(rows, s, torch.full_like(s, torch.inf)).min(), one),
    }
    return metrics, {"seq_rows": n, "seq_clipped": clipped.sum(), "seq_ratio_sum": ratio_sum}


@register_algorithm("gspo")
class GSPO(Algorithm):
    config_cls = GspoConfig
    config: GspoConfig
    sum_keys = ("seq_rows", "seq_clipped", "seq_ratio_sum")  # metrics only: no decision reads them
    skips_inert_rows = True  # l_i = A_i x (a finite factor of s_i): a row with A = 0 adds nothing

    def policy_terms(self, batch: TokenBatch, reduce: Reducer) -> PolicyTerms:
        c, m = self.config, (batch.mask > 0).to(batch.logp.dtype)
        anchor = self.anchor_logp(batch)
        seq_lr = sequence_log_ratio(batch.logp, anchor, batch.mask)
        tok_lr = token_log_ratio(batch.logp, seq_lr, batch.mask, c.variant)
        pg, clip_active, _ = ppo_clip_loss(tok_lr, batch.advantages, c.eps_low, c.eps_high)
        metrics, sums = _sequence_stats(seq_lr, clip_active, m)
        metrics["pg_clipfrac"] = masked_mean(clip_active.to(m.dtype), m)  # share of tokens, comparable with GRPO's
        metrics["ppo_kl"] = masked_mean(-log_ratio(batch.logp.detach(), anchor, batch.mask), m)
        return PolicyTerms(pg=pg, metrics=metrics, sums=sums)

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Exact over every micro-batch and DP rank (the micro-batch means above are averaged unweighted)."""
        n = sums["seq_rows"]
        return {"seq_clipfrac": sums["seq_clipped"] / n if n else 0.0,
                "seq_ratio_mean": sums["seq_ratio_sum"] / n if n else 1.0}
