"""CPU time, page faults and resident memory of policy training steps under three glibc malloc settings, each in
its own process, run side by side (same load for all three): `tuned` (`mcore_rl.compat.malloc.tune_malloc`, what
mcore-rl-train uses), `trim-only` (arenas + trim threshold, glibc's mmap threshold left frozen at 128 KiB), and
`glibc` (no tuning).

    python benchmarks/malloc_step.py [--model smollm2|tiny] [--dtype bf16|fp32] [--batch 32] [--seq 64] [--steps 10]

Why CPU time and not wall-clock: the three share the machine; the kernel's zero-filling of fresh mmaps shows up as
system time and minor page faults, and the resident-memory column shows whether a setting lets memory creep.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile

MODES = ("tuned", "trim-only", "glibc")


def child(a: argparse.Namespace) -> dict:
    if a.child == "tuned":
        from mcore_rl.compat.malloc import tune_malloc

        tune_malloc()
    elif a.child == "trim-only":  # tune_malloc's arena and trim settings without its mmap threshold
        from mcore_rl.compat import malloc

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(malloc.M_ARENA_MAX, 2)
        libc.mallopt(malloc.M_TRIM_THRESHOLD, 64 << 20)
    import torch

    torch.set_num_threads(1)
    from mcore_rl.config.optim import OptimSettings
    from mcore_rl.distributed import init_distributed
    from mcore_rl.policy.policy import Policy, PolicyConfig
    from mcore_rl.policy.step import PolicyBatch

    if a.model == "smollm2":
        from mcore_rl.models.smollm2 import materialize_smollm2

        hf = materialize_smollm2()
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.conftest import save_random_hf, tiny_llama_config

        hf = save_random_hf(tempfile.mkdtemp(), tiny_llama_config())
    init_distributed(1, 1)
    cfg = PolicyConfig(optim=OptimSettings(lr=1e-5, clip_grad=1.0), token_budget=512)
    cfg.build.dtype = a.dtype
    policy = Policy(hf, cfg)
    policy.load_hf(hf)
    tokens = torch.randint(
        0, policy.args.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)
    )
    batch, n = PolicyBatch(tokens, torch.ones(a.batch, a.seq)), a.batch * a.seq

    def step() -> None:
        policy.zero_grad()
        policy.forward_backward(batch, lambda mb, lp, ent: (-(lp * mb.loss_mask).sum() / n, {}))
        policy.optimizer_step()

    step()  # warm-up (compiles)
    r0, rss = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(a.steps):
        step()
        rss.append(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"mode": a.child, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
            "minor_faults": r1.ru_minflt - r0.ru_minflt, "rss_first_gb": rss[0], "rss_last_gb": rss[-1],
            "peak_rss_gb": r1.ru_maxrss / 2**20}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    args = ["--model", a.model, "--dtype", a.dtype, "--batch", str(a.batch), "--seq", str(a.seq),
            "--steps", str(a.steps)]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = {m: subprocess.Popen([sys.executable, __file__, "--child", m, *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=env) for m in MODES}  # fmt: skip
    rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs.values()]
    print(
        f"{a.model} {a.dtype}, {a.batch} x {a.seq} tokens, {a.steps} steps, one thread per process, side by side"
    )
    print(
        f"{'mode':<10}{'CPU s':>8}{'system s':>10}{'minor faults':>14}{'RSS step 1 GB':>15}{'last GB':>9}{'peak GB':>9}"
    )
    base = rows[0]["user_s"] + rows[0]["sys_s"]
    for r in rows:
        cpu = r["user_s"] + r["sys_s"]
        print(f"{r['mode']:<10}{cpu:>8.1f}{r['sys_s']:>10.1f}{r['minor_faults']:>14,}{r['rss_first_gb']:>15.2f}"
              f"{r['rss_last_gb']:>9.2f}{r['peak_rss_gb']:>9.2f}   CPU {cpu / base:.2f}x tuned")  # fmt: skip


if __name__ == "__main__":
    main()
