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
from tests.trainer.test_partial_cli import CALC, PARTIAL, SEVENS, check_ids, last_per, run

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
        extra_args=["--num-threads", "1", "--log-requests", "--log-requests-target", str(logs / "requests")],
        log_dir=str(logs), health_timeout_s=180, monitor=False,
    )  # fmt: skip
    with ServerLauncher(cfg) as launcher:
        yield Router(launcher, logs / "requests")


def by_key(served: list[tuple[int, dict]], key: str) -> dict[str, list[tuple[int, dict]]]:
    out: dict[str, list[tuple[int, dict]]] = {}
    for w, row in served:
        out.setdefault(row["rid"].split("/")[0], []).append((w, row))
    return out


SINGLE = [*SEVENS, *PARTIAL, "trainer.steps=4"]


def test_single_turn_chunks_continue_on_one_worker(router, tmp_path):
    """Four rounds of the sevens task through the router: every chunk of a sample continues the sample's tokens on
    the worker that served its first chunk, and the ids are whole."""
    proc = run(tmp_path / "run", *SINGLE, *router.start_run(tiny_dir("7")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    trained, carried = check_ids(last_per(tmp_path / "run" / "partial.jsonl", "round"), 4)
    assert trained == 4 * 8 and 2 * carried >= trained, (trained, carried)
    samples = by_key(router.served(), "rid")
    workers = set()
    for sid, rows in samples.items():
        rows.sort(key=lambda wr: int(wr[1]["rid"].split("/c")[1].split("#")[0]))
        assert [int(r["rid"].split("/c")[1].split("#")[0]) for _, r in rows] == list(range(len(rows))), sid
        ws = {w for w, _ in rows}
        assert len(ws) == 1 and all(r["routing_key"] == sid for _, r in rows), (sid, ws)
        workers |= ws
        prompt, so_far = rows[0][1]["input_ids"], []
        for k, (_, r) in enumerate(rows):
            assert r["input_ids"] == prompt + so_far  # the prompt plus every token generated so far
            assert len(r["output_ids"]) <= 16 - len(so_far)
            if k < len(rows) - 1:
                assert len(r["output_ids"]) == 4  # cut by the chunk cap, not finished
            so_far += r["output_ids"]
    multi = [sid for sid, rows in samples.items() if len({v for _, r in rows for v in r["weight_versions"]}) > 1]
    print(f"sglang partial: {len(samples)} samples, {len(multi)} with tokens of two versions", file=sys.stderr)
    assert workers == {0, 1} and multi  # both workers served; carried samples continued under a later version
