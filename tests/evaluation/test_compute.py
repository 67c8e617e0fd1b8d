"""Compute accounting: the non-embedding count and attention term against brute force, and a real tiny run's
eval records carrying cumulative FLOPs / wall-clock that `mcore-rl-scaling --x flops` reads; the run summary."""

from __future__ import annotations

import json
import os

import pytest

from mcore_rl.evaluation.compute import ComputeMeter, ModelFlops, model_flops
from tests.conftest import save_random_hf, tiny_llama_config

pytestmark = pytest.mark.evaluation


@pytest.mark.parametrize("tied", [True, False])
def test_non_embedding_params_match_the_real_model(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    folder = save_random_hf(tmp_path / "m", tiny_llama_config(tie_word_embeddings=tied))
    model = AutoModelForCausalLM.from_pretrained(folder)
    ref = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    f = model_flops(folder)
    assert f.non_embedding_params == ref
    # 4 layers x (q 64x64, k/v 64x32 each, o 64x64, mlp 3x64x128, 2 norms) + final norm
    assert ref == 4 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert (f.num_layers, f.attn_dim) == (4, 64)


def test_forward_flops_sum_the_attention_term_over_positions():
    f = ModelFlops(non_embedding_params=1000, num_layers=3, attn_dim=8)
    # brute force: token at position t attends t + 1 positions
    ref = sum(2 * 1000 + 2 * 3 * 8 * (t + 1) for t in range(5 + 7))
    assert f.forward([(5, 7)]) == pytest.approx(ref)
    meter = ComputeMeter(f)
    meter.add_round([(5, 7), (5, 2)], score_passes=2)
    rec = meter.record()
    gen = f.forward([(5, 7), (5, 2)])
    assert rec["flops_generate"] == pytest.approx(gen) and rec["flops_train"] == pytest.approx(3 * gen)
    assert rec["flops"] == pytest.approx(6 * gen) and rec["tokens_generated"] == 9
    state = meter.state_dict()
    again = ComputeMeter(f)
    again.load_state_dict(state)  # a resumed run continues the count
    assert again.record()["flops"] == pytest.approx(rec["flops"]) and again.record()["wallclock_s"] >= 0
    assert again.record()["cpu_s"] >= state["cpu_s"]  # CPU-seconds also carry over a resume
    meter.add_eval_time(0.5, cpu_seconds=0.25)  # evaluation moves from cpu_s to cpu_total_s only
    rec2 = meter.record()
    assert rec2["cpu_total_s"] - rec2["cpu_s"] == pytest.approx(0.25)


def last_total(evals: list[dict]) -> float:
    return evals[-1]["wallclock_total_s"]


def test_real_run_writes_compute_with_each_eval_and_a_summary(tiny_run_proc, capsys):
    run_dir, proc = tiny_run_proc
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert evals[0]["flops"] == 0.0 and 0 < evals[1]["flops"] < evals[2]["flops"]
    assert 0 <= evals[0]["wallclock_s"] < evals[1]["wallclock_s"] < evals[2]["wallclock_s"]
    # evaluation time is excluded from wallclock_s (it is not training cost), included in wallclock_total_s
    # (exact bookkeeping, not a race: how long start-up took next to the eval depends on the machine's load)
    assert evals[0]["time_eval"] > 0
    assert evals[0]["wallclock_total_s"] == pytest.approx(evals[0]["wallclock_s"] + evals[0]["time_eval"], abs=1e-6)
    total_eval = sum(e["time_eval"] for e in evals)
    assert last_total(evals) - evals[-1]["wallclock_s"] == pytest.approx(total_eval, abs=1e-3)
    # process CPU-seconds, the same way: cumulative, evaluation excluded, never more than the machine could give
    assert 0 <= evals[0]["cpu_s"] < evals[1]["cpu_s"] < evals[2]["cpu_s"]
    assert evals[-1]["cpu_total_s"] > evals[-1]["cpu_s"] and all(e["loadavg_1m"] >= 0 for e in evals)
    assert evals[-1]["cpu_s"] <= (os.cpu_count() or 1) * evals[-1]["wallclock_s"] + 0.5
    last = evals[-1]
    # grpo_cpu default: on-policy, no old-logp recompute, no reference model -> no scoring passes
    assert last["flops_train"] == pytest.approx(3 * last["flops_generate"])
    assert last["tokens_generated"] == sum(r["rollout_tokens"] for r in train)
    n = model_flops(run_dir / "hf").non_embedding_params
    assert last["flops_generate"] > 2 * n * last["tokens_generated"]  # prompts and attention come on top
    assert "run summary" in proc.stdout and "held-out, update 0 -> 2" in proc.stdout
    assert f"hf export {run_dir / 'hf'}" in proc.stdout and "time by phase: generate" in proc.stdout
    # the scaling CLI reads the accounting fields of a real run; a random model's flat curve is a clear error
    from mcore_rl.evaluation.scaling_cli import main

    assert main(["fit", str(run_dir), "--x", "flops", "--out", str(run_dir / "fit.png")]) == 2
    err = capsys.readouterr().err
    assert "2 eval point(s) to fit, need >= 4" in err or "never moves" in err, err
