"""The real sglang-router (PyPI `sglang-router`) in front of two `mcore-rl-serve` workers, all started by our
launcher: generation with log-probs through the router, weight updates landing on both workers, abort and
pause/continue on each worker, and a real `mcore-rl-train model=tiny rollout=sglang` run through the router."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.sglang.api import SAMPLING_FIELDS, SGLANG_FIELDS
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine
from mcore_rl.rollout.weight_sync.transports import SyncOptions, send_weights
from tests.conftest import REPO
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout
RECORDED: list[tuple[str, dict]] = []


def trainer_tiny_dir(seed: int = 0) -> Path:
    """The folder `model=tiny` trains (the workers must serve the trainer's own architecture)."""
    from mcore_rl.models.source import tiny_model_dir

    tiny = OmegaConf.load(Path(REPO) / "hydra_conf" / "model" / "tiny.yaml").tiny
    tiny.seed = seed
    return tiny_model_dir(tiny)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    cfg = LauncherConfig(
        model_path=str(trainer_tiny_dir()), server="mcore-rl-serve", num_servers=2, router=True,
        extra_args=["--num-threads", "1"], log_dir=str(tmp_path_factory.mktemp("router_logs")),
        health_timeout_s=180, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def engine(routed):
    eng = SGLangEngine(routed.worker_urls, routed.router_url, on_payload=lambda e, p: RECORDED.append((e, p)))
    yield eng
    eng.close()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def versions(routed) -> list[str]:
    return [get_json(u + "/model_info")["weight_version"] for u in routed.worker_urls]


def test_router_takes_one_prompt_per_request(routed):
    """Why the client sends one sample per request through a router: a batch answers 422 there."""
    batch = {"input_ids": [[1, 2], [3, 4]], "sampling_params": [{"max_new_tokens": 2}] * 2}
    assert post(routed.router_url + "/generate", batch) == 422
    assert post(routed.worker_urls[0] + "/generate", batch) == 200


def test_generate_8_prompts_x4_with_logprobs_through_router(engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trainer_tiny_dir(), dtype=torch.float32).eval()
    reqs = [GenerationRequest([5 + i, 100 + i, 7], SamplingParams(temperature=0.8, max_new_tokens=6, n=4, seed=i),
                              rid=f"p{i}") for i in range(8)]  # fmt: skip
    RECORDED.clear()
    samples = engine.generate(reqs)
    assert [(s.rid, s.sample_index) for s in samples] == [(f"p{i}", j) for i in range(8) for j in range(4)]
    worst = 0.0
    for s in samples:
        assert len(s.output_ids) >= 1 and s.weight_versions == [0] * len(s.output_ids)
        ref = forward_logprobs(model, s.prompt_ids, s.output_ids, 0.8)
        worst = max(worst, (torch.tensor(s.output_logprobs) - ref).abs().max().item())
    assert worst < 1e-4, worst
    gens = [p for e, p in RECORDED if e == "/generate"]
    assert len(gens) == 32 and all(isinstance(p["input_ids"][0], int) and isinstance(p["rid"], str) for p in gens)
    for endpoint, p in RECORDED:  # still a subset of real SGLang's fields
        assert set(p) <= SGLANG_FIELDS[endpoint] and set(p.get("sampling_params", {})) <= SAMPLING_FIELDS
    print(f"router: 32 samples, max |logprob - HF forward| = {worst:.2e}", file=sys.stderr)


def test_weight_updates_land_on_both_workers(engine, routed, tmp_path):
    prompt = GenerationRequest([11, 12, 13], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    before = engine.generate([prompt])[0]
    alt = trainer_tiny_dir(seed=1)
    engine.update_weights_from_disk(str(alt), version=5)
    assert versions(routed) == ["5", "5"]
    after = engine.generate([prompt] * 4)
    assert all(s.weight_versions == [5] * 6 for s in after) and after[0].output_ids != before.output_ids
    # the trainer's path: HF tensors -> disk transport (versioned folder) -> every worker loads it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trainer_tiny_dir(), dtype=torch.float32)
    opts = SyncOptions(sync_dir=tmp_path / "sync", config_dir=trainer_tiny_dir(), keep_versions=1)
    send_weights("disk", engine, ((k, v.detach()) for k, v in model.state_dict().items()), 6, opts)
    assert versions(routed) == ["6", "6"]
    back = engine.generate([prompt] * 4)
    assert all(s.output_ids == before.output_ids and s.weight_versions == [6] * 6 for s in back)


def test_abort_and_pause_continue_on_each_worker(engine, routed):
    long = GenerationRequest([3, 4], SamplingParams(max_new_tokens=1500, ignore_eos=True), rid="long")
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("a", engine.generate([long])))
    th.start()
    time.sleep(1.0)
    RECORDED.clear()
    engine.abort("long")
    th.join(timeout=60)
    assert out["a"][0].finish_reason == "abort" and len(out["a"][0].output_ids) < 1500
    assert [p["rid"] for e, p in RECORDED if e == "/abort_request"] == ["long#0"] * 2  # one per worker
    th = threading.Thread(target=lambda: out.setdefault("b", engine.generate([long])))
    th.start()
    time.sleep(1.0)
    engine.pause("abort")
    th.join(timeout=60)
    assert out["b"][0].finish_reason == "abort"
    short = GenerationRequest([3, 4], SamplingParams(max_new_tokens=3, ignore_eos=True))
    th = threading.Thread(target=lambda: out.setdefault("c", engine.generate([short] * 2)))
    th.start()
    time.sleep(1.0)
    assert "c" not in out  # held on both workers while paused
    engine.resume()
    th.join(timeout=60)
    assert [s.finish_reason for s in out["c"]] == ["length", "length"]
    assert sum(e == "/pause_generation" for e, _ in RECORDED) == 2 and sum(e == "/continue_generation" for e, _ in RECORDED) == 2


def test_train_tiny_through_router(engine, routed, tmp_path):
    import subprocess

    from tests.e2e.test_train_tiny import records, run, train_cmd

    engine.update_weights_from_disk(str(trainer_tiny_dir()), 0)  # back to what a fresh trainer starts from
    urls = ",".join(f"'{u}'" for u in routed.worker_urls)
    t0 = time.time()
    proc: subprocess.CompletedProcess = run(train_cmd(
        "rollout=sglang", f"rollout.worker_urls=[{urls}]", f"rollout.router_url='{routed.router_url}'",
        "trainer.steps=3", f"run.dir={tmp_path}", "trainer.export_hf=false", "logging.plot=false",
        "rollout.stale_retries=4", "rollout.keep_versions=2",
    ))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    sample_versions = [r["weight_version"] - r["staleness_max"] for r in recs]
    assert sample_versions == [0, 1, 2]  # every round generated on the weights of the previous update
    assert versions(routed) == ["3", "3"]  # the last sync reached both workers
    assert sorted(p.name for p in (tmp_path / "weight_sync").iterdir()) == ["v00000002", "v00000003"]  # keep 2
    assert recs[-1]["rollout_stale_dropped"] == 0 and recs[-1]["rollout_server_restarts"] == 0
    print(f"train through router: 3 updates in {time.time() - t0:.0f}s", file=sys.stderr)
