"""`mcore-rl-eval` on a real finished tiny run (its hf/ export and its latest Megatron checkpoint), the set specs
and scorers, and (slow) on SmolLM2 itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mcore_rl.evaluation.passk import summarize_correct
from tests.evaluation.conftest import read_jsonl, run_module

pytestmark = pytest.mark.evaluation


def _eval(*args: str, timeout: int = 300):
    return run_module("mcore_rl.evaluation.cli", *args, timeout=timeout)


def test_eval_run_dir_hf_export_and_checkpoint_agree(tiny_run, tmp_path, eval_inproc):
    out, samples = tmp_path / "results.jsonl", tmp_path / "samples.jsonl"
    common = ["--set", "arithmetic", "--set", "reasoning_gym/spell_backward", "--num-prompts", "3", "-n", "4",
              "--max-new-tokens", "6", "--temperature", "1.0", "--out", str(out)]
    # both evaluations run the same engine settings: with other batch sizes the batched prefill differs by ~1e-6,
    # enough to flip a sample of the random (near-uniform) tiny model between adjacent token ids
    engine = ["--engine", "local", "--engine-arg", "dtype=float32", "--engine-arg", "max_batch_size=5"]
    proc = _eval(str(tiny_run), *common, *engine, "--samples-out", str(samples))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"model: {tiny_run / 'hf'} (run_hf" in proc.stderr
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("set"))
    assert header.split() == ["set", "prompts", "mean@4", "pass@1", "pass@2", "pass@3", "pass@4", "len", "trunc"]
    assert any(ln.startswith("arithmetic ") for ln in lines) and any(ln.startswith("reasoning_gym/spell_backward")
                                                                      for ln in lines)
    rows = read_jsonl(out)
    assert [r["set"] for r in rows] == ["arithmetic", "reasoning_gym/spell_backward"]
    per = read_jsonl(samples)
    assert len(per) == 6 and all(len(p["responses"]) == 4 and len(p["correct"]) == 4 for p in per)
    for r in rows:
        assert r["n"] == 4 and r["num_prompts"] == 3 and 1 <= r["response_len"] <= 6 and r["model_kind"] == "run_hf"
        matrix = np.array([p["correct"] for p in per if p["set"] == r["set"]])
        ref = summarize_correct(matrix)  # the summary is the estimator applied to the written verdicts
        assert all(r[f"pass_at_{k}"] == pytest.approx(ref[f"pass_at_{k}"]) for k in range(1, 5))
    # the latest checkpoint, exported through the converter, holds the same weights as hf/: same samples
    out2, samples2 = tmp_path / "results2.jsonl", tmp_path / "samples2.jsonl"
    proc = eval_inproc(str(tiny_run), *common[:-1], str(out2), "--checkpoint", "--export-dir", str(tmp_path / "exp"),
                        *engine, "--samples-out", str(samples2), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run_checkpoint" in proc.stderr and (tmp_path / "exp" / "hf_step_000002" / "config.json").is_file()
    assert [p["responses"] for p in read_jsonl(samples2)] == [p["responses"] for p in per]


def test_eval_bf16_engine_through_fp32_gemms(tiny_run, tmp_path, eval_inproc, caplog):
    """A bf16 embedded engine with --bf16-matmul fp32: the route is taken (logged) and the evaluation completes
    with responses; `native` keeps torch's kernels (compat/bf16_matmul.py)."""
    from mcore_rl.compat import bf16_matmul

    base = [str(tiny_run), "--set", "arithmetic", "--num-prompts", "2", "-n", "2", "--max-new-tokens", "4",
            "--engine-arg", "dtype=bfloat16", "--no-progress"]
    try:
        for mode, line in (("fp32", "bf16 matmuls: bf16 operands, fp32 GEMM"), ("native", "torch's native kernels")):
            out = tmp_path / f"{mode}.jsonl"
            proc = eval_inproc(*base, "--bf16-matmul", mode, "--out", str(out))
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert line in caplog.text + proc.stderr and bf16_matmul.enabled() is (mode == "fp32")
            caplog.clear()
            assert read_jsonl(out)[0]["n"] == 2 and read_jsonl(out)[0]["response_len"] >= 1
    finally:
        bf16_matmul.disable()


def test_eval_bad_inputs_are_one_line_errors(tiny_run, tmp_path, eval_inproc):
    cases = [
        (["/nonexistent/model"], "/nonexistent/model: no such file or directory"),
        ([str(tiny_run), "--set", "nosuchset"], "--set 'nosuchset': unknown set"),
        ([str(tiny_run), "--set", "arithmetic:max_operand"], "option 'max_operand' is not key=value"),
        ([str(tiny_run), "--set", "arithmetic:bogus=1"], "bogus"),
        ([str(tiny_run), "-n", "2", "--k", "3"], "--k must satisfy 1 <= k <= n=2"),
        ([str(tmp_path)], "not an HF folder"),
        ([str(tiny_run), "--engine", "nosuch"], "--engine nosuch: rollout.engine='nosuch': expected one of local"),
        ([str(tiny_run), "--engine-arg", "bogus_arg=1"], "bogus_arg"),
        ([str(tiny_run), "--engine-arg", "dtype"], "--engine-arg 'dtype': expected KEY=VALUE"),
    ]
    for args, message in cases:
        proc = eval_inproc(*args, "--out", str(tmp_path / "x.jsonl"))
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        err = [ln for ln in proc.stderr.splitlines() if ln.startswith("mcore-rl-eval: error:")]
        assert len(err) == 1 and message in err[0], (args, proc.stderr[-2000:])


def test_local_files_gsm8k_and_boxed_answers_and_scorers(tmp_path):
    from mcore_rl.evaluation.sets import load_set

    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "He has 3 + 4 = 7.\n#### 7"},
        {"question": "Half of 1,000?", "answer": "Half is \\boxed{500}."},
        {"question": "Plain?", "answer": "12"},
    ]) + "\n")
    es = load_set(f"{f}:prompt_field=question", 0)
    try:
        assert [r.answer for r in es.records] == ["7", "500", "12"]
        assert "\\boxed{}" in es.records[0].prompt[-1]["content"]
        verdicts = es.scorer.correct(["so \\boxed{7}", "The answer is 500.", "13"], es.records)
        assert verdicts == [True, True, False]
    finally:
        es.scorer.close()
    # reasoning-gym: a non-numeric task, scored by reasoning-gym's own score_answer
    rg = load_set("reasoning_gym/spell_backward", 3)
    gold = [r.answer for r in rg.records]
    responses = [f"<answer>{gold[0]}</answer>", f"Reversed, the answer is {gold[1]}.", gold[2][::-1] + "x"]
    assert rg.scorer.correct(responses, rg.records) == [True, True, False]
    yaml_set = tmp_path / "set.yaml"
    yaml_set.write_text("kind: arithmetic\nsize: 5\nseed: 3\nops: ['*']\nsampler: {seed: 0}\n")
    es = load_set(str(yaml_set), 4)
    try:
        assert len(es.records) == 4 and all(r.metadata["op"] == "*" for r in es.records)
    finally:
        es.scorer.close()


@pytest.mark.slow
def test_smollm2_arithmetic_pass_at_k(smollm2_dir, tmp_path):
    """~80 s on 2 shared cores: SmolLM2-135M on 16 a+b prompts, n=4; it gets some right (~28% per sample)."""
    out = tmp_path / "r.jsonl"
    proc = _eval(str(smollm2_dir), "--num-prompts", "16", "-n", "4", "--max-new-tokens", "32", "--out", str(out),
                 "--no-progress", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = read_jsonl(out)[0]
    assert 0.05 < r["mean_at_n"] < 0.8 and r["pass_at_4"] >= r["pass_at_1"] and r["pass_at_4"] > r["mean_at_n"]
