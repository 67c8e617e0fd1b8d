"""Interrupt mode over SGLang: the real sglang-router in front of two `mcore-rl-serve` workers (the CPU stand-in
for SGLang), all started by our launcher. A weight update sent with abort_all_requests aborts the samples in flight
(SGLang's abort replies, checked field by field), the client sends each again from its prompt with its own
sampling_seed, and every token comes from the new version; the interrupt old-log-prob source trains through it
(`mcore_rl.train ... rollout=sglang schedule=async algorithm.old_logp_source=interrupt`); servers that cannot abort
stop the run with one line."""

from __future__ import annotations

import ast
import json
import sys
import threading
import time
import urllib.request
from concurrent.futures import wait

import pytest

from mcore_rl.rollout.protocol import GenerationRequest, SamplingParams
from mcore_rl.rollout.server.codec import ABORT_QUEUED, ABORT_RUNNING
from mcore_rl.rollout.sglang.api import SAMPLING_FIELDS, SGLANG_FIELDS
from mcore_rl.rollout.sglang.launcher import LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine
from tests.rollout.test_router import trainer_tiny_dir, versions
from tests.rollout.test_sglang_contract import _tree, strings, wheel  # noqa: F401 (wheel: the fixture)

pytestmark = pytest.mark.rollout
RECORDED: list[tuple[str, dict]] = []


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """max-batch-size 1: one sample decodes at a time per worker, the rest wait in its queue (both abort paths)."""
    cfg = LauncherConfig(
        model_path=str(trainer_tiny_dir()), server="mcore-rl-serve", num_servers=2, router=True,
        extra_args=["--num-threads", "1", "--max-batch-size", "1"],
        log_dir=str(tmp_path_factory.mktemp("interrupt_logs")), health_timeout_s=180, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def engine(routed):
    eng = SGLangEngine(routed.worker_urls, routed.router_url, seed=0, on_payload=lambda e, p: RECORDED.append((e, p)))
    yield eng
    eng.close()


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_abort_all_replies_like_sglang(routed):
    """A worker updating with abort_all_requests answers its running request with FINISH_ABORT's JSON and the
    tokens made so far, its queued one with "Abort in waiting queue" and no output; the update waits for both."""
    url = routed.worker_urls[0]
    body = {"input_ids": [7, 8, 9], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "sampling_seed": 1}}
    # the first request must be running when the abort comes: on a loaded machine the engine can take longer than
    # a fixed head start to admit it (it then answers "Abort in waiting queue"), so the head start grows
    for head_start in (0.5, 2.0, 6.0):
        out: dict[str, dict] = {}
        threads = [threading.Thread(target=lambda k=k, out=out: out.__setitem__(
                       k, post_json(url + "/generate", {**body, "rid": k}))) for k in ("running", "queued")]
        threads[0].start()
        time.sleep(head_start)
        threads[1].start()
        time.sleep(0.5)
        reply = post_json(url + "/update_weights_from_disk",
                          {"model_path": str(trainer_tiny_dir()), "weight_version": "0", "abort_all_requests": True})
        assert reply["success"] is True
        assert set(out) == {"running", "queued"}  # both answered before the update returned (SGLang's writer lock)
        for th in threads:
            th.join(timeout=60)
        if out["running"]["meta_info"]["finish_reason"] != ABORT_QUEUED:
            break
    run, queued = out["running"], out["queued"]
    assert run["meta_info"]["finish_reason"] == ABORT_RUNNING == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # fmt: skip
    n = len(run["output_ids"])
    assert 0 < n < 2000 and run["meta_info"]["completion_tokens"] == n
    assert [t for _, t, _ in run["meta_info"]["output_token_logprobs"]] == run["output_ids"]
    assert queued["meta_info"]["finish_reason"] == ABORT_QUEUED == {"type": "abort", "message": "Abort in waiting queue"}
    assert queued["output_ids"] == [] and queued["text"] == ""
    meta = queued["meta_info"]  # SGLang 0.5.23's _handle_abort_req: no prompt_tokens, empty log-prob lists
    assert meta["completion_tokens"] == 0 and "prompt_tokens" not in meta
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 0}] and meta["weight_version"] == "0"


def test_update_restarts_samples_in_flight_through_the_router(engine, routed):
    """Eight seeded samples through the router; a weight update lands while they decode (two running, six
    queued). Every sample comes back whole, all its tokens tagged with the new version, identical to what the new
    weights alone generate from the same seeds."""
    engine.update_weights_from_disk(str(trainer_tiny_dir()), 0)
    engine.set_interrupt_on_update(True)
    RECORDED.clear()
    before = engine.stats.regenerated
    sp = SamplingParams(max_new_tokens=160, temperature=1.0, ignore_eos=True, seed=1234)
    reqs = [GenerationRequest([3 + i, 4, 5], sp, rid=f"p{i}") for i in range(4)]
    futures = engine.submit([GenerationRequest(r.prompt_ids, SamplingParams(**{**vars(sp), "n": 2}), rid=r.rid)
                             for r in reqs])  # fmt: skip
    # the update must land while samples are at the servers: on a loaded machine (load 12 measured) the client had
    # not yet sent one /generate 0.3 s after submit, nothing was aborted and the test saw 0 regenerated
    deadline = time.monotonic() + 60
    while sum(e == "/generate" for e, _ in RECORDED) < len(reqs) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    in_flight = sum(not f.done() for f in futures)
    engine.update_weights_from_disk(str(trainer_tiny_dir(seed=1)), 1)
    wait(futures, timeout=120)
    got = [f.result() for f in futures]
    regenerated = engine.stats.regenerated - before
    # on a loaded machine a sample can finish under v0 before the update lands: it stays whole and v0 (not
    # regenerated); every other sample carries v1 only and equals what v1 alone generates from its seed
    assert 1 <= regenerated <= in_flight, (in_flight, regenerated)
    assert all(s.finish_reason == "length" and len(s.weight_versions) == 160 and len(set(s.weight_versions)) == 1
               for s in got)  # fmt: skip
    new = [i for i, s in enumerate(got) if s.weight_versions[0] == 1]
    assert len(new) >= regenerated
    fresh = engine.generate([GenerationRequest(r.prompt_ids, SamplingParams(**{**vars(sp), "n": 2}), rid=f"f{i}")
                             for i, r in enumerate(reqs)])  # fmt: skip
    assert [got[i].output_ids for i in new] == [fresh[i].output_ids for i in new]
    worst = max(abs(a - b) for i in new for a, b in zip(got[i].output_logprobs, fresh[i].output_logprobs))
    assert worst < 1e-5
    updates = [p for e, p in RECORDED if e == "/update_weights_from_disk"]
    assert len(updates) == 2 and all(p["abort_all_requests"] is True for p in updates)  # one per worker
    for endpoint, p in RECORDED:  # still a subset of real SGLang's fields
        assert set(p) <= SGLANG_FIELDS[endpoint] and set(p.get("sampling_params", {})) <= SAMPLING_FIELDS
    assert versions(routed) == ["1", "1"]
    print(f"interrupt: {in_flight} samples in flight at the update, {regenerated} regenerated, "
          f"max |logprob - fresh v1| = {worst:.2e}", file=sys.stderr)


def test_user_abort_is_not_regenerated(engine):
    """abort() from the caller still returns an aborted sample in interrupt mode (the schedule's stop path)."""
    engine.set_interrupt_on_update(True)
    long = GenerationRequest([3, 4], SamplingParams(max_new_tokens=1500, ignore_eos=True), rid="long")
    before = engine.stats.regenerated
    fut = engine.submit([long])[0]
    time.sleep(0.5)
    engine.abort("long")
    s = fut.result(timeout=60)
    assert s.finish_reason == "abort" and len(s.output_ids) < 1500 and engine.stats.regenerated == before


def _train(routed, tmp_path, *overrides: str):
    from tests.e2e.test_train_tiny import run, train_cmd

    urls = ",".join(f"'{u}'" for u in routed.worker_urls)
    return run(train_cmd(
        "rollout=sglang", f"rollout.worker_urls=[{urls}]", f"rollout.router_url='{routed.router_url}'",
        f"run.dir={tmp_path}", "trainer.export_hf=false", "logging.plot=false", "eval.num_prompts=0",
        "schedule=async", "trainer.deterministic=false", *overrides,
    ))  # fmt: skip


# slow: free-running async, so whether a sync lands while a round decodes is timing (a run at load ~20 saw none);
# the deterministic interrupt checks in the default suite are test_update_restarts_samples_in_flight_through_the_router
# and test_interrupt_old_logp_exact_on_sglang
@pytest.mark.slow
@pytest.mark.parametrize("source", ["interrupt", "old_logit_model"])
def test_async_interrupt_run_through_router(engine, routed, tmp_path, source):
    """(a) A free-running async k=2 run on SGLang with old_logp_source=interrupt: weight syncs land while the
    rounds ahead decode (one sample at a time per worker), the workers abort them and the client regenerates them;
    the interrupt source refuses any row whose tokens span versions, so a finished run means none did.
    old_logit_model turns on the same mode (its scoring model holds one version per sample)."""
    from tests.e2e.test_train_tiny import records

    engine.update_weights_from_disk(str(trainer_tiny_dir()), 0)  # what a fresh trainer starts from
    t0 = time.time()
    proc = _train(routed, tmp_path, f"algorithm.old_logp_source={source}", "trainer.steps=4",
                  "trainer.max_new_tokens=160", "algorithm.old_logp_audit_frac=0.5")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    last = recs[-1]
    assert last["old_logp_regenerated_samples"] > 0, last
    audit = max(r["old_logp_error"] for r in recs)  # vs the audit's per-version reference on half the rows
    assert audit <= 1e-5  # exact up to fp32 rounding of another batch shape
    assert last["rollout_stale_dropped"] == 0 and versions(routed) == ["4", "4"]
    print(f"async {source} run through router: 4 updates in {time.time() - t0:.0f}s, regenerated "
          f"{last['old_logp_regenerated_samples']:.0f} samples, staleness_max {last.get('staleness_max')}, "
          f"audit old_logp_error max {audit:.2e}",
          file=sys.stderr)


def test_servers_that_cannot_abort_stop_the_run_with_one_line(routed, tmp_path):
    """(c) The router given as a worker URL: it does not forward /abort_request (404), so interrupt mode cannot
    work there. The run stops at start with one config-error line naming the URL."""
    from tests.e2e.test_train_tiny import run, train_cmd

    proc = run(train_cmd(
        "rollout=sglang", f"rollout.worker_urls=['{routed.router_url}']", f"run.dir={tmp_path}",
        "trainer.export_hf=false", "logging.plot=false", "eval.num_prompts=0", "schedule=async",
        "algorithm.old_logp_source=interrupt", "trainer.steps=1",
    ))  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("config error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"rollout.worker_urls: {routed.router_url} cannot abort requests (HTTP 404" in lines[0], lines[0]
    assert "old_logp_source=interrupt" in lines[0]


def test_interrupt_old_logp_exact_on_sglang(engine, routed, tmp_path):
    """(b) The exactness audit of tests/e2e/test_old_logp_exact.py on SGLang: a tiny fp32 async k=2 run with
    old_logp_source=interrupt (the harness pauses the workers from shortly after a round is handed over until
    the weight sync, so every sync lands mid-sample); every consumed token's old log-prob equals a fresh model
    loaded from its own version's folder, within 1e-6, while the trainer's current weights are off by > 1e-3."""
    from tests.conftest import run_torchrun
    from tests.e2e.test_old_logp_exact import WORKER

    engine.update_weights_from_disk(str(trainer_tiny_dir()), 0)
    out = tmp_path / "result.json"
    urls = ",".join(f"'{u}'" for u in routed.worker_urls)
    t0 = time.time()
    try:
        run_torchrun(1, WORKER, str(out), "model=tiny", "rollout=sglang", f"rollout.worker_urls=[{urls}]",
                     f"rollout.router_url='{routed.router_url}'", f"run.dir={tmp_path / 'run'}",
                     f"rollout.sync_dir={tmp_path / 'sync'}", "rollout.keep_versions=100", "schedule=async",
                     "algorithm.max_staleness=2", "trainer.deterministic=false", "algorithm.old_logp_source=interrupt",
                     "algorithm.old_logp_audit_frac=0.5", "algorithm.entropy_coef=0.01", "optim.lr=1e-3",
                     "trainer.steps=4", "trainer.prompts_per_update=2", "trainer.samples_per_prompt=2",
                     "trainer.max_new_tokens=48", "eval.num_prompts=0", "trainer.export_hf=false",
                     "logging.plot=false", "logging.progress=false", "logging.tensorboard=false", timeout=300)
    finally:
        engine.resume()  # the harness pauses the shared workers between rounds
    res = json.loads(out.read_text())
    m = res["metrics"]
    print(f"sglang interrupt: max|old-ref|={res['max_diff']:.3g} recompute max|diff| on stale tokens="
          f"{res['recompute_max_diff_stale']:.3g} stale tokens={res['stale_tokens']}/{res['tokens']} "
          f"spanning rows={res['spanning_rows']} versions={res['versions']} "
          f"regenerated={m.get('old_logp_regenerated_samples')} in {time.time() - t0:.0f}s", file=sys.stderr)
    assert res["source"] == "interrupt" and res["rounds"] == 4 and len(res["versions"]) >= 3, res
    assert res["stale_tokens"] > 0  # the run consumed tokens of older versions ...
    assert res["max_diff"] <= 1e-6  # ... and their old log-probs are exactly those versions'
    assert res["recompute_max_diff_stale"] > 1e-3  # the current weights would be the wrong anchor
    assert res["spanning_rows"] == 0 and m["old_logp_regenerated_samples"] >= 1, res
    assert res["audit_errors"] and max(res["audit_errors"]) <= 1e-6


def _function(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef:
    owner = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(f for f in owner.body if isinstance(f, ast.FunctionDef) and f.name == name)


def test_stand_in_abort_replies_are_sglangs(wheel):  # noqa: F811 (the contract tests' wheel fixture)
    """What a partial rollout or an interrupting update gets back for an aborted request: a running one finishes
    with FINISH_ABORT().to_json() (its tokens so far kept, through the normal output path), a queued one is answered
    by the tokenizer manager's _handle_abort_req with its default message, no prompt_tokens and no output."""
    batch = _tree(wheel, "sglang/srt/managers/schedule_batch.py")
    (reply,) = [n for n in ast.walk(_function(batch, "FINISH_ABORT", "to_json")) if isinstance(n, ast.Dict)]
    assert [k.value for k in reply.keys] == list(ABORT_RUNNING) and reply.values[0].value == "abort"
    assert ABORT_RUNNING["message"] in strings(_function(batch, "FINISH_ABORT", "__init__"))  # `message or "..."`
    manager = _tree(wheel, "sglang/srt/managers/tokenizer_manager.py")
    said = strings(_function(manager, "TokenizerManager", "_handle_abort_req"))
    assert ABORT_QUEUED["message"] in said and {"completion_tokens", "weight_version", "e2e_latency"} <= said
    assert "prompt_tokens" not in said
