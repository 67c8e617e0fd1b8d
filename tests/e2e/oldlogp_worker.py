"""One tiny async training run (single process or torchrun) that records every round's old log-probs, then
scores the same tokens against a reference built from each version's HF folder (rollout.sync_mode=disk).

    python tests/e2e/oldlogp_worker.py OUT.json override ...     (or under torchrun)

The reference: for each weight version v present in the consumed tokens, a fresh forward-only Policy loads
v's folder (v0 = the initial model) and scores every recorded row; each token takes the value of its own
version. The recorded `recompute` is the trainer's forward with its live weights on the same rows, just before
the source runs (what old_logp_source=recompute would have used). Rank 0 pauses the engine while the trainer
trains (see below) so that weight updates land mid-sample deterministically.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HOLD_AFTER_TOKENS = 16
HOLD_AFTER_SAMPLES = 2


def _local_progress(c, state) -> bool:
    """Local engine: samples of the next round have finished (stale when consumed) and one is half-way."""
    if not c.engine.num_running:
        return True
    longest = max((len(r.out) for r in list(c.engine._batch.rows)), default=0)
    return len(c.schedule.finished_samples()) >= HOLD_AFTER_SAMPLES and longest >= HOLD_AFTER_TOKENS


def _remote_progress(c, state) -> bool:
    """SGLang (servers decoding one sample at a time): a sample of the current version has finished (stale when
    consumed); the ones decoding now are in flight at the sync."""
    futures = [f for rnd in c.schedule.pending for r in rnd.requests if r.futures for f in r.futures]
    if all(f.done() for f in futures):
        return True
    return any(s.weight_versions and s.weight_versions[0] == state.version for s in c.schedule.finished_samples())


def main(out: str, overrides: list[str]) -> None:
    import torch
    from hydra import compose, initialize_config_dir

    from mcore_rl.config import load_config
    from mcore_rl.train import CONFIG_DIR
    from mcore_rl.trainer.build import build
    from mcore_rl.trainer.loop import train

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    c, state = build(cfg)
    T = cfg.trainer.temperature
    records: list[dict] = []
    anchors = c.learner.anchors

    def recording_anchors(rb, version):
        recompute = c.policy.logprobs(rb.policy_batch(), T)
        out_ = anchors(rb, version)
        records.append({"tokens": rb.tokens, "mask": rb.loss_mask, "versions": rb.versions,
                        "old": out_.get("old_logp"), "recompute": recompute, "version": version})
        return out_

    c.learner.anchors = recording_anchors
    if c.engine is not None:  # rank 0: an engine slower than the trainer, made deterministic
        # generation is paused (KV cache kept) from shortly after a round is handed over until the weight sync:
        # by then a few samples of the rounds ahead have finished (stale when consumed) and one is half-way, so
        # each sync lands mid-sample and that sample spans two versions (interrupt mode restarts it instead)
        generate, publish = c.rounds.next, c.weights.publish
        wait_for = _local_progress if hasattr(c.engine, "_batch") else _remote_progress

        def held_generate(n, st):
            out_ = generate(n, st)
            deadline = time.monotonic() + 10.0
            while not wait_for(c, st) and time.monotonic() < deadline:
                time.sleep(0.005)
            c.engine.pause("in_place")
            return out_

        def resuming_publish(st):
            out_ = publish(st)
            c.engine.resume()
            return out_

        c.rounds.next, c.weights.publish = held_generate, resuming_publish
    train(c, state)

    from mcore_rl.policy.policy import Policy
    from mcore_rl.rollout.weight_sync.disk_sync import versioned_dir
    from mcore_rl.trainer.setup import policy_config

    versions = sorted({v for r in records for v in r["versions"][r["mask"] > 0].tolist()})
    ref_pol = Policy(c.model_dir, policy_config(cfg), trainable=False)
    refs = [torch.zeros_like(r["mask"]) for r in records]
    sync_dir = Path(cfg.rollout.sync_dir)
    for v in versions:
        ref_pol.load_hf(c.model_dir if v == 0 else versioned_dir(sync_dir, v))
        for r, ref in zip(records, refs):
            from mcore_rl.policy.step import PolicyBatch as PB

            lp = ref_pol.logprobs(PB(r["tokens"], r["mask"], {}), T)
            if lp is not None:
                sel = r["versions"] == v
                ref[sel] = lp[sel]
    from megatron.core import parallel_state as ps

    if not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0):
        return
    res = {"source": cfg.algorithm.old_logp_source, "rounds": len(records), "rows": 0, "spanning_rows": 0, "stale_tokens": 0, "tokens": 0,
           "max_diff": 0.0, "recompute_max_diff": 0.0, "recompute_max_diff_stale": 0.0, "versions": versions}
    for r, ref in zip(records, refs):
        m = r["mask"] > 0
        res["rows"] += int((m.sum(1) > 0).sum())
        for i in range(m.shape[0]):
            res["spanning_rows"] += int(len(set(r["versions"][i][m[i]].tolist())) > 1)
        stale = m & (r["versions"] != r["version"])
        res["stale_tokens"] += int(stale.sum())
        res["tokens"] += int(m.sum())
        if r["old"] is not None:
            res["max_diff"] = max(res["max_diff"], (r["old"] - ref)[m].abs().max().item())
        res["recompute_max_diff"] = max(res["recompute_max_diff"], (r["recompute"] - ref)[m].abs().max().item())
        if stale.any():
            res["recompute_max_diff_stale"] = max(res["recompute_max_diff_stale"],
                                                  (r["recompute"] - ref)[stale].abs().max().item())
    metrics = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    res["metrics"] = metrics[-1] if metrics else {}
    res["records"] = metrics
    res["audit_errors"] = [m_.get("old_logp_error") for m_ in metrics if "old_logp_error" in m_]
    Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
