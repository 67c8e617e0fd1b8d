"""Multi-turn episodes over `rollout.engine=sglang` through the real sglang-router in front of two `mcore-rl-serve`
workers (real SGLang needs CUDA; the stand-in speaks its API and logs requests like SGLang's --log-requests).

The router runs sglang-router's `manual` policy: the EpisodeRunner gives every turn of an episode the episode's
routing key, the client sends it as `x-smg-routing-key`, and the router keeps each key on one worker (new keys go
to the worker with the fewest keys, `--assignment-mode min_group`). The two workers are tagged with different
weight versions (same weights), so each token's version in the trajectory also says which worker produced it.
Checked per episode and turn against what the workers logged: the trained ids are exactly what the worker was fed
and produced, log-probs and versions are the worker's (and equal an HF forward), the mask covers exactly the
model turns, and all three turns of an episode were served by one worker.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from mcore_rl.envs import build_environment
from mcore_rl.envs.chat import TurnRenderer
from mcore_rl.envs.runner import EpisodeRunner
from mcore_rl.rollout.protocol import SamplingParams
from mcore_rl.rollout.sglang.launcher import ROUTER_COMMAND, LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine
from tests.envs.test_token_io import Seen, check_ids
from tests.rollout.conftest import forward_logprobs

pytestmark = pytest.mark.rollout
TAGS = (3, 4)  # weight version reported by worker 0 / worker 1


@pytest.fixture(scope="module")
def routed(smol_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_env_logs")
    cfg = LauncherConfig(
        model_path=str(smol_dir), server="mcore-rl-serve", num_servers=2, router=True,
        router_command=[*ROUTER_COMMAND, "--policy", "manual", "--assignment-mode", "min_group"],
        extra_args=["--num-threads", "1", "--log-requests", "--log-requests-target", str(logs / "requests")],
        log_dir=str(logs), health_timeout_s=180, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        for url, tag in zip(launcher.worker_urls, TAGS):
            body = json.dumps({"new_version": tag, "abort_all_requests": False}).encode()
            req = urllib.request.Request(url + "/update_weight_version", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()
        yield launcher, logs / "requests"


def _served(folder: Path, worker_urls: list[str]) -> dict[str, tuple[int, dict]]:
    """SGLang rid -> (worker index, what that worker logged)."""
    out = {}
    for w, url in enumerate(worker_urls):
        port = url.rsplit(":", 1)[1]
        for line in (folder / f"requests-{port}.jsonl").read_text().splitlines():
            row = json.loads(line)
            out[row["rid"]] = (w, row)
    return out


def test_three_turn_episodes_through_router_stay_on_one_worker(routed, smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    launcher, req_logs = routed
    sent: list[dict] = []
    engine = SGLangEngine(launcher.worker_urls, launcher.router_url,
                          on_payload=lambda e, p: sent.append(p) if e == "/generate" else None)  # fmt: skip
    env = build_environment({"name": "retry", "max_attempts": 3, "max_turns": 3, "max_new_tokens": 6,
                             "truncated_turn": "close", "size": 4, "heldout_size": 0})  # fmt: skip
    renderer = TurnRenderer(AutoTokenizer.from_pretrained(smol_dir))
    try:
        trajs = EpisodeRunner(env, engine, renderer).run(
            env.records("train")[:2], SamplingParams(temperature=1.0, seed=7), samples_per_prompt=2
        )
    finally:
        engine.close()
    served = _served(req_logs, launcher.worker_urls)
    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    workers, worst = [], 0.0
    assert len(trajs) == 4 and len(sent) == 12  # 4 episodes x 3 turns, one /generate each
    for traj in trajs:
        assert traj.turns == 3 and traj.termination == "out_of_attempts"
        rows = [served[f"{traj.metadata['rid']}/t{k}#0"] for k in range(1, 4)]
        ws = {w for w, _ in rows}
        assert len(ws) == 1, f"episode {traj.metadata['rid']} moved between workers: {ws}"
        (w,) = ws
        workers.append(w)
        assert all(r["routing_key"] == traj.metadata["rid"] for _, r in rows)
        seen = [Seen(r["input_ids"], r["output_ids"], r["output_logprobs"], r["weight_versions"]) for _, r in rows]
        check_ids(traj, seen, renderer)  # fed / produced / log-probs / versions / mask / template boundaries
        assert {v for v, m in zip(traj.versions, traj.mask) if m} == {TAGS[w]}
        for (start, end), s in zip(traj.turn_spans, seen):
            ref = forward_logprobs(model, s.prompt_ids, s.output_ids, 1.0)
            worst = max(worst, (torch.tensor(traj.logprobs[start:end]) - ref).abs().max().item())
    assert sorted(workers) == [0, 0, 1, 1]  # min_group: two episodes' keys per worker
    by_rid = {p["rid"]: p for p in sent}
    assert all(by_rid[rid]["input_ids"] == row["input_ids"] for rid, (_, row) in served.items() if rid in by_rid)
    assert worst < 1e-4, worst
    print(f"router: 4 episodes x 3 turns, workers {workers}, max |logprob - HF| = {worst:.1e}", file=sys.stderr)


def test_eval_env_through_router(routed, smol_dir, tmp_path):
    """`mcore-rl-eval --env retry --rollout sglang` on the same router: the reported turns and endings are the
    episodes', and every episode's turns were served by one worker."""
    from mcore_rl.evaluation.cli import main
    from tests.evaluation.conftest import read_jsonl

    launcher, req_logs = routed
    before = set(_served(req_logs, launcher.worker_urls))
    urls = "[" + ",".join(f'"{u}"' for u in launcher.worker_urls) + "]"
    out = tmp_path / "res.jsonl"
    rc = main([str(smol_dir), "--env", "retry:max_attempts=2,max_turns=2,max_new_tokens=4,truncated_turn=close",
               "--num-prompts", "3", "-n", "2", "--temperature", "1.0", "--no-progress", "--out", str(out),
               "--rollout", "sglang", "--engine-arg", f"worker_urls={urls}",
               "--engine-arg", f"router_url={launcher.router_url}"])  # fmt: skip
    assert rc == 0
    (line,) = read_jsonl(out)
    assert line["num_prompts"] == 3 and line["turns"] == 2.0 and line["end_out_of_attempts"] == 1.0
    new = {rid: v for rid, v in _served(req_logs, launcher.worker_urls).items() if rid not in before}
    assert len(new) == 3 * 2 * 2  # prompts x episodes x turns
    by_key: dict[str, set[int]] = {}
    for w, row in new.values():
        by_key.setdefault(row["routing_key"], set()).add(w)
    assert len(by_key) == 6 and all(len(ws) == 1 for ws in by_key.values())
    assert {w for ws in by_key.values() for w in ws} == {0, 1}


@pytest.fixture(scope="module")
def wheel():
    """The sglang 0.5.23 wheel the SGLang contract tests read (tests/rollout/test_sglang_contract.py)."""
    import zipfile

    from tests.rollout.test_sglang_contract import CACHE, VERSION

    found = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        pytest.skip(f"sglang {VERSION} wheel not in {CACHE} (tests/rollout/test_sglang_contract.py downloads it)")
    with zipfile.ZipFile(found[-1]) as zf:
        yield zf


def test_flags_and_header_are_the_real_ones(wheel):
    """The stand-in's log flags are SGLang 0.5.23's, the header is the one SGLang logs and the installed
    sglang-router reads, and `manual` / `min_group` are the router's own choices."""
    import sglang_router.router_args as ra

    from mcore_rl.rollout.sglang.client import ROUTING_KEY_HEADER

    obs = wheel.read("sglang/srt/arg_groups/fields/observability.py").decode()
    assert "    log_requests: A[" in obs and "    log_requests_target: A[" in obs
    assert f'"{ROUTING_KEY_HEADER}"' in wheel.read("sglang/srt/utils/request_logger.py").decode()
    router_so = next(Path(ra.__file__).parent.glob("sglang_router_rs*.so")).read_bytes()
    assert ROUTING_KEY_HEADER.encode() in router_so
    src = Path(ra.__file__).read_text()
    assert '"manual"' in src and '"min_group"' in src


def test_launcher_rebinds_a_server_whose_port_was_taken(smol_dir, tmp_path, monkeypatch):
    """On a shared host another process can take a free port before the server binds it (this flaked the test
    above once): the launcher starts that server again on a new port instead of failing the run."""
    import socket

    from mcore_rl.rollout.sglang import launcher as launcher_mod

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, calls = launcher_mod.free_port, []

    def first_taken(host: str = "127.0.0.1") -> int:
        calls.append(1)
        return taken if len(calls) == 1 else real(host)

    monkeypatch.setattr(launcher_mod, "free_port", first_taken)
    cfg = LauncherConfig(model_path=str(smol_dir), server="mcore-rl-serve", num_servers=1,
                         extra_args=["--num-threads", "1"], log_dir=str(tmp_path), health_timeout_s=180,
                         monitor=False)  # fmt: skip
    try:
        with ServerLauncher(cfg) as launcher:
            (url,) = launcher.worker_urls
            assert not url.endswith(f":{taken}")
            with urllib.request.urlopen(url + "/health", timeout=30) as resp:
                assert resp.status == 200
    finally:
        squatter.close()
    assert "address already in use" in (tmp_path / "server0.log").read_text().lower()
