"""torchrun worker for Qwen3-MoE under expert parallelism: from one torch_dist checkpoint, report log-probs, one
Adam step's grad norm, post-step log-probs and router load; then sync the weights into the embedded engine
(transformers' Qwen3-MoE) and report its log-probs.

Usage: moe_worker.py --hf DIR --ckpt DIR --tp N --pp M --ep E --out FILE [--save-init] [--sp]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.packing import row_lengths
from tests.multiproc.launch import layout_policy, shutdown, step_from_shared_checkpoint, worker_parser


def engine_logprobs(engine, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of `tokens` under the engine's live transformers model (aligned like the policy's)."""
    with torch.no_grad():
        logits = engine.model(tokens).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(len(tokens), 1), logp], dim=1)


class RoutedTokens:
    """Token positions the routers saw in training forwards (every layer, every rank): real tokens plus the padding
    of the layout's micro-batches, which the router load counts too."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.n = 0
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if module.training:
            self.n += int(output[1].shape[0])  # routing_map [tokens, experts]

    def total(self) -> int:
        from mcore_rl.distributed import all_reduce

        return int(all_reduce(torch.tensor([float(self.n)], dtype=torch.float64), "sum").item())


def main() -> None:
    ap = worker_parser(__doc__)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--aux-loss", type=float, default=0.0, help="MoE load-balancing loss weight")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (TP > 1)")
    a = ap.parse_args()
    init_distributed(a.tp, a.pp, ep=a.ep)
    policy = layout_policy(a.hf, BuildConfig(tp=a.tp, pp=a.pp, ep=a.ep, moe_aux_loss_coeff=a.aux_loss,
                                                   sequence_parallel=a.sp))
    routed = RoutedTokens(policy.model)
    res = step_from_shared_checkpoint(policy, a.hf, a.ckpt, a.save_init)
    routed_tokens = routed.total()
    batch, mask, before, after, stats = res.batch, res.mask, res.before, res.after, res.stats
    # weight sync through the trainer's path (EP shards gathered, TP/PP too) into the real embedded engine
    from mcore_rl.rollout.local.engine import LocalEngine
    from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights

    engine = LocalEngine(a.hf) if dist.get_rank() == 0 else None
    sync_weights(policy, engine, version=1)
    if res.is_reporter:
        load = {k: v for k, v in stats.items() if k.startswith("moe_load")}
        from mcore_rl.compat import moe as moe_compat

        report = {"before": before * mask, "after": after * mask, "grad_norm": stats["grad_norm"], "load": load,
                  "compat_hits": dict(moe_compat.HITS), "routed_tokens": routed_tokens,
                  "real_tokens": int(row_lengths(res.mask).sum()) * policy.args.num_layers}  # fmt: skip
        if engine is not None:
            report["engine_after"] = engine_logprobs(engine, batch.tokens) * mask
            report["engine_version"] = engine.weight_version
        torch.save(report, a.out)
    if engine is not None:
        engine.close()
    shutdown()


if __name__ == "__main__":
    main()
