"""The end-of-run speed summary: tokens/s per phase and the fraction of the matmul roofline reached.

Why: a run's wall-clock alone does not say whether a phase is slow because the machine is slow or because the
code leaves the hardware idle. The roofline is the `torch.mm` rate of the run's dtype on this machine (the one
`model.dtype=auto` measured at start-up, else measured at the end, ~0.6 s); the achieved rate is the phase's
model FLOPs (`evaluation/compute.py`: 2 x non-embedding params x tokens + attention per forward, so the LM head
is not counted and the fraction is a lower bound) over its seconds; training's is the one to compare with
`benchmarks/policy_step.py`. Generation gets no such fraction: the FLOP accounting charges a prompt's prefill once
per sample (the engine prefills it once for all n) and a decode step is bound by streaming the weights, not by the
matmul peak, so the quotient read 92% on a main job whose engine ran at a third of its real bound. The embedded
engine's decode is set instead against its decode roofline, min(matmul, weight + KV streaming) for the steps it
ran (`rollout/local/decode_meter.py`), as `benchmarks/rollout_engine.py` does.

Built from the run directory's own metrics.jsonl / eval.jsonl, over the updates up to the last evaluation
record that carries the cumulative FLOP counters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from mcore_rl.metrics_log import read_jsonl


@dataclass
class PhaseSpeed:
    phase: str
    seconds: float
    tokens: float | None = (
        None  # generated (generate, eval), trained fwd+bwd (train) or scored (score) tokens
    )
    gflops: float | None = None  # achieved model GFLOP/s
    roofline_frac: float | None = None  # gflops / the dtype's torch.mm GFLOP/s (decode: bound time / time)
    roof: str = "roofline"  # what roofline_frac is a fraction of, as printed
    what: str = ""  # printed after the seconds: what they cover, where the phase name does not say
    gb_per_s: float | None = None  # weight sync only
    overlapped: bool = False  # generate under async: `seconds` is the trainer's wait, not the engine's work

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens is not None and self.seconds > 0 else None


def _phase(
    name: str, seconds: float, tokens: float | None, flops: float | None, roof: float | None
) -> PhaseSpeed:
    gflops = flops / seconds / 1e9 if flops is not None and seconds > 0 else None
    frac = gflops / roof if gflops is not None and roof else None
    return PhaseSpeed(name, seconds, tokens, gflops, frac)


def _decode(seconds: float, tokens: float, bound_s: float) -> PhaseSpeed:
    """The embedded engine's decode steps (evaluation's too) against their decode roofline (`bound_s`: its
    seconds for the same steps); absent (0 s) for SGLang, which reports its own speed."""
    return PhaseSpeed("decode", seconds, tokens, roofline_frac=bound_s / seconds if seconds > 0 else None,
                      roof="decode roofline", what=" in the engine's decode steps (evaluation's included)")


def phase_speeds(run_dir: str | Path, roof_gflops: float | None) -> list[PhaseSpeed]:
    """Per phase: seconds, tokens/s and, where FLOPs are counted, GFLOP/s and the roofline fraction."""
    run_dir = Path(run_dir)
    train, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    counted = [e for e in evals if "flops_train" in e]
    last = counted[-1] if counted else {}
    upto = last.get("step", float("inf"))
    recs = [r for r in train if r.get("step", 0) <= upto]

    def total(key: str, rows: list[dict] = recs) -> float:
        return sum(float(r.get(key, 0.0)) for r in rows)

    # a round's own counts (tokens generated, the engine's decode work) ride on each of its updates' records; only
    # the round's last record carries time_sync (trainer/loop.py), so counting those counts each round once
    rounds = [r for r in recs if "time_sync" in r] or recs
    # async (rounds generated ahead, `inflight_rounds` > 0): generation overlaps training and time_generate is only
    # what the trainer waited, so tokens over it would claim rates above the roofline (measured: 392% at k=2)
    overlapped = any(r.get("inflight_rounds", 0) > 0 for r in recs)
    generate = (PhaseSpeed("generate", total("time_generate"), overlapped=True) if overlapped else
                PhaseSpeed("generate", total("time_generate"), total("rollout_tokens", rounds)))
    out = [
        generate,
        _decode(*(total(f"engine_decode_{k}", rounds) for k in ("s", "tokens", "bound_s"))),
        _phase(
            "train", total("time_train"), last.get("tokens_trained"), last.get("flops_train"), roof_gflops
        ),
        _phase("score", total("time_old_logp"), None, last.get("flops_score"), roof_gflops),
    ]
    eval_tokens = sum(e.get("response_len", 0.0) * e.get("num_prompts", 0.0) * e.get("k", 1.0) for e in evals)
    out.append(_phase("eval", total("time_eval", evals), eval_tokens or None, None, None))
    sync = PhaseSpeed("sync", total("time_sync"))
    if total("sync_gb") > 0 and sync.seconds > 0:
        sync.gb_per_s = total("sync_gb") / sync.seconds
    out.append(sync)
    # phases the run did not have (no old-logp pass) are left out
    return [p for p in out if p.seconds >= 0.01]


def speed_summary(run_dir: str | Path, dtype: str | None, roof_gflops: float | None) -> tuple[dict, str]:
    """(record, printed lines): the record goes to run_dir/summary.jsonl, the lines to the console."""
    phases = phase_speeds(run_dir, roof_gflops)
    roof = f"{roof_gflops:,.0f} GFLOP/s" if roof_gflops else "not measured"
    lines = [f"  speed ({dtype or '?'} torch.mm roofline {roof}):"]
    for p in phases:
        waited = " waited (generation overlapped training: no rate from the wait)" if p.overlapped else ""
        bits = [f"{p.seconds:,.1f} s{p.what}{waited}"]
        if p.tokens_per_s is not None:
            bits.append(f"{p.tokens_per_s:,.1f} tok/s")
        if p.gflops is not None:
            bits.append(f"{p.gflops:,.1f} GFLOP/s")
        if p.roofline_frac is not None:
            bits.append(f"{p.roofline_frac:.1%} of {p.roof}")
        if p.gb_per_s is not None:
            bits.append(f"{p.gb_per_s:,.2f} GB/s")
        lines.append(f"    {p.phase:>8}: " + ", ".join(bits))
    record = {
        "dtype": dtype,
        "matmul_gflops": roof_gflops,
        "phases": {p.phase: {**asdict(p), "tokens_per_s": p.tokens_per_s} for p in phases},
    }
    return record, "\n".join(lines)


def write_speed_summary(run_dir: str | Path, dtype: str | None, roof_gflops: float | None) -> str:
    """Append the record to run_dir/summary.jsonl (one line per finished run or resumed segment); return the lines."""
    record, text = speed_summary(run_dir, dtype, roof_gflops)
    with open(Path(run_dir) / "summary.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return text
