"""torchrun worker: a TP x PP policy (one train step away from its HF weights) syncs into running mcore-rl-serve
servers by `--mode` (nccl with a gloo group per PP stage, or tensor through shared memory); each server then
generates, and the policy scores the same tokens.
Usage: serve_sync_worker.py --hf DIR --urls U1,U2 --tp 2 --pp 2 --mode nccl --port P --out F"""

from __future__ import annotations

import argparse

import torch

from mcore_rl import distributed as D
from mcore_rl.config.optim import OptimSettings
from mcore_rl.distributed import init_distributed
from mcore_rl.models.spec import BuildConfig
from mcore_rl.policy.policy import Policy, PolicyConfig
from mcore_rl.policy.step import PolicyBatch
from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.weight_sync.megatron_sync import sync_weights
from mcore_rl.rollout.weight_sync.transports import SyncOptions
from tests.train_step import train_step

T = 0.8


def engine_samples(urls: list[str]) -> list:
    """One seeded sample from each server (a client per URL, so every server answers)."""
    from mcore_rl.rollout.sglang.remote_engine import SGLangEngine

    out = []
    for url in urls:
        with SGLangEngine([url], tp_size=1, seed=1) as eng:
            req = GenerationRequest([5, 17, 33, 9], SamplingParams(max_new_tokens=12, temperature=T, seed=11))
            out.append(eng.generate([req])[0])
    return out


def policy_diff(policy, samples) -> float:
    """Max |engine logp - policy logp| over every sample's output tokens (collective)."""
    samples = D.broadcast_object(samples, 0)
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        logp = policy.logprobs(PolicyBatch(ids, torch.ones_like(ids, dtype=torch.float32)), temperature=T)
        n = len(s.prompt_ids)
        if logp is not None:
            got = torch.tensor(s.output_logprobs)
            worst = max(worst, (logp[0, n:] - got).abs().max().item())
    return float(D.all_reduce(torch.tensor([worst]), "max", D.cpu_group()).item())


def restart_and_resync(policy, engine, urls: list[str], res: dict, bucket_mb: float) -> None:
    """Kill server 0; the launcher restarts it on the initial weights; the collective re-sync brings it back."""
    import os
    import signal
    import time

    from mcore_rl.rollout.weight_sync.megatron_sync import resync_restarted

    if engine is not None:
        os.kill(engine._launcher.servers[0].popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while engine.restarts_seen == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        res["pending"] = engine.pending_resync()
        res["held"] = engine.client._down_until[urls[0]] == float("inf")
    res["stale"] = policy_diff(policy, engine_samples(urls[:1]) if engine else None)
    res["resync"] = resync_restarted(policy, engine, SyncOptions(bucket_mb=bucket_mb))
    res["resynced"] = policy_diff(policy, engine_samples(urls) if engine else None)
    if engine is not None:
        res["pending_after"] = engine.pending_resync()
        res["held_after"] = engine.client._down_until[urls[0]] == float("inf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--urls", default="")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--mode", default="nccl")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bucket-mb", type=float, default=0.05)
    ap.add_argument("--restart", action="store_true", help="launch the servers here; kill one after the sync")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    urls = a.urls.split(",") if a.urls else []
    init_distributed(a.tp, a.pp)
    policy = Policy(a.hf, PolicyConfig(build=BuildConfig(tp=a.tp, pp=a.pp),
                                       optim=OptimSettings(lr=1e-2, weight_decay=0.01, adam_beta2=0.999,
                                                           clip_grad=0.0)))  # fmt: skip
    policy.load_hf(a.hf)
    tokens = torch.randint(0, policy.args.vocab_size, (3, 20), generator=torch.Generator().manual_seed(3))
    batch = PolicyBatch(tokens, torch.ones(3, 20))
    train_step(
        policy, batch, lambda mb, lp, e: (-(lp * mb.loss_mask).sum() / 60, {})
    )  # weights now differ from HF
    engine = None
    if D.global_rank() == 0:
        from mcore_rl.rollout.sglang.remote_engine import SGLangEngine

        nccl = {"master_address": "127.0.0.1", "master_port": a.port, "backend": "gloo"}
        launcher = None
        if a.restart:  # the engine launches (and restarts) the servers itself
            from mcore_rl.rollout.sglang.launcher import MCORE_RL_SERVE_COMMAND

            launcher = {"num_servers": 2, "command": MCORE_RL_SERVE_COMMAND + ["--num-threads", "1"],
                        "log_dir": a.log_dir, "health_timeout_s": 120, "monitor_interval_s": 0.3}  # fmt: skip
        engine = SGLangEngine(urls, tp_size=1, bucket_mb=a.bucket_mb, nccl=nccl, launcher=launcher,
                              model_path=a.hf)  # fmt: skip
        urls = engine.cfg.worker_urls
    urls = D.broadcast_object(urls, 0)
    res: dict = {"before": policy_diff(policy, engine_samples(urls) if engine else None)}
    stats = sync_weights(policy, engine, 7, a.mode, SyncOptions(bucket_mb=a.bucket_mb))
    res.update(stats)
    res["after"] = policy_diff(policy, engine_samples(urls) if engine else None)
    if a.restart:
        restart_and_resync(policy, engine, urls, res, a.bucket_mb)
    if engine is not None:
        res["version"] = engine.weight_version
        res["stage_groups"] = sorted(engine.stage_groups)
        res["model_mb"] = sum(p.numel() * 4 for p in policy.model.parameters()) / 2**20  # this rank's shard
    if D.global_rank() == 0:
        torch.save(res, a.out)
        engine.close()
    D.barrier()


if __name__ == "__main__":
    main()
