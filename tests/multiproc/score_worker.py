"""torchrun worker: build the Megatron reward model (ScoreModel) at some TP/PP, score rows, rank 0 saves them.

Usage: score_worker.py --rm DIR --rows FILE.json --tp N --pp M --out FILE.pt [--budget TOKENS]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rm", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=int, default=64)
    a = ap.parse_args()
    from mcore_rl.distributed import global_rank, init_distributed
    from mcore_rl.models.spec import BuildConfig
    from mcore_rl.policy.score_model import ScoreModel

    init_distributed(a.tp, a.pp, ep=a.ep)
    model = ScoreModel(a.rm, BuildConfig(tp=a.tp, pp=a.pp, ep=a.ep), token_budget=a.budget)
    rows = json.loads(open(a.rows).read())
    scores = model.scores(rows)
    if global_rank() == 0:
        torch.save({"scores": scores, "label_col": torch.tensor(model.score_ids(rows))}, a.out)
    else:
        model.score_ids(rows)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
