"""Router metrics of a Mixture-of-Experts policy: how many token slots each expert received since the last read.

Why hooks on the routers: Megatron's own MoE tracker logs only auxiliary losses, while RL runs mostly want to see
routing collapse (one expert taking most tokens) as the policy drifts. Counts are summed over layers and micro-batches,
then over all ranks at read time (TP ranks see identical tokens, so fractions are unaffected). Padding positions of
token-budget micro-batches are routed like any token and are counted too. No capacity factor is set, so no token is
ever dropped (the dropped-token count is 0 by construction and not reported).
"""

from __future__ import annotations

import torch

from mcore_rl.distributed import all_reduce


class RouterLoad:
    def __init__(self, model, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_experts = num_experts
        self.counts = torch.zeros(num_experts, dtype=torch.float64)
        self._handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, TopKRouter)]

    def _hook(self, module, inputs, output) -> None:
        if not module.training:  # count the tokens updates are computed on, not log-prob passes
            return
        routing_map = output[1]  # [tokens, experts] bool
        self.counts += routing_map.detach().sum(dim=0).to("cpu", torch.float64)

    def read(self) -> dict[str, float]:
        """Collective: per-expert share of routed slots, and max/mean (1.0 = perfectly balanced); resets."""
        counts = all_reduce(self.counts, "sum")  # a fresh tensor on the CPU, whatever device the group needs
        self.counts.zero_()
        total = counts.sum().item()
        if total <= 0:
            return {}
        share = counts / total
        out = {f"moe_load_e{i}": share[i].item() for i in range(self.num_experts)}
        out["moe_load_max_over_mean"] = share.max().item() * self.num_experts
        return out
