"""The end-of-run speed summary (`trainer/speed.py`): tokens/s per phase and the fraction of the matmul roofline,
printed by a real run and appended to run_dir/summary.jsonl."""

from __future__ import annotations

import json

import pytest

from mcore_rl.trainer.speed import phase_speeds, speed_summary


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_phase_speeds_from_hand_written_records(tmp_path):
    _write(
        tmp_path / "metrics.jsonl",
        [
            {
                "step": 1,
                "time_generate": 2.0,
                "rollout_tokens": 100,
                "time_train": 4.0,
                "time_sync": 0.5,
                "sync_gb": 0.25,
            },
            {
                "step": 2,
                "time_generate": 3.0,
                "rollout_tokens": 150,
                "time_train": 6.0,
                "time_sync": 0.5,
                "sync_gb": 0.25,
            },
            {
                "step": 3,
                "time_generate": 99.0,
                "rollout_tokens": 1,
                "time_train": 99.0,
            },  # after the last counted eval
        ],
    )
    _write(
        tmp_path / "eval.jsonl",
        [
            {"step": 0, "time_eval": 1.0, "response_len": 10.0, "num_prompts": 4, "k": 2},
            {
                "step": 2,
                "time_eval": 3.0,
                "response_len": 20.0,
                "num_prompts": 4,
                "k": 2,
                "flops_generate": 5e9,
                "flops_train": 60e9,
                "flops_score": 0.0,
                "tokens_trained": 800.0,
            },
        ],
    )
    p = {s.phase: s for s in phase_speeds(tmp_path, roof_gflops=20.0)}
    assert set(p) == {"generate", "train", "eval", "sync"}  # no old-logp time: no score phase
    assert p["generate"].tokens_per_s == pytest.approx(250 / 5)
    # no matmul fraction for generation: its counted FLOPs charge a shared prompt once per sample (module docstring)
    assert p["generate"].gflops is None and p["generate"].roofline_frac is None
    assert p["train"].tokens_per_s == pytest.approx(80.0) and p["train"].gflops == pytest.approx(6.0)
    assert p["train"].roofline_frac == pytest.approx(0.3)
    assert p["eval"].tokens_per_s == pytest.approx((80 + 160) / 4.0) and p["eval"].gflops is None
    assert p["sync"].gb_per_s == pytest.approx(0.5) and p["sync"].tokens_per_s is None
    record, text = speed_summary(tmp_path, "fp32", 20.0)
    assert record["phases"]["train"]["roofline_frac"] == pytest.approx(0.3)
    assert "train: 10.0 s, 80.0 tok/s, 6.0 GFLOP/s, 30.0% of roofline" in text


def test_a_round_counts_once_and_decode_is_set_against_its_roofline(tmp_path):
    """A round of two updates logs its counts on both records (only the last has time_sync): its tokens and the
    engine's decode work count once. Decode: the engine's decode seconds against the roofline seconds of its steps."""
    engine = {"engine_decode_tokens": 300.0, "engine_decode_s": 4.0, "engine_decode_bound_s": 1.0,
              "engine_prefill_tokens": 40.0, "engine_prefill_s": 0.5}
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "time_generate": 1.0, "rollout_tokens": 200, "time_train": 2.0, **engine},
        {"step": 2, "time_generate": 1.0, "rollout_tokens": 200, "time_train": 2.0, "time_sync": 0.1, **engine},
    ])
    _write(tmp_path / "eval.jsonl", [{"step": 2, "flops_train": 4e9, "tokens_trained": 800.0}])
    p = {s.phase: s for s in phase_speeds(tmp_path, roof_gflops=20.0)}
    assert p["generate"].tokens_per_s == pytest.approx(200 / 2.0)  # 200 tokens, not 400
    assert p["decode"].seconds == 4.0 and p["decode"].tokens_per_s == pytest.approx(75.0)
    assert p["decode"].roofline_frac == pytest.approx(0.25)
    _, text = speed_summary(tmp_path, "fp32", 20.0)
    assert "decode: 4.0 s in the engine's decode steps (evaluation's included), 75.0 tok/s, 25.0% of decode " \
           "roofline" in text
    assert "generate: 2.0 s, 100.0 tok/s\n" in text


def test_async_generation_reports_the_wait_not_a_rate(tmp_path):
    """Under async the trainer waits only for what training did not hide: tokens over that wait gave 392% of the
    roofline on a k=2 run. The summary reports the wait and derives no rate from it."""
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "time_generate": 2.0, "rollout_tokens": 1000, "time_train": 4.0, "inflight_rounds": 0.0},
        {"step": 2, "time_generate": 0.1, "rollout_tokens": 1000, "time_train": 4.0, "inflight_rounds": 2.0},
    ])
    _write(tmp_path / "eval.jsonl", [{"step": 2, "flops_generate": 5e12, "flops_train": 60e9, "tokens_trained": 800.0}])
    gen = {s.phase: s for s in phase_speeds(tmp_path, roof_gflops=20.0)}["generate"]
    assert gen.overlapped and gen.seconds == pytest.approx(2.1)
    assert gen.tokens_per_s is None and gen.gflops is None and gen.roofline_frac is None
    _, text = speed_summary(tmp_path, "bf16", 20.0)
    assert "generate: 2.1 s waited (generation overlapped training: no rate from the wait)" in text
    assert "of roofline" in text.split("generate:")[1].split("\n", 1)[1]  # train still has its fraction


def test_real_run_prints_and_records_the_speed_summary(tiny_run_proc):
    run_dir, proc = tiny_run_proc
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    rec = json.loads((run_dir / "summary.jsonl").read_text().splitlines()[-1])
    assert rec["dtype"] == "fp32" and rec["matmul_gflops"] > 1.0  # model=tiny is pinned to fp32
    gen, tr = rec["phases"]["generate"], rec["phases"]["train"]
    assert gen["tokens_per_s"] == pytest.approx(
        sum(r["rollout_tokens"] for r in train) / sum(r["time_generate"] for r in train)
    )
    assert (
        tr["tokens"] == last_eval["tokens_trained"] > last_eval["tokens_generated"]
    )  # prompts are trained too
    assert tr["gflops"] == pytest.approx(last_eval["flops_train"] / tr["seconds"] / 1e9)
    assert (
        tr["roofline_frac"] == pytest.approx(tr["gflops"] / rec["matmul_gflops"])
        and 0 < tr["roofline_frac"] < 2
    )
    assert rec["phases"]["eval"]["tokens_per_s"] > 0
    dec = rec["phases"]["decode"]  # the embedded engine's decode, against the roofline of the steps it ran
    rounds = [r for r in train if "time_sync" in r]
    assert dec["tokens"] == sum(r["engine_decode_tokens"] for r in rounds) > 0
    assert dec["roofline_frac"] == pytest.approx(sum(r["engine_decode_bound_s"] for r in rounds) / dec["seconds"])
    assert 0 < dec["roofline_frac"] < 10  # a tiny model's weights sit in cache: it can beat the DRAM bound
    assert gen["roofline_frac"] is None and f"{100 * dec['roofline_frac']:.1f}% of decode roofline" in proc.stdout
    assert f"speed (fp32 torch.mm roofline {rec['matmul_gflops']:,.0f} GFLOP/s)" in proc.stdout
    assert f"{100 * tr['roofline_frac']:.1f}% of roofline" in proc.stdout
