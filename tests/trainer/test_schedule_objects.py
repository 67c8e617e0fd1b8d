"""The schedule objects around a real LocalEngine (tiny random Llama): staleness is checked when a round is consumed
(drop / requeue, counted), and the in-flight state round-trips so a resumed run regenerates the same requests with
the same seeds (same tokens)."""

from __future__ import annotations

import pytest

from mcore_rl.algorithms import build_algorithm
from mcore_rl.config import TrainerConfig
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.trainer.prompts import Prompt
from mcore_rl.trainer.schedule import ScheduleContext, schedule_class
from mcore_rl.trainer.setup import StopFlag
from mcore_rl.trainer.state import RunState


class Prompts:
    """The part of trainer.prompts.PromptSource a schedule uses: a cursor over numbered prompts, and lookup."""

    stop_token_ids: list[int] = []

    def __init__(self) -> None:
        self.cursor = 0

    def lookup(self, pid: str) -> Prompt:
        i = int(pid[1:])
        return Prompt(pid, [1 + i % 50, 7, 9], str(i))

    def next_prompts(self, n: int) -> list[Prompt]:
        out = [self.lookup(f"p{self.cursor + i}") for i in range(n)]
        self.cursor += n
        return out


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with LocalEngine(str(tiny_llama_dir), seed=0) as eng:
        yield eng


def make_schedule(engine, policy: str = "drop", k: int = 2):
    trainer = TrainerConfig(deterministic=True, prompts_per_update=2, samples_per_prompt=2, max_new_tokens=4,
                            temperature=1.0, top_p=1.0)
    alg = build_algorithm({"name": "grpo", "schedule": "async", "max_staleness": k, "stale_policy": policy})
    state = RunState()
    engine.set_weight_version(0)
    ctx = ScheduleContext(alg.config, trainer, seed=3, deterministic=True, state=state, stop=StopFlag(),
                          engine=engine, data=Prompts())
    return state, schedule_class(alg.config.schedule)(ctx)


def _age_everything_in_flight(state, sched, engine, versions: int) -> None:
    """Let every round in flight finish at the current version, then move trainer and engine `versions` on."""
    assert sched._wait(sched._all_futures())
    state.version += versions
    engine.set_weight_version(state.version)


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_stale_groups_are_dropped_or_requeued(engine, policy):
    state, sched = make_schedule(engine, policy)
    sched._fill(1)
    assert [r.index for r in sched.pending] == [0, 1, 2]  # PipelineRL-2: the consumed round + 2 ahead
    first_prompts = [r.prompt.prompt_id for r in sched.pending[0].requests]
    _age_everything_in_flight(state, sched, engine, 3)  # 3 versions > max_staleness = 2: all three rounds stale
    got = sched.next_round(1)
    assert got.metrics["stale_groups"] == 0.0 and got.metrics["staleness_checked_max"] == 0.0
    key = "stale_requeued_total" if policy == "requeue" else "stale_dropped_total"
    assert got.metrics[key] == 6.0  # 3 rounds x 2 prompts, counted
    assert all(v == 3 for s in got.samples for v in s.weight_versions)
    ids = [p.prompt_id for p in got.prompts]
    if policy == "requeue":  # the stale prompts come back first, generated fresh
        assert ids == first_prompts
    else:  # dropped: the round that trains holds fresh prompts only
        assert ids == ["p6", "p7"]


def test_within_bound_nothing_dropped(engine):
    state, sched = make_schedule(engine)
    sched._fill(1)
    _age_everything_in_flight(state, sched, engine, 2)  # exactly k versions behind: allowed
    got = sched.next_round(1)
    assert got.metrics["stale_groups"] == 0.0 and got.metrics["staleness_checked_max"] == 2.0
    assert [p.prompt_id for p in got.prompts] == ["p0", "p1"]


def test_state_round_trip_regenerates_the_same_requests(engine):
    state, sched = make_schedule(engine)
    sched._fill(1)
    assert sched._wait(sched._all_futures())
    want = [[s.output_ids for r in rnd.requests for s in r.result()] for rnd in sched.pending]
    state = sched.state_dict()
    state["pending"][1]["requests"][0]["samples"] = None  # as if it had still been generating at the checkpoint
    state["pending"][2]["requests"] = [dict(r, samples=None) for r in state["pending"][2]["requests"]]
    _, sched2 = make_schedule(engine)
    sched2.load_state_dict(state)
    got = [sched2.next_round(1) for _ in range(3)]
    assert [g.index for g in got] == [0, 1, 2]
    assert [[s.output_ids for s in g.samples] for g in got] == want  # same prompts, same seeds, same tokens
    assert sched2.next_index == 3 + 2  # consuming three rounds submitted two more, after the restored ones
