"""The report parts every experiment shares: a per-arm table with 95% intervals over seeds and held-out prompts,
the compute each arm spent (wall-clock, CPU-seconds, FLOPs) and where its time went, the machine and its load, and
accuracy curves drawn as bands. Numbers come only from experiments/<name>/data/ (what `--report-only` rebuilds).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from common import PHASES, Arm, arm_meta, evals, train_records
from stats import Interval, bootstrap_interval, curve, difference_interval, plot_bands, time_to_target


@contextmanager
def figure_panels(out: Path, rows: int = 1, **subplots_kw) -> Iterator:
    """matplotlib axes ([rows, 2], headless Agg backend); the figure is laid out, saved to `out` and closed when the
    block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 2, figsize=(11, 0.4 + 3.2 * rows), dpi=80, squeeze=False, **subplots_kw)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(out)
    finally:
        plt.close(fig)


def scores_at(per_seed: dict[int, list[dict]], which: str = "last") -> list:
    """Each seed's per-prompt fractions correct (or its mean@k) at its first or last eval record."""
    rows = [recs[0] if which == "first" else recs[-1] for recs in per_seed.values() if recs]
    if rows and all("correct" in r for r in rows) and len({len(r["correct"]) for r in rows}) == 1:
        return [r["correct"] for r in rows]
    return [r["mean_at_k"] for r in rows]


def interval_at(per_seed: dict[int, list[dict]], which: str = "last") -> Interval | None:
    scores = scores_at(per_seed, which)
    return bootstrap_interval(scores) if scores else None


def mean_sd(xs: list[float], spec: str = ".0f") -> str:
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], spec)
    return f"{statistics.fmean(xs):{spec}} ± {statistics.stdev(xs):{spec}}"


def _per_machine(values: dict[int, float], machines: dict[int, str], spec: str) -> str:
    """mean ± sd over seeds, per machine kind where an arm's seeds ran on more than one (never one mean over both)."""
    groups: dict[str, list[float]] = {}
    for seed, v in values.items():
        groups.setdefault(machines.get(seed, "?"), []).append(v)
    if len(groups) == 1:
        return mean_sd(next(iter(groups.values())), spec)
    return "; ".join(f"{mean_sd(v, spec)} ({k})" for k, v in sorted(groups.items()))


def arm_table(exp_dir: Path, arms: list[Arm]) -> list[str]:
    """One row per arm: seeds finished, the machine kinds they ran on, held-out accuracy before and after training
    with 95% intervals, compute (mean ± sd over seeds; wall and CPU per machine kind) and the share of the
    trainer's time by phase."""
    letters = machine_letters(exp_dir)
    lines = [
        "| arm | seeds | machine | mean@k before [95%] | mean@k after [95%] | wall (min) | CPU (min) | FLOPs | "
        "generate / reward / old-logp / train / sync / switch (% of phase time) | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    used: set[str] = set()
    for arm in arms:
        per_seed = evals(exp_dir, arm)
        if not per_seed:
            lines.append(f"| {arm.label} | 0 (not run) | | | | | | | | |")
            continue
        last = {seed: recs[-1] for seed, recs in per_seed.items()}
        metas = arm_meta(exp_dir, arm)
        finished = {seed: meta for seed, meta in metas.items() if seed in per_seed}
        machines = {seed: seed_machine(meta, letters) for seed, meta in finished.items()}
        used |= {machine_kind(s) for meta in finished.values() for s in meta["segments"]}
        before, after = interval_at(per_seed, "first"), interval_at(per_seed, "last")
        trains = train_records(exp_dir, arm)
        totals = {k: sum(r.get(k, 0.0) for recs in trains.values() for r in recs) for k in PHASES}
        whole = sum(totals.values())
        split = " / ".join(f"{100 * totals[k] / whole:.0f}" for k in PHASES) if whole > 0 else "n/a"
        loads = [s["load_mean"] for m in metas.values() for s in m["segments"]]
        lines.append(
            f"| {arm.label} | {len(per_seed)} | {', '.join(sorted(set(machines.values())))} | {before.cell()} | "
            f"{after.cell()} | {_per_machine({k: r['wallclock_s'] / 60 for k, r in last.items()}, machines, '.1f')} | "
            f"{_per_machine({k: r['cpu_s'] / 60 for k, r in last.items()}, machines, '.1f')} | "
            f"{mean_sd([r.get('flops', float('nan')) for r in last.values()], '.2e')} | {split} | "
            f"{f'{statistics.fmean(loads):.1f}' if loads else 'n/a'} |"
        )
    if used:
        lines += ["", machine_legend(letters, used)]
    return lines


def difference_rows(exp_dir: Path, pairs: list[tuple[Arm, Arm]]) -> list[str]:
    """Final accuracy differences of arm pairs on the shared prompts, with 95% intervals (needs per-prompt data)."""
    lines = ["| comparison | final mean@k difference [95%] |", "|---|---|"]
    for a, b in pairs:
        sa, sb = scores_at(evals(exp_dir, a)), scores_at(evals(exp_dir, b))
        ok = sa and sb and isinstance(sa[0], list) and isinstance(sb[0], list) and len(sa[0]) == len(sb[0])
        cell = difference_interval(sa, sb).cell("+.3f") if ok else "n/a (not run or no per-prompt data)"
        lines.append(f"| {a.label} - {b.label} | {cell} |")
    return lines


def _dtype(segment: dict) -> str:
    dtypes = [c.split("=", 1)[1] for c in segment.get("command", []) if c.startswith("model.dtype=")]
    return dtypes[-1] if dtypes else "?"


def _route(segment: dict) -> str:
    """How a bf16 segment's matrix products ran: through fp32 GEMMs (compat/bf16_matmul.py, CPUs without bf16
    matrix hardware) or torch's own kernels. A segment without the record ran before that route existed: native."""
    if _dtype(segment) != "bf16":
        return ""
    return " (bf16 products through fp32 GEMMs)" if segment.get("bf16_matmul") == "fp32 GEMM" else " (native bf16)"


def machine_kind(segment: dict) -> str:
    """The machine a segment's wall-clock and CPU-seconds belong to: CPU model, cores, model.dtype and the bf16
    route (the host name and the load do not make another kind). Times compare only within one kind: the queue
    runs over several days on whichever machine it lands, and one CPU model name covers parts with and without
    bf16 matrix hardware (segments named "AMD EPYC" ran bf16 natively on one part, through fp32 GEMMs on another)."""
    return (f"{segment.get('cpu_model', '?')}, {segment.get('cpu_count', '?')} cores, "
            f"model.dtype={_dtype(segment)}{_route(segment)}")


def machine_letters(exp_dir: Path) -> dict[str, str]:
    """A letter per machine kind over every arm of the experiment, so that all of a results.md's tables agree."""
    kinds = {machine_kind(s) for f in (exp_dir / "data").glob("*/seed*.arm.json")
             for s in json.loads(f.read_text()).get("segments", [])}
    return {k: chr(ord("A") + i) for i, k in enumerate(sorted(kinds))}


def seed_machine(meta: dict, letters: dict[str, str]) -> str:
    """The machine letter(s) of one run: "A+B" where a resume moved it to another machine kind."""
    return "+".join(sorted({letters[machine_kind(s)] for s in meta["segments"]})) or "?"


def machine_legend(letters: dict[str, str], used: set[str]) -> str:
    return "Machines: " + "; ".join(f"{v} = {k}" for k, v in letters.items() if k in used) + "."


def arm_machines(exp_dir: Path, arm: Arm) -> set[str]:
    """The machine kinds an arm's finished runs ran on (more than one: its wall-clock mean mixes machines)."""
    return {machine_kind(s) for meta in arm_meta(exp_dir, arm).values() for s in meta["segments"]}


def machine_lines(exp_dir: Path, arms: list[Arm]) -> list[str]:
    """Which machine(s) the segments ran on, in which dtype, and how loaded the machine was: wall-clock comparisons
    depend on all three."""
    seen: dict[str, list[float]] = {}
    for arm in arms:
        for meta in arm_meta(exp_dir, arm).values():
            for s in meta["segments"]:
                key = (f"{s.get('cpu_model', '?')}, {s.get('cpu_count', '?')} cores ({s.get('host', '?')}), "
                       f"model.dtype={_dtype(s)}{_route(s)}")
                seen.setdefault(key, []).append(s["load_mean"])
    if not seen:
        return ["Machine: no runs recorded yet."]
    return [
        f"Machine: {k}; {len(v)} segments, 1-minute load average {min(v):.1f}-{max(v):.1f} "
        f"(mean {statistics.fmean(v):.1f})."
        for k, v in seen.items()
    ]


def plot_curves(exp_dir: Path, groups: list[tuple[str, list[Arm]]], out: Path,
                ylabel: str = "held-out mean@4") -> None:
    """Accuracy against updates and against wall-clock (mean over seeds), 95% bands over seeds and prompts: one row
    of two panels per (title, arms) group that has runs, so overlapping bands stay few enough to read; an arm keeps
    its colour (its place in the group) whether or not the arms before it have run, and its legend entry says how
    many seeds it has."""
    runs, shown = [], set()
    for title, arms in groups:  # a row whose runs all appear in an earlier row adds nothing
        ran = [(i, arm, per_seed) for i, arm in enumerate(arms) if (per_seed := evals(exp_dir, arm))]
        if {arm.name for _, arm, _ in ran} - shown:
            runs.append((title, ran))
            shown |= {arm.name for _, arm, _ in ran}
    runs = runs or [("no finished runs yet", [])]
    with figure_panels(out, rows=len(runs)) as axes:
        axes[0, 0].figure.suptitle("mean over seeds; band: 95% interval (bootstrap over seeds x held-out prompts)",
                                   fontsize=9)
        for (title, arms), row in zip(runs, axes):
            for i, arm, per_seed in arms:
                label = f"{arm.label} ({len(per_seed)} seed{'s' if len(per_seed) > 1 else ''})"
                plot_bands(row[0], curve(per_seed, "step"), label, color=f"C{i}")
                plot_bands(row[1], curve(per_seed, "wallclock_s"), label, x_scale=1 / 60, color=f"C{i}")
            n_kinds = len(set().union(*(arm_machines(exp_dir, arm) for _, arm, _ in arms)))
            mixed = f" ({n_kinds} machine kinds: compare in updates)" if n_kinds > 1 else ""
            for ax, xl, note in zip(row, ("optimizer updates", "wall-clock (min, held-out eval excluded)"), ("", mixed)):
                ax.set_xlabel(xl)
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                ax.set_title(title + note, fontsize=9, fontweight="bold")
            if arms:
                row[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)


def metric_curve(per_seed: dict[int, list[dict]], key: str) -> list[tuple[float, Interval]]:
    """A training metric per update: the mean over seeds and a 95% bootstrap interval over seeds, at the updates
    every seed logged it."""
    by_step = [{r["step"]: r[key] for r in recs if key in r} for recs in per_seed.values()]
    by_step = [d for d in by_step if d]
    if not by_step:
        return []
    common = sorted(set.intersection(*(set(d) for d in by_step)))
    return [(float(step), bootstrap_interval([d[step] for d in by_step])) for step in common]


def plot_train_metrics(exp_dir: Path, panels: list[tuple[list[Arm], str, str]], out: Path) -> None:
    """Two panels of training metrics against updates, one (arms, metric key, y label) each, with bands over seeds:
    what the accuracy curves cannot show (how far off-policy an update was, how much of it was clipped)."""
    with figure_panels(out) as axes:
        for ax, (arms, key, ylabel) in zip(axes[0], panels):
            for arm in arms:
                plot_bands(ax, metric_curve(train_records(exp_dir, arm), key), arm.label)
            ax.set_xlabel("optimizer updates")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.set_title("mean over seeds; band: 95% interval over seeds", fontsize=8)
            ax.legend(fontsize=7)


def time_to_target_rows(exp_dir: Path, arms: list[Arm], pairs: list[tuple[Arm, Arm]],
                        fractions: tuple[float, ...] = (0.5, 1.0)) -> list[str]:
    """Wall-clock, CPU time and compute (FLOPs) for each finished arm's mean curve to reach common targets, and the
    ratios of arm pairs, with 95% intervals (stats.time_to_target). Wall and CPU ratios only between arms that ran
    on one machine kind: the queue lands on different machines over its days, and a ratio across them would
    measure the machines. FLOPs compare across machines."""
    ran, per_arm = [], []
    for arm in arms:
        if per_seed := evals(exp_dir, arm):
            ran.append(arm)
            per_arm.append(per_seed)
    if not ran:
        return ["No arm has finished yet."]
    base = statistics.fmean(float(np.mean(scores_at(p, "first"))) for p in per_arm)
    low = min(float(np.mean(scores_at(p, "last"))) for p in per_arm)
    if low <= base:
        return [f"No common target: an arm ended at or below the base accuracy ({low:.3f} <= {base:.3f})."]
    kinds = [arm_machines(exp_dir, a) for a in ran]
    letter = machine_letters(exp_dir)
    lines = ["Target: the base accuracy plus a fraction of the smallest gain any finished arm made (100%: the "
             "lowest final mean), so every arm's curve reaches it. Time for the arm's mean curve over seeds and "
             "held-out prompts to reach it, interpolated between eval points; 95% interval by bootstrap over seeds "
             "and prompts, target recomputed per replicate. Wall and CPU exclude held-out evaluation; compute is "
             "the FLOPs spent (generation, scoring and training), the same on any machine.", "",
             "| target | arm | machine | wall (min) [95%] | CPU (min) [95%] | compute (TFLOP) [95%] |",
             "|---|---|---|---|---|---|"]
    idx = {a.name: i for i, a in enumerate(ran)}
    ratio_rows = []
    for f in fractions:
        wall, cpu = time_to_target(per_arm, f, "wallclock_s"), time_to_target(per_arm, f, "cpu_s")
        flops = time_to_target(per_arm, f, "flops")
        label = f"{f:.0%} of the gain ({wall.target:.3f})"
        lines += [f"| {label} | {a.label} | {'+'.join(sorted(letter[k] for k in kinds[i]))} | "
                  f"{wall.times[i].cell(1 / 60)} | {cpu.times[i].cell(1 / 60)} | {flops.times[i].cell(1e-12, '.0f')} |"
                  for i, a in enumerate(ran)]
        for a, b in pairs:
            if a.name not in idx or b.name not in idx:
                continue
            i, j = idx[a.name], idx[b.name]
            same = len(kinds[i]) == 1 and kinds[i] == kinds[j]
            times = (f"{wall.ratio(i, j).cell(spec='.2f')} | {cpu.ratio(i, j).cell(spec='.2f')}" if same
                     else "n/a (different machines) | n/a (different machines)")
            ratio_rows.append(f"| {label} | {a.label} / {b.label} | {times} | {flops.ratio(i, j).cell(spec='.2f')} |")
    lines += ["", machine_legend(letter, set().union(*kinds))]
    if ratio_rows:
        lines += ["", "| target | ratio | wall [95%] | CPU [95%] | compute [95%] |", "|---|---|---|---|---|",
                  *ratio_rows]
    return lines


def train_metric(exp_dir: Path, arm: Arm, key: str, agg: str = "mean") -> str:
    """One training metric of an arm: its mean (or max) over each seed's updates, then the mean over seeds."""
    per_seed = [[r[key] for r in recs if key in r] for recs in train_records(exp_dir, arm).values()]
    per_seed = [statistics.fmean(xs) if agg == "mean" else max(xs) for xs in per_seed if xs]
    if not per_seed:
        return "n/a"
    v = statistics.fmean(per_seed)
    return f"{v:.1e}" if 0 < abs(v) < 5e-4 else f"{v:.3f}"  # a rare event stays visible, not rounded to 0.000


def train_metric_table(exp_dir: Path, arms: list[Arm], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown rows: one per arm, one column per (header, metric key, "mean" | "max") of its training records
    (what a mechanism looks like: how often a clip or a veto acted, how far the policy moved)."""
    lines = ["| arm | " + " | ".join(h for h, _, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for arm in arms:
        lines.append(f"| {arm.label} | " + " | ".join(train_metric(exp_dir, arm, k, agg) for _, k, agg in columns)
                     + " |")
    return lines
