"""torchrun worker: load one torch_dist checkpoint at some TP/PP/DP, report log-probs, one Adam step, grad norm.

Usage: parallel_worker.py --hf DIR --ckpt DIR --tp N --pp M --out FILE [--save-init] [--distributed-optimizer]
"""

from __future__ import annotations

import json

import torch

from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from tests.multiproc.launch import layout_policy, shutdown, step_from_shared_checkpoint, worker_parser


def main() -> None:
    ap = worker_parser(__doc__)
    ap.add_argument("--distributed-optimizer", action="store_true")
    a = ap.parse_args()
    layout = init_distributed(a.tp, a.pp)
    policy = layout_policy(a.hf, BuildConfig(tp=a.tp, pp=a.pp), use_distributed_optimizer=a.distributed_optimizer)
    res = step_from_shared_checkpoint(policy, a.hf, a.ckpt, a.save_init)
    if res.is_reporter:
        torch.save({"before": res.before * res.mask, "after": res.after * res.mask,
                    "grad_norm": res.stats["grad_norm"], "world": layout.world_size}, a.out)
        print(json.dumps({"grad_norm": res.stats["grad_norm"]}))
    shutdown()


if __name__ == "__main__":
    main()
