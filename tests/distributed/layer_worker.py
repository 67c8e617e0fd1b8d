"""torchrun worker: the collective layer across 2 real gloo ranks under NCCL semantics (nccl_standin), so results
combine values that differ per rank. Writes what each rank saw to --out/rank{r}.json; the test compares."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import mcore_rl.distributed as D
    from tests.distributed.nccl_standin import install

    layout = D.init_distributed(1, 1, timeout_s=123)
    host = dist.new_group(backend="gloo")
    r = layout.rank
    res: dict = {"dp": layout.dp}
    with pytest.MonkeyPatch.context() as mp:
        rec = install(mp, host, nccl=True)
        try:
            dist.all_reduce(torch.ones(1))
            res["raw_cpu_all_reduce"] = "accepted"
        except RuntimeError as e:
            res["raw_cpu_all_reduce"] = str(e)
        x = torch.tensor([r + 1.0, -(r + 1.0)])
        res["sum"] = D.all_reduce(x, "sum").tolist()
        res["max"] = D.all_reduce(x, "max").tolist()
        res["min"] = D.all_reduce(x, "min").tolist()
        res["x_untouched"] = x.tolist()
        res["gather"] = [p.tolist() for p in D.all_gather(torch.tensor([10.0 * r, r]))]
        b = torch.tensor([float(r), 7.0 * r])
        D.broadcast(b, src=1)
        res["broadcast"] = b.tolist()
        res["floats"] = D.broadcast_floats([0.5 + r], src=1)
        res["any"] = [D.all_ranks_any(r == 1), D.all_ranks_any(False)]
        res["object"] = D.broadcast_object({"from": r}, src=1)
        if r == 0:
            D.send_object({"payload": [1, 2, 3]}, dst=1)
        else:
            res["received"] = D.recv_object(src=0)
        D.barrier()

        from megatron.core import parallel_state as ps

        from mcore_rl.algorithms.reduce import make_dist_reducer
        from mcore_rl.policy.moe_metrics import RouterLoad
        from mcore_rl.policy.policy import Policy
        from mcore_rl.policy.step import PolicyBatch

        res["dp_reduce"] = make_dist_reducer(ps.get_data_parallel_group())(torch.tensor([r + 1.0])).tolist()
        rows = 1 if r == 0 else 3  # one micro-batch of 16 tokens each: rank 0 must pad to rank 1's three
        batch = PolicyBatch(torch.ones(rows, 16, dtype=torch.long), torch.ones(rows, 16))
        mbs = Policy.micro_batches(SimpleNamespace(cfg=SimpleNamespace(token_budget=16)), batch)
        res["micro_batches"] = [float(mb.loss_mask.sum()) for mb in mbs]
        load = RouterLoad(torch.nn.Linear(1, 1), num_experts=2)
        load.counts += torch.tensor([1.0, 0.0] if r == 0 else [1.0, 2.0], dtype=torch.float64)
        res["moe"] = load.read()
        res["calls"] = sorted({(c.op, c.device, c.host) for c in rec.calls})
    res["timeouts"] = [D.group_timeout_s(), D.group_timeout_s(ps.get_data_parallel_group())]
    Path(args.out, f"rank{r}.json").write_text(json.dumps(res))
    D.destroy_distributed()


if __name__ == "__main__":
    main()
