"""Partial rollouts over `rollout=sglang`: `mcore-rl-train` through the real sglang-router (`--policy manual`) in
front of two `mcore-rl-serve` workers (real SGLang needs CUDA; the stand-in speaks its API and logs every request
like SGLang's `--log-requests`).

What the runs must show, read from the workers' request logs and `run.dir/partial.jsonl`:
- a carried single-turn sample's chunks are `/generate` calls on `input_ids` = prompt + every token so far, each
  at most `chunk_tokens` long, all on the worker that served its first chunk (its routing key is the sample id);
- a carried episode's turns, across rounds, all on one worker (the episode id is the routing key);
- at least half of the trained samples / episodes were carried at least once, none lost or trained twice;
- the same seeded run on the embedded engine issues, trains and carries the same ids and its losses agree: the
  tokens are the same (both engines draw from the same per-request seeds), only the engines' own log-prob forwards
  differ in the last float32 bits, which `old_logp_source=rollout` feeds into the loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mcore_rl.rollout.sglang.launcher import ROUTER_COMMAND, LauncherConfig, ServerLauncher
from mcore_rl.rollout.sglang.remote_engine import SGLangEngine
from tests.config.keyscan import REPO
from tests.trainer.test_partial_cli import (
    CALC,
    PARTIAL,
    SEVENS,
    check_ids,
    check_resumed_ids,
    kill_after_step2_checkpoint_and_resume,
    last_per,
    run,
)

pytestmark = pytest.mark.rollout


def tiny_dir(likely_token: str | None) -> Path:
    """The folder `model=tiny` (likely_token None) or `model=tiny_sevens` ("7") trains from."""
    from mcore_rl.models.source import tiny_model_dir

    tiny = OmegaConf.load(Path(REPO) / "hydra_conf" / "model" / "tiny.yaml").tiny
    tiny.likely_token = likely_token
    return tiny_model_dir(tiny)


class Router:
    """sglang-router (manual policy: one worker per routing key) in front of two logging mcore-rl-serve workers."""

    def __init__(self, launcher: ServerLauncher, logs: Path) -> None:
        self.launcher, self.logs = launcher, logs
        self.marks: list[int] = []

    def start_run(self, model_dir: Path) -> list[str]:
        """Put both workers on `model_dir` as version 0 (what a fresh trainer starts from); the CLI overrides."""
        engine = SGLangEngine(self.launcher.worker_urls, self.launcher.router_url)
        try:
            engine.update_weights_from_disk(str(model_dir), 0)
        finally:
            engine.close()
        self.marks = [len(self._rows(w)) for w in range(2)]
        urls = ",".join(f"'{u}'" for u in self.launcher.worker_urls)
        return ["rollout=sglang", f"rollout.worker_urls=[{urls}]", f"rollout.router_url='{self.launcher.router_url}'",
                "trainer.deterministic=true"]  # fmt: skip

    def _rows(self, w: int) -> list[dict]:
        port = self.launcher.worker_urls[w].rsplit(":", 1)[1]
        path = self.logs / f"requests-{port}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []

    def served(self) -> list[tuple[int, dict]]:
        """(worker, logged row) of every sample served since start_run, in the order each worker served them."""
        return [(w, row) for w in range(2) for row in self._rows(w)[self.marks[w] :]]


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Router:
    logs = tmp_path_factory.mktemp("partial_router_logs")
    cfg = LauncherConfig(
        model_path=str(tiny_dir("7")), server="mcore-rl-serve", num_servers=2, router=True,
        router_command=[*ROUTER_COMMAND, "--policy", "manual", "--assignment-mode", "min_group"],
        extra_args=["--num-threads", "1", "--max-batch-size", "1", "--log-requests", "--log-requests-target", str(logs / "requests")],
        log_dir=str(logs), health_timeout_s=180, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield Router(launcher, logs / "requests")


# snapshot + a full audit: every carried token scored under its own version's stored weights
SINGLE = [*SEVENS, *PARTIAL, "trainer.steps=4", "algorithm.old_logp_source=snapshot",
          "algorithm.old_logp_audit_frac=1.0"]  # fmt: skip
# staged: the servers release and resume their memory around every update
EPISODES = [*CALC, "partial_rollout.enabled=true", "partial_rollout.chunk_tokens=8", "partial_rollout.over_issue=2",
            "trainer.steps=4", "optim.lr=1e-3", "schedule=staged", "algorithm.updates_per_stage=1"]  # fmt: skip


@pytest.fixture(scope="module")
def single_run(router, tmp_path_factory) -> tuple[Path, list[tuple[int, dict]]]:
    """Four rounds of the sevens task through the router: (run dir, what the workers served)."""
    out = tmp_path_factory.mktemp("partial_sglang_single")
    proc = run(out, *SINGLE, *router.start_run(tiny_dir("7")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, router.served()


@pytest.fixture(scope="module")
def episode_run(router, tmp_path_factory) -> tuple[Path, list[tuple[int, dict]]]:
    """Four rounds of calculator episodes (tool turns) through the router."""
    out = tmp_path_factory.mktemp("partial_sglang_episodes")
    proc = run(out, *EPISODES, *router.start_run(tiny_dir(None)), plugins=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, router.served()


def by_owner(served: list[tuple[int, dict]], sep: str) -> dict[str, list[tuple[int, int, dict]]]:
    """Requests by the sample / episode they belong to (SGLang rid `<id><sep><k>#0`), as (k, worker, row)."""
    out: dict[str, list[tuple[int, int, dict]]] = {}
    for w, row in served:
        owner, k = row["rid"].rsplit("#", 1)[0].split(sep)
        out.setdefault(owner, []).append((int(k), w, row))
    return {o: sorted(rows, key=lambda r: r[0]) for o, rows in out.items()}


def test_single_turn_chunks_continue_on_one_worker(single_run):
    """Every chunk of a sample continues the sample's tokens on the worker that served its first chunk; the ids
    are whole and half the trained samples were carried."""
    run_dir, served = single_run
    trained, carried = check_ids(last_per(run_dir / "partial.jsonl", "round"), 4)
    assert trained == 4 * 8 and 2 * carried >= trained, (trained, carried)
    samples, workers = by_owner(served, "/c"), set()
    for sid, rows in samples.items():
        assert [k for k, _, _ in rows] == list(range(len(rows))), sid  # each chunk sent once, none skipped
        ws = {w for _, w, _ in rows}
        assert len(ws) == 1 and all(r["routing_key"] == sid for _, _, r in rows), (sid, ws)
        workers |= ws
        prompt, so_far = rows[0][2]["input_ids"], []
        for k, _, r in rows:
            assert r["input_ids"] == prompt + so_far  # the prompt plus every token generated so far
            assert len(r["output_ids"]) <= 16 - len(so_far)  # the budget left
            if k < len(rows) - 1:
                assert len(r["output_ids"]) == 4  # cut by the chunk cap, not finished
            so_far += r["output_ids"]
    metrics = list(last_per(run_dir / "metrics.jsonl", "step").values())
    assert max(m["old_logp_error"] for m in metrics) <= 1e-6
    assert max(m["old_logp_stale_token_frac"] for m in metrics) > 0
    multi = [
        s for s, rows in samples.items() if len({v for _, _, r in rows for v in r["weight_versions"]}) > 1
    ]
    print(
        f"sglang partial: {len(samples)} samples, {len(multi)} with tokens of two versions", file=sys.stderr
    )
    assert workers == {0, 1} and multi  # both workers served; carried samples continued under a later version


def test_carried_episodes_stay_on_one_worker(episode_run):
    """Calculator episodes (tool turns between model turns) carried across rounds: each episode's turns, in
    every round it lived through, went to one worker, each turn on the episode's ids so far."""
    run_dir, served = episode_run
    trained, carried = check_ids(last_per(run_dir / "partial.jsonl", "round"), 4)
    assert trained == 4 * 8 and 2 * carried >= trained, (trained, carried)
    episodes, workers, across = by_owner(served, "/t"), set(), 0
    for eid, rows in episodes.items():
        assert [k for k, _, _ in rows] == list(range(1, len(rows) + 1)), eid
        ws = {w for _, w, _ in rows}
        assert len(ws) == 1 and all(r["routing_key"] == eid for _, _, r in rows), (eid, ws)
        workers |= ws
        for (_, _, a), (_, _, b) in zip(rows, rows[1:]):
            assert (
                b["input_ids"][: len(a["input_ids"]) + len(a["output_ids"])]
                == a["input_ids"] + a["output_ids"]
            )
        across += len({r["weight_versions"][0] for _, _, r in rows if r["output_ids"]}) > 1
    metrics = list(last_per(run_dir / "metrics.jsonl", "step").values())
    print(f"sglang partial episodes: {carried}/{trained} carried, {across} episodes served under two versions, "
          f"turns {[m['env/turns'] for m in metrics]}", file=sys.stderr)  # fmt: skip
    assert workers == {0, 1} and across > 0 and max(m["env/turns"] for m in metrics) > 1.0


@pytest.mark.slow  # two more CLI runs on the embedded engine, ~60 s
@pytest.mark.parametrize("which", ["single_run", "episode_run"])
def test_same_ids_and_losses_as_the_embedded_engine(which, request, tmp_path):
    """The seeded run on rollout=local: same ids issued / trained / carried, same rewards and lengths (the same
    tokens), and losses within the engines' float32 log-prob differences (old_logp_source=rollout)."""
    sgl_dir, _ = request.getfixturevalue(which)
    episodes = which == "episode_run"
    proc = run(tmp_path, *(EPISODES if episodes else SINGLE), "trainer.deterministic=true", "rollout.max_batch_size=1",
               plugins=episodes)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert last_per(tmp_path / "partial.jsonl", "round") == last_per(sgl_dir / "partial.jsonl", "round")
    loc, sgl = last_per(tmp_path / "metrics.jsonl", "step"), last_per(sgl_dir / "metrics.jsonl", "step")
    assert sorted(loc) == sorted(sgl) == [1, 2, 3, 4]
    for key in ("reward_mean", "response_len", "partial/carried_tokens", "partial/stale_tokens"):
        assert [loc[s][key] for s in loc] == [sgl[s][key] for s in sgl], key
    diffs = [abs(loc[s]["loss"] - sgl[s]["loss"]) for s in loc]
    print(f"{which}: max |loss local - sglang| = {max(diffs):.3g}; losses {[loc[s]['loss'] for s in loc]}",
          file=sys.stderr)  # fmt: skip
    assert max(diffs) == 0.0 and len({round(loc[s]["loss"], 6) for s in loc}) > 2, diffs


@pytest.mark.faults
@pytest.mark.slow  # two more CLI runs through the router, ~70 s
def test_sigkill_and_resume_over_sglang_reproduce_the_run(router, single_run, tmp_path):
    """Kill right after the step-2 checkpoint (samples carried mid-sample at that moment), resume on the same
    servers: the resumed run pushes the checkpoint's weights to both workers, continues the carried samples from
    their stored tokens and reproduces every loss and id of the uninterrupted run (which saved no checkpoint
    before its end: checkpointing changes nothing either)."""
    ref_dir, _ = single_run
    args = [*SINGLE, *router.start_run(tiny_dir("7")), "trainer.save_every=2"]
    resumed = kill_after_step2_checkpoint_and_resume(tmp_path, *args)
    assert "resumed 2 carried group(s) (8 unfinished samples)" in resumed
    ref, res = last_per(ref_dir / "metrics.jsonl", "step"), last_per(tmp_path / "metrics.jsonl", "step")
    assert sorted(res) == [1, 2, 3, 4]
    diffs = [abs(res[s]["loss"] - ref[s]["loss"]) for s in ref]
    print(f"sglang resume: max |loss diff| = {max(diffs):.3g}", file=sys.stderr)
    assert max(diffs) == 0.0 and [res[s]["old_logp_error"] for s in res] == [
        ref[s]["old_logp_error"] for s in ref
    ]
    check_resumed_ids(ref_dir, tmp_path, 4)
