"""The environment written in docs/environments.md runs as shown, against the real engine."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import yaml

from mcore_rl.envs import ENVS, build_environment
from mcore_rl.envs.chat import TurnRenderer
from mcore_rl.envs.runner import EpisodeRunner
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.protocol import SamplingParams

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.fixture(scope="module")
def reverse_cfg() -> dict:
    code = next(b for b in _blocks("python") if '@ENVS.register("reverse")' in b)
    assert len(code.splitlines()) <= 32  # "a small class": the docs promise about 30 lines
    if "reverse" not in ENVS:  # import it as a user module would be imported
        module = types.ModuleType("docs_env_example")
        sys.modules[module.__name__] = module
        exec(compile(code, str(DOC), "exec"), module.__dict__)
    return yaml.safe_load(next(b for b in _blocks("yaml") if "name: reverse" in b))


def test_docs_environment_runs(reverse_cfg, smol_dir):
    env = build_environment(reverse_cfg)
    assert [r.answer for r in env.records("train")] == ["tenalp", "ruobrah"]
    assert env.respond(_episode(env, 1), "tenalp.").reward == 1.0
    engine = LocalEngine(str(smol_dir), device="cpu", seed=0)
    try:
        trajs = EpisodeRunner(env, engine, TurnRenderer(engine.tokenizer)).run(
            env.records("heldout"), SamplingParams(temperature=1.0, seed=2)
        )
    finally:
        engine.close()
    for t in trajs:  # random weights: wrong twice, or cut at max_new_tokens (truncated_turn: end)
        assert t.termination in ("answered", "length") and 1 <= t.turns <= 2 and t.reward == 0.0
        assert t.policy_tokens <= 2 * 16


def _episode(env, attempts):
    from mcore_rl.envs import Episode

    rec = env.records("train")[0]
    return Episode(rec, 0, list(rec.prompt), attempts=attempts)
