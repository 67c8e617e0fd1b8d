"""Training's periodic eval over several held-out sets (`eval.sets`) uses mcore-rl-eval's loader and scorers: the
numbers a run logs for each set equal what `mcore-rl-eval` measures on the same weights."""

from __future__ import annotations

import pytest

from tests.evaluation.conftest import read_jsonl, run_module

pytestmark = pytest.mark.evaluation

SETS = ["arithmetic", "reasoning_gym/spell_backward:size=2"]  # the second set has only 2 prompts


def _train(run_dir, *overrides: str, timeout: int = 300):
    return run_module("mcore_rl.train", "model=tiny", "model.dtype=fp32", "eval.num_prompts=3",
                      "eval.samples_per_prompt=4", "eval.max_new_tokens=6", "eval.temperature=1.0", "trainer.steps=0",
                      "logging.progress=false", "logging.plot=false", "logging.tensorboard=false",
                      f"run.dir={run_dir}", *overrides, timeout=timeout)


def test_eval_sets_logged_per_set_and_equal_to_mcore_rl_eval(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(run_dir, "eval.sets=[" + ",".join(f"'{s}'" for s in SETS) + "]")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rec,) = read_jsonl(run_dir / "eval.jsonl")
    names = ["arithmetic", "reasoning_gym_spell_backward"]
    for name, num in zip(names, (3, 2)):  # each set loaded from its own spec (options included)
        assert rec[f"{name}/num_prompts"] == num and rec[f"{name}/k"] == 4
        assert 1 <= rec[f"{name}/response_len"] <= 6
    # the first set is also the unprefixed record the progress bar, summary and scaling fits read
    assert all(rec[key] == rec[f"arithmetic/{key}"] for key in ("mean_at_k", "pass_at_k", "response_len"))

    # the same weights (the run's hf/ export of the untrained model) through mcore-rl-eval: identical numbers
    out = tmp_path / "eval.jsonl"
    ev = run_module("mcore_rl.evaluation.cli", str(run_dir), *sum((["--set", s] for s in SETS), []),
                    "--num-prompts", "3", "-n", "4", "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "777",
                    "--engine-arg", "dtype=float32", "--no-progress", "--out", str(out))
    assert ev.returncode == 0, ev.stderr[-3000:]
    rows = {r["set"]: r for r in read_jsonl(out)}
    for spec, name in zip(SETS, names):
        assert rows[spec]["num_prompts"] == rec[f"{name}/num_prompts"]
        assert rows[spec]["response_len"] == pytest.approx(rec[f"{name}/response_len"])
        for k in range(1, 5):
            assert rows[spec][f"pass_at_{k}"] == pytest.approx(rec[f"{name}/pass_at_{k}"])


@pytest.mark.parametrize("eval_cfg, message", [
    ({"sets": ["arithmetic", "nosuchset"]}, "eval.sets[1]: --set 'nosuchset': unknown set"),
    ({"sets": ["arithmetic", ""]}, "eval.sets[1]: expected a set spec string"),
    ({"sets": ["arithmetic"], "data": {"kind": "arithmetic"}}, "eval.sets and eval.data are both set"),
])
def test_eval_sets_bad_input_is_one_line_error(eval_cfg, message):
    """Checked when the prompt source is built, before the model loads (in-process: the CLI path is above)."""
    from mcore_rl.config import EvalConfig
    from mcore_rl.trainer.prompts import PromptSource
    from mcore_rl.trainer.setup import ConfigError

    with pytest.raises(ConfigError) as err:
        PromptSource._eval_set_specs(EvalConfig(**{"num_prompts": 4, "data": None, **eval_cfg}))
    assert message in str(err.value) and "\n" not in str(err.value)
