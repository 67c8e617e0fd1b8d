"""`mcore-rl-eval --rollout sglang` against running servers: our SGLang-compatible `mcore-rl-serve` (real SGLang needs
CUDA and cannot run here) behind the real `sglang-router`, both started on free loopback ports by our launcher.
Seeded samples equal the embedded engine's on the same weights, sample for sample (the client sends each sample's
derived seed as `sampling_seed`, which the server uses as given, like SGLang). The tiny random model's next-token
distribution is nearly flat over 49k tokens at temperature 1, so a last-bit logit difference between the two
paths' batchings can flip a draw mid-sample: at least 3/4 of the samples must be identical (with mismatched seeds
none would be)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from tests.evaluation.conftest import read_jsonl
from tests.rollout.test_router import trainer_tiny_dir

pytestmark = [pytest.mark.evaluation, pytest.mark.rollout]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = trainer_tiny_dir()
    cfg = LauncherConfig(model_path=str(model), server="mcore-rl-serve", num_servers=1, router=True,
                         extra_args=["--num-threads", "1"], log_dir=str(tmp_path_factory.mktemp("serve_logs")),
                         health_timeout_s=180, monitor=False)
    with ServerLauncher(cfg) as launcher:
        yield model, launcher


def _responses(path: Path) -> list[list[str]]:
    return [r["responses"] for r in read_jsonl(path)]


def test_eval_through_router_and_server_equals_embedded_engine(served, tmp_path, eval_inproc):
    model, launcher = served
    assert launcher.router_url.startswith("http://127.0.0.1:")
    common = [str(model), "--set", "arithmetic", "--num-prompts", "3", "-n", "4", "--max-new-tokens", "6",
              "--temperature", "1.0", "--no-progress"]
    urls = "[" + ",".join(f'"{u}"' for u in launcher.worker_urls) + "]"
    proc = eval_inproc(*common, "--rollout", "sglang", "--engine-arg", f"worker_urls={urls}",
                       "--engine-arg", f"router_url={launcher.router_url}",
                       "--engine-arg", "deterministic=true",  # seeded sampling (off by default with SGLang)
                       "--out", str(tmp_path / "sg.jsonl"),
                       "--samples-out", str(tmp_path / "sg_samples.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mean@4" in proc.stdout and "pass@4" in proc.stdout
    proc = eval_inproc(*common, "--engine-arg", "dtype=float32", "--out", str(tmp_path / "local.jsonl"),
                       "--samples-out", str(tmp_path / "local_samples.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    sg, local = _responses(tmp_path / "sg_samples.jsonl"), _responses(tmp_path / "local_samples.jsonl")
    assert len(sg) == 3 and all(len(r) == 4 for r in sg)
    same = sum(a == b for ra, rb in zip(sg, local) for a, b in zip(ra, rb))
    assert same >= 9, (same, sg, local)
    (a,), (b,) = (read_jsonl(tmp_path / f) for f in ("sg.jsonl", "local.jsonl"))
    assert a["num_prompts"] == b["num_prompts"] == 3


def test_eval_rollout_unknown_name_is_one_line_error(tmp_path, eval_inproc):
    proc = eval_inproc(str(trainer_tiny_dir()), "--rollout", "nosuch", "--out", str(tmp_path / "x.jsonl"))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) >= 1
    assert err[-1].startswith("mcore-rl-eval: error: --rollout nosuch: no such rollout config")
    assert "local" in err[-1] and "sglang" in err[-1]


def test_eval_servers_reserve_no_trainer_gpus(monkeypatch):
    """mcore-rl-eval has no trainer on the node: launched servers may take every visible GPU from 0."""
    from mcore_rl.evaluation.cli import rollout_engine
    from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # would reserve two GPUs for a trainer
    name, kw = rollout_engine("sglang", None, {})
    assert name == "sglang" and kw["launcher"]["trainer_gpus"] == 0
    launch = {k: v for k, v in kw["launcher"].items() if k not in ("log_dir",)}
    launch.update(num_servers=2, tp_size=2)
    plans = ServerLauncher(LauncherConfig(model_path="/m", **launch)).plan()
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3"]
