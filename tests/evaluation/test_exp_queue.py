"""The experiments' resumable queue (experiments/plan.py, common.run_arm/arms_main): a finished (arm, seed) is never
re-run, an interrupted one resumes from its checkpoint, a run that died before its first checkpoint restarts with
its leftovers kept; and every arm of every experiment composes and validates against the trainer's schemas."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

EXP = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXP))

import plan  # noqa: E402
from plan import RunState, decide  # noqa: E402


@pytest.mark.parametrize(
    "state, steps, action",
    [
        (RunState(), 24, "start"),
        (RunState(done_steps=24, has_files=True), 24, "skip"),
        (RunState(done_steps=16, has_files=True), 24, "restart"),  # a marker for fewer updates, no checkpoint
        (RunState(checkpoint_update=12, last_eval_step=12, last_rc=1, has_files=True), 24, "resume"),
        (RunState(checkpoint_update=24, last_eval_step=18, last_rc=-9, has_files=True), 24, "resume"),
        (RunState(last_rc=0, last_eval_step=24, checkpoint_update=24, has_files=True), 24, "finish"),
        (RunState(last_rc=-15, last_eval_step=0, has_files=True), 24, "restart"),
        (
            RunState(done_steps=24, checkpoint_update=24, last_rc=0, last_eval_step=24, has_files=True),
            48,
            "resume",
        ),
    ],
)
def test_decide(state, steps, action):
    assert decide(state, steps)[0] == action


def test_plan_orders_seeds_outer_and_keeps_each_runs_state():
    states = {("a", 1): RunState(done_steps=8, has_files=True), ("b", 2): RunState(checkpoint_update=4)}
    jobs = plan.plan([("a", 8), ("b", 8)], [1, 2], states)
    assert [(j.seed, j.arm, j.action) for j in jobs] == [
        (1, "a", "skip"),
        (1, "b", "start"),
        (2, "a", "start"),
        (2, "b", "resume"),
    ]


def test_an_arm_capped_at_one_seed_runs_once_per_queue(tmp_path, monkeypatch, capsys):
    """A measurement arm (max_seeds=1: the PPO-EWMA audits) joins the queue for the first seed only; the compared
    arms still get every seed."""
    import common

    monkeypatch.setattr(common, "EXP_ROOT", tmp_path / "runs")
    arms = [common.Arm("cmp", "C", [], steps=4), common.Arm("audit", "A", [], steps=2, max_seeds=1)]
    monkeypatch.setattr(sys, "argv", ["run.py", "--seeds", "3", "--dry-run"])
    common.arms_main("doc", tmp_path, "exp", arms, (), report=lambda _: None)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["seed 1234 cmp", "seed 1234 audit", "seed 1235 cmp", "seed 1236 cmp"]
    # --headline (queue.sh's first pass): only the arms the claim compares
    monkeypatch.setattr(sys, "argv", ["run.py", "--seeds", "2", "--dry-run", "--headline"])
    common.arms_main("doc", tmp_path, "exp", arms, (), report=lambda _: None, headline=("cmp",))
    assert [ln.split(":")[0] for ln in capsys.readouterr().out.splitlines()] == ["seed 1234 cmp", "seed 1235 cmp"]


def test_every_experiment_names_existing_headline_arms():
    for folder, mod in _experiment_modules():
        names = {a.name for a in mod.ARMS}
        assert mod.HEADLINE and set(mod.HEADLINE) <= names, (folder, mod.HEADLINE)


def test_ppo_ewma_audit_table_reads_the_audited_runs(tmp_path):
    """The missing-old-logit error table: the updates with stale tokens of each audited anchor, n/a-free."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("exp_ppo_ewma_async", EXP / "ppo_ewma_async" / "run.py")
    exp2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp2)
    recompute, rollout = exp2.AUDITS
    d = tmp_path / "data" / recompute.name
    d.mkdir(parents=True)
    rows = [{"step": 1, "staleness_max": 0.0, "old_logp_error": 0.0, "old_logp_error_max": 0.0,
             "old_logp_stale_token_frac": 0.0},
            {"step": 2, "staleness_max": 1.0, "old_logp_error": 0.02, "old_logp_error_max": 0.5,
             "old_logp_stale_token_frac": 0.4},
            {"step": 3, "staleness_max": 2.0, "old_logp_error": 0.04, "old_logp_error_max": 0.9,
             "old_logp_stale_token_frac": 0.6}]
    (d / "seed1234.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = "\n".join(exp2.audit_table(tmp_path))
    assert f"| {recompute.label} | 2 | 0.50 | 0.0300 | 0.900 |" in table
    assert f"| {rollout.label} | 0 (not run) |" in table


def _checkpoint(run_dir: Path, update: int) -> None:
    from mcore_rl.checkpoint_io import COMPLETE, FILES_KEY

    step = run_dir / "checkpoints" / f"step_{update:06d}"
    step.mkdir(parents=True)
    (step / COMPLETE).write_text(json.dumps({FILES_KEY: {}}))


def test_probe_reads_marker_checkpoint_evals_and_exit_status(tmp_path):
    run = tmp_path / "run"
    assert plan.probe(run) == RunState()
    run.mkdir()
    (run / "eval.jsonl").write_text('{"step": 0}\n{"step": 8}\n')
    (run / "arm.json").write_text(json.dumps({"segments": [{"rc": 0}, {"rc": -9}]}))
    _checkpoint(run, 8)
    assert plan.probe(run) == RunState(None, 8, 8, -9, True)
    plan.write_marker(run, {"steps": 16})
    assert plan.probe(run).done_steps == 16 and not list(run.glob(".*tmp"))
    moved = plan.set_aside(run)
    assert moved.name == "run.interrupted1" and not run.exists() and (moved / "eval.jsonl").exists()


def test_a_committed_marker_skips_a_run_whose_directory_is_gone(tmp_path, monkeypatch, capsys):
    """Run directories live outside the repository: on another machine (or after a wiped disk) the queue finds none,
    and the DONE copy under data/ must still keep a finished arm from running again, through run_arm as through the
    plan. Without the copy the same arm would start."""
    import common

    monkeypatch.setattr(common, "EXP_ROOT", tmp_path / "runs")
    arm, exp_dir = common.Arm("a", "A", [], steps=8), tmp_path / "exp"
    committed = common.committed_marker(exp_dir, arm, 7)
    run = common.run_dir_for("exp", arm, 7)
    assert plan.decide(plan.probe(run, committed), 8)[0] == "start"
    committed.parent.mkdir(parents=True)
    committed.write_text(json.dumps({"steps": 8}))
    assert plan.probe(run, committed) == RunState(done_steps=8)
    assert plan.decide(plan.probe(run, committed), 8)[0] == "skip"
    assert plan.decide(plan.probe(run, committed), 12)[0] == "start"  # extending an arm past its marker
    monkeypatch.setattr(common, "_segment", lambda *a: pytest.fail("a finished arm ran again"))
    common.run_arm("exp", arm, 7, exp_dir=exp_dir)
    assert "skip: done (8 updates)" in capsys.readouterr().out and not run.exists()


FAKE_TRAINER = r"""
import json, os, signal, sys, time
stop = []  # SIGTERM, as the real trainer: checkpoint at the end of this update and exit 0
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
run = args["hydra.run.dir"]; steps = int(args["trainer.steps"]); every = int(args["trainer.save_every"])
ck = os.path.join(run, "checkpoints")
start = max([int(d[5:]) for d in os.listdir(ck)] if os.path.isdir(ck) else [0])
crash = int(os.environ.get("FAKE_CRASH_AT", "-1"))
with open(os.path.join(run, "calls.log"), "a") as log:
    log.write(f"start={start} seed={args['seed']}\n")
for step in range(start + 1 if start else 0, steps + 1):
    if step == crash:
        sys.exit(9)
    with open(os.path.join(run, "eval.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "mean_at_k": 0.5, "wallclock_s": step, "cpu_s": step}) + "\n")
    with open(os.path.join(run, "eval_prompts.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "per_prompt_correct": [0.25, 0.75]}) + "\n")
    if step and (step % every == 0 or stop):
        d = os.path.join(ck, f"step_{step:06d}"); os.makedirs(d)
        open(os.path.join(d, "complete.json"), "w").write('{"files": {}}')
    if stop:
        sys.exit(0)
    time.sleep(float(os.environ.get("FAKE_STEP_S", "0")))
"""

STOP_DRIVER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import common
common.EXP_ROOT, fake, seed = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
common.Arm.command = lambda self, run_dir, seed, steps=None: [sys.executable, fake, f"hydra.run.dir={run_dir}",
    f"seed={seed}", f"trainer.save_every={self.save_every}", f"trainer.steps={steps or self.steps}"]
common.install_stop_handler()
common.run_arm("exp", common.Arm("a", "A", [], steps=40, save_every=10), seed)
sys.exit(common.STOPPED_EXIT if common.stop_requested() else 0)
"""


def test_a_stop_request_checkpoints_records_the_segment_and_resumes(tmp_path):
    """SIGTERM to an experiment process (what `queue.sh --stop` sends): the running trainer is asked to stop, it
    checkpoints and exits, the segment (wall-clock, CPU) is recorded, the process exits STOPPED_EXIT; rerun, the arm
    resumes from that checkpoint. A STOP file (a request made between runs) starts no run at all."""
    import signal
    import subprocess
    import time

    import common
    import plan

    (tmp_path / "fake.py").write_text(FAKE_TRAINER)
    (tmp_path / "driver.py").write_text(STOP_DRIVER)
    root, run = tmp_path / "runs", tmp_path / "runs" / "exp" / "a" / "seed7"

    def driver(seed: int, step_s: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(EXP), str(root),
                                 str(tmp_path / "fake.py"), str(seed)], env={**os.environ, "FAKE_STEP_S": step_s})

    proc = driver(7, "0.2")
    deadline = time.time() + 60
    while time.time() < deadline and len((run / "eval.jsonl").read_text().splitlines() if (run / "eval.jsonl").exists()
                                         else []) < 4:  # fmt: skip
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == common.STOPPED_EXIT
    stopped_at = plan.probe(run).checkpoint_update
    assert stopped_at is not None and 3 <= stopped_at < 40 and not (run / plan.MARKER).exists()
    segs = json.loads((run / "arm.json").read_text())["segments"]
    assert [(s["action"], s["rc"]) for s in segs] == [("start", 0)] and segs[0]["wall_s"] >= 0.6
    assert driver(7, "0").wait(timeout=60) == 0
    assert (run / "calls.log").read_text().splitlines() == ["start=0 seed=7", f"start={stopped_at} seed=7"]
    assert json.loads((run / plan.MARKER).read_text())["steps"] == 40
    (root / "STOP").touch()
    assert driver(8, "0").wait(timeout=60) == common.STOPPED_EXIT
    assert not (root / "exp" / "a" / "seed8").exists()


def test_run_arm_resumes_after_a_crash_and_never_reruns_a_finished_arm(tmp_path, monkeypatch):
    """run_arm drives a stand-in trainer (same CLI contract: hydra.run.dir, seed, trainer.steps/save_every, resumes
    from checkpoints/): a crash at update 6 resumes from the update-4 checkpoint, the marker appears only after the
    last eval, a second call re-runs nothing, and collect() merges the per-prompt correctness into data/."""
    import common

    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    monkeypatch.setattr(common, "EXP_ROOT", tmp_path / "runs")
    monkeypatch.setattr(common, "BASE_OVERRIDES", [])
    monkeypatch.setattr(
        common.Arm,
        "command",
        lambda self, run_dir, seed, steps=None: [
            sys.executable,
            str(fake),
            f"hydra.run.dir={run_dir}",
            f"seed={seed}",
            f"trainer.save_every={self.save_every}",
            f"trainer.steps={steps or self.steps}",
        ],
    )
    arm = common.Arm("a", "A", [], steps=8, save_every=4)
    run = common.run_dir_for("exp", arm, 7)

    monkeypatch.setenv("FAKE_CRASH_AT", "6")
    monkeypatch.setenv("MCORE_RL_EXP_CODE", "abc1234")
    common.run_arm("exp", arm, 7)
    assert not (run / plan.MARKER).exists()
    assert plan.probe(run).checkpoint_update == 4

    monkeypatch.setenv("FAKE_CRASH_AT", "-1")
    monkeypatch.setenv("MCORE_RL_EXP_DROP_CHECKPOINTS", "1")  # as queue.sh runs it
    common.run_arm("exp", arm, 7)
    assert json.loads((run / plan.MARKER).read_text())["steps"] == 8
    assert not (run / "checkpoints").exists()  # finished: only the records are kept
    common.run_arm("exp", arm, 7)  # finished: skipped
    assert (run / "calls.log").read_text().splitlines() == ["start=0 seed=7", "start=4 seed=7"]
    meta = json.loads((run / "arm.json").read_text())
    assert [(s["action"], s["rc"]) for s in meta["segments"]] == [("start", 9), ("resume", 0)]
    assert meta["segments"][0]["cpu_model"] and meta["segments"][0]["cpu_count"] >= 1
    assert meta["segments"][0]["code"] == "abc1234"  # the commit queue.sh exported

    exp_dir = tmp_path / "exp_dir"
    common.collect(exp_dir, "exp", arm, 7)
    recs = common.evals(exp_dir, arm)[7]
    assert [r["step"] for r in recs] == list(range(9))  # step 5 was evaluated twice: the later record kept
    assert recs[-1]["correct"] == [0.25, 0.75]


def test_report_only_rebuilds_tables_and_plot_from_data(tmp_path, monkeypatch):
    """mu_grpo_vs_grpo's report from a synthetic data/ folder: intervals in the table, a PNG, unfinished seeds
    (no DONE marker) left out."""
    import numpy as np
    import report

    sys.path.insert(0, str(EXP / "mu_grpo_vs_grpo"))
    import run as exp1

    drawn: list[int] = []  # rows of panels per figure
    panels = report.figure_panels
    monkeypatch.setattr(report, "figure_panels", lambda out, **kw: drawn.append(kw.get("rows", 1)) or panels(out, **kw))

    rng = np.random.default_rng(0)
    for arm, gain in (("mu_grpo", 0.3), ("grpo_mu4", 0.2)):
        d = tmp_path / "data" / arm
        d.mkdir(parents=True)
        for seed in (1234, 1235, 1236):
            recs = []
            for step in (0, 12, 24):
                correct = np.clip(0.2 + gain * step / 24 + rng.normal(0, 0.2, 16), 0, 1).round(2).tolist()
                recs.append(
                    {
                        "step": step,
                        "mean_at_k": float(np.mean(correct)),
                        "correct": correct,
                        "wallclock_s": 10.0 * step,
                        "cpu_s": 15.0 * step,
                        "flops": 1e12 * step,
                    }
                )
            (d / f"seed{seed}.eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            (d / f"seed{seed}.arm.json").write_text(
                json.dumps(
                    {
                        "segments": [
                            {
                                "rc": 0,
                                "load_mean": 2.0,
                                "wall_s": 240,
                                "cpu_model": "AMD EPYC",
                                "cpu_count": 2,
                                "host": "h",
                                "command": ["mcore-rl-train", "model.dtype=bf16", f"seed={seed}"],
                            }
                        ]
                    }
                )
            )
            if seed != 1236 or arm == "mu_grpo":
                (d / f"seed{seed}.{plan.MARKER}").write_text('{"steps": 24}')
    exp1.report(tmp_path)
    text = (tmp_path / "results.md").read_text()
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0][2:], line)  # the per-arm table comes first
    assert (
        " | 3 | " in rows["Mu-GRPO, 4 stages x 6 updates"]
        and " | 2 | " in rows["GRPO mu=4, recompute anchor"]
    )
    assert "0 (not run)" in rows["GRPO on-policy (mu=1)"]
    assert text.count(" [0.") + text.count(" [-0.") >= 4  # intervals on before/after cells and the difference
    assert "AMD EPYC, 2 cores (h), model.dtype=bf16 (native bf16); 6 segments" in text
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 10_000
    assert drawn == [1]  # the ablations' row would hold only Mu-GRPO, already drawn above it: left out
    # the faster-learning arm reaches the common targets sooner at the same wall-clock per update: ratio < 1
    ratios = [ln for ln in text.splitlines() if " / GRPO mu=4, recompute anchor | " in ln]
    assert len(ratios) == 2 and all(0.0 < float(ln.split(" | ")[2].split(" [")[0]) < 1.0 for ln in ratios)
    assert all(0.0 < float(ln.split(" | ")[4].split(" [")[0]) < 1.0 for ln in ratios)  # and in FLOPs
    assert "Machines: A = AMD EPYC, 2 cores, model.dtype=bf16 (native bf16)." in text

    # GRPO's runs on another machine: its wall-clock and CPU time say nothing about the algorithms, FLOPs still do
    for meta in (tmp_path / "data" / "grpo_mu4").glob("*.arm.json"):
        meta.write_text(meta.read_text().replace("AMD EPYC", "Intel Xeon"))
    exp1.report(tmp_path)
    text = (tmp_path / "results.md").read_text()
    ratios = [ln for ln in text.splitlines() if " / GRPO mu=4, recompute anchor | " in ln]
    assert len(ratios) == 2 and all(ln.count("n/a (different machines)") == 2 for ln in ratios)
    assert all(0.0 < float(ln.split(" | ")[4].split(" [")[0]) < 1.0 for ln in ratios)
    assert ("A = AMD EPYC, 2 cores, model.dtype=bf16 (native bf16); B = Intel Xeon, 2 cores, model.dtype=bf16 "
            "(native bf16)") in text
    assert any(ln.startswith("| 100% of the gain") and "| GRPO mu=4, recompute anchor | B |" in ln
               for ln in text.splitlines())
    arm_row = next(ln for ln in text.splitlines() if ln.startswith("| GRPO mu=4, recompute anchor | 2 |"))
    assert arm_row.split(" | ")[2] == "B"  # the per-arm table names the machine too

    # one arm's seeds on two machines: its wall-clock and CPU time are given per machine, never one mean over both
    meta = tmp_path / "data" / "mu_grpo" / "seed1235.arm.json"
    meta.write_text(meta.read_text().replace("AMD EPYC", "Intel Xeon"))
    exp1.report(tmp_path)
    text = (tmp_path / "results.md").read_text()
    cells = next(ln for ln in text.splitlines() if ln.startswith("| Mu-GRPO, 4 stages x 6 updates | 3 |")).split(" | ")
    assert cells[2] == "A, B" and cells[5] == "4.0 ± 0.0 (A); 4.0 (B)" and cells[6] == "6.0 ± 0.0 (A); 6.0 (B)"


def test_segments_record_which_kernels_computed_bf16(tmp_path, monkeypatch, caplog):
    """A segment records whether its bf16 products ran through fp32 GEMMs (compat/bf16_matmul.py) or torch's
    kernels, from the trainer's own log line (the lines below are what `configure_bf16_matmul` logs), and the
    report's machine line says so."""
    import logging

    import common
    import report
    import torch

    from mcore_rl.compat import bf16_matmul
    from mcore_rl.policy import precision

    monkeypatch.setattr(precision, "_RATES", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    logs = {}
    try:
        for name, rates in (("route", (251.0, 55.0)), ("native", (188.0, 410.0))):
            monkeypatch.setattr(precision, "measure_matmul_rates", lambda r=rates: precision.MatmulRates(*r))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="mcore_rl"):
                precision.configure_bf16_matmul("auto", {"bf16"})
            logs[name] = "[x mcore_rl] " + caplog.records[-1].getMessage()
    finally:
        bf16_matmul.disable()
    logs["fp32"] = "[x mcore_rl] model.dtype=auto -> fp32"
    for name, line in logs.items():
        (tmp_path / f"{name}.log").write_text(f"start\n{line}\nend\n")
    assert [common.bf16_route(tmp_path / f"{n}.log") for n in logs] == [
        {"bf16_matmul": "fp32 GEMM"}, {"bf16_matmul": "native"}, {}]
    assert common.bf16_route(tmp_path / "missing.log") == {}
    arm = common.Arm("a", "A", [], steps=2)
    d = tmp_path / "exp" / "data" / "a"
    d.mkdir(parents=True)
    seg = {"rc": 0, "load_mean": 2.0, "cpu_model": "Intel Xeon", "cpu_count": 2, "host": "h",
           "command": ["mcore-rl-train", "model.dtype=bf16"]}
    (d / "seed1.arm.json").write_text(json.dumps({"segments": [{**seg, "bf16_matmul": "fp32 GEMM"}, seg]}))
    lines = report.machine_lines(tmp_path / "exp", [arm])
    assert lines[0].startswith("Machine: Intel Xeon, 2 cores (h), model.dtype=bf16 (bf16 products through fp32 GEMMs)")
    assert lines[1].startswith("Machine: Intel Xeon, 2 cores (h), model.dtype=bf16 (native bf16); 1 segments")
    # one CPU model name, two routes: two machine kinds, so their wall-clocks never share a mean or a ratio
    assert report.machine_letters(tmp_path / "exp") == {
        "Intel Xeon, 2 cores, model.dtype=bf16 (bf16 products through fp32 GEMMs)": "A",
        "Intel Xeon, 2 cores, model.dtype=bf16 (native bf16)": "B"}


def test_p3o_report_plots_ess_and_clip_fraction_over_training(tmp_path):
    """P3O's stability figure: ESS factor (P3O arms) and clipped fraction (GRPO arms) per update, mean over seeds
    with a band, from the runs' training records."""
    sys.path.insert(0, str(EXP))
    from report import metric_curve

    mods = dict(_experiment_modules())
    for arm, key, base in (("p3o_mu8", "ess_factor", 0.9), ("grpo_mu8", "pg_clipfrac", 0.05)):
        d = tmp_path / "data" / arm
        d.mkdir(parents=True)
        for i, seed in enumerate((1234, 1235, 1236)):
            recs = [{"step": step, key: base - 0.01 * step + 0.02 * i, "grad_norm": 1.0} for step in range(1, 17)]
            (d / f"seed{seed}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    curve = metric_curve(mods["p3o_vs_grpo"].train_records(tmp_path, mods["p3o_vs_grpo"].ARMS[0]), "ess_factor")
    assert [x for x, _ in curve] == [float(s) for s in range(1, 17)]
    first = curve[0][1]  # seeds at 0.89, 0.91, 0.93: mean 0.91, the interval inside the seeds' range
    assert abs(first.mean - 0.91) < 1e-9 and 0.89 <= first.lo <= first.mean <= first.hi <= 0.93
    mods["p3o_vs_grpo"].report(tmp_path)
    assert (tmp_path / "stability.png").stat().st_size > 10_000
    assert "![stability](stability.png)" in (tmp_path / "results.md").read_text()


def test_scaling_report_shows_what_was_left_to_learn_from(tmp_path):
    """ScaleRL's health table: per half of the run, the dropped (zero-variance) groups, retired prompts and entropy,
    mean over seeds with an interval, the peak gradient norm per seed, and the figure; seeds recorded before these
    keys were kept are left out, not read as zeros."""
    exp4 = dict(_experiment_modules())["scaling_prediction"]
    d = tmp_path / "data" / "scalerl"
    d.mkdir(parents=True)
    for i, seed in enumerate((1234, 1235)):
        recs = [{"step": s, "adv_zero_variance_group_frac": 0.6 + 0.3 * (s > 4) + 0.02 * i,
                 "pass_rate_retired_frac": 0.01 * s, "entropy": 0.8 - 0.1 * s, "grad_norm": 2.0 + s + 10 * i}
                for s in range(1, 9)]  # fmt: skip
        (d / f"seed{seed}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "seed1236.train.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")  # older keys
    lines = exp4.health_lines(tmp_path)
    row = next(x for x in lines if x.startswith("| ScaleRL (CISPO"))
    cells = row.split(" | ")
    assert cells[1] == "2" and cells[2].startswith("0.61 [0.60, 0.62] -> 0.91 [0.90, 0.92]"), row
    assert cells[4].startswith("0.55 ") and cells[5] == "10, 20 |", row
    assert (tmp_path / "train_health.png").stat().st_size > 10_000
    assert exp4.health_lines(tmp_path / "none") == []


def _experiment_modules():
    import importlib.util

    out = []
    for folder in ("mu_grpo_vs_grpo", "p3o_vs_grpo", "scaling_prediction", "ppo_ewma_async"):
        spec = importlib.util.spec_from_file_location(f"exp_{folder}", EXP / folder / "run.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.append((folder, mod))
    return out


def _experiment_arms():
    return [(folder, arm) for folder, mod in _experiment_modules() for arm in mod.ARMS]


@pytest.mark.parametrize("gpu", [False, True])
def test_every_arm_composes_and_validates(gpu):
    """What mcore-rl-train would check before loading a model, for each arm's full override list (CPU and GPU
    profile): a typo in an arm's overrides fails here, not hours into the queue."""
    import common

    from mcore_rl.config import validate
    from tests.config.keyscan import compose

    arms = _experiment_arms()
    assert len(arms) >= 16
    for folder, arm in arms:
        if gpu:
            cpu_arm, arm = arm, common.gpu_arm(arm, "/models/Qwen2.5-0.5B-Instruct")
            assert (arm.max_seeds, arm.steps, arm.save_every) == (cpu_arm.max_seeds, cpu_arm.steps, cpu_arm.save_every)
        cmd = arm.command(Path("/tmp/x"), 1234)
        overrides = [c for c in cmd[1:] if not c.startswith("hydra.")]
        cfg = compose(overrides)
        validate(cfg)
        assert cfg.seed == 1234 and cfg.trainer.steps == arm.steps, (folder, arm.name)
        assert (
            cfg.data.name == "basic_arithmetic"
            and cfg.data.exclude.seed == 1000
            and cfg.trainer.resume == "auto"
            and cfg.trainer.save_every > 0
        )
        assert cfg.model.dtype == ("bf16" if gpu else arm.dtype), (folder, arm.name)  # never `auto`
        if gpu:
            assert cfg.rollout.engine == "sglang" and cfg.model.hf_path.endswith("Qwen2.5-0.5B-Instruct")
            assert cfg.trainer.prompts_per_update == 32 and cfg.data.options.max_terms == 5  # the profile wins


@pytest.mark.slow
def test_run_arm_resumes_the_real_trainer(tmp_path, monkeypatch):
    """The real `mcore-rl-train` (tiny model): a run to 1 update, then the same arm asked for 2 resumes from the
    update-1 checkpoint (one more update, not two), writes its marker, and a third call runs nothing."""
    import common

    monkeypatch.setattr(common, "EXP_ROOT", tmp_path / "runs")
    tiny = ["model=tiny", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
            "trainer.max_new_tokens=8", "eval.max_new_tokens=8", "eval.num_prompts=3", "eval.every=1",
            "algorithm=grpo_cpu"]
    arm = common.Arm("tiny", "tiny", tiny, steps=2, save_every=1, dtype="fp32")
    common.run_arm("exp", arm, 5, steps=1)
    run = common.run_dir_for("exp", arm, 5)
    assert json.loads((run / plan.MARKER).read_text())["steps"] == 1
    common.run_arm("exp", arm, 5)
    common.run_arm("exp", arm, 5)
    meta = json.loads((run / "arm.json").read_text())
    assert [(s["action"], s["rc"]) for s in meta["segments"]] == [("start", 0), ("resume", 0)]
    assert json.loads((run / plan.MARKER).read_text())["steps"] == 2
    prompts = common.read_jsonl(run / "prompts.jsonl")
    assert [r["update"] for r in prompts] == [1, 2]  # the resume trained update 2 only
    exp_dir = tmp_path / "exp_dir"
    common.collect(exp_dir, "exp", arm, 5)
    recs = common.evals(exp_dir, arm)[5]
    assert [r["step"] for r in recs] == [0, 1, 2] and all(len(r["correct"]) == 3 for r in recs)


def test_mu_grpo_report_shows_whether_the_clip_and_the_veto_acted(tmp_path):
    """Mu-GRPO's activity table: per arm the clipped and vetoed fractions (mean over updates, then seeds; the
    veto's largest update too), the mean ratio and KL, the trigger fraction and how many A < 0 tokens came near
    the trigger (largest update), from the training records; a rare event shows as such, not as 0.000; an arm
    without runs, or a column its records lack, says n/a."""
    sys.path.insert(0, str(EXP))
    mods = dict(_experiment_modules())
    mu = mods["mu_grpo_vs_grpo"]
    d = tmp_path / "data" / "mu_grpo"
    d.mkdir(parents=True)
    for i, seed in enumerate((1234, 1235)):
        recs = [{"step": s, "pg_clipfrac": 0.0, "nav_vetoed_frac": 0.01 * s + 0.002 * i, "ratio_mean": 1.0,
                 "ppo_kl": 0.01 * (i + 1), "nav_trigger_frac": 2e-5 * (s == 4) * (i + 1),
                 "nav_rho_below_0.1": 0.02 * s} for s in range(1, 5)]
        (d / f"seed{seed}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = mu.train_metric_table(tmp_path, mu.ARMS[:2], mu.ACTIVITY)
    assert rows[0] == ("| arm | clip frac | vetoed frac | vetoed frac, max update | ratio to rollout policy | "
                       "KL to rollout policy | triggers, max update | A<0 tokens rho<0.1, max update | "
                       "A<0 tokens rho<0.01, max update |")
    # vetoed 0.010..0.040 and 0.012..0.042 (means 0.025, 0.027; maxima 0.040, 0.042): over seeds 0.026, 0.041;
    # triggers only at update 4 (2e-5, 4e-5): 3.0e-05
    assert rows[2] == ("| Mu-GRPO, 4 stages x 6 updates | 0.000 | 0.026 | 0.041 | 1.000 | 0.015 | 3.0e-05 | 0.080 "
                       "| n/a |")
    assert rows[3] == "| GRPO mu=4, recompute anchor | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |"
