"""Held-out evaluation of an environment (`mcore-rl-eval --env NAME`): episodes instead of single replies.

Spec grammar, like `--set`: `NAME[:key=value,...]` or `FILE.yaml[:key=value,...]`. NAME takes
`hydra_conf/env/NAME.yaml` when it exists (the yaml training's `env=NAME` uses), else the registered environment's
defaults; options override its keys (`calculator:max_turns=2,tool_format=qwen`). The environment's held-out split
(`records("heldout")`, never a training question) is what is evaluated.

Why episodes go through the same `EpisodeRunner` as training: the turns, tool sandbox, limits and termination
reasons an evaluation reports are then the ones a policy meets while it is trained, on either engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs import Environment, Trajectory, build_environment
from mcore_rl.envs.batch import TRUNCATIONS, episode_metrics
from mcore_rl.evaluation.passk import summarize_correct
from mcore_rl.evaluation.runner import GenerationConfig, SetResult
from mcore_rl.evaluation.sets import _options
from mcore_rl.rollout.protocol import RolloutEngine, SamplingParams


@dataclass
class EnvSet:
    spec: str
    env: Environment
    records: list[PromptRecord]
    config: dict[str, Any]  # the environment's keys as evaluated (yaml + options)


def env_config(spec: str) -> dict[str, Any]:
    """Spec string -> the environment's config dict (no environment is built yet)."""
    from mcore_rl.config.paths import CONFIG_DIR

    base, _, opts = spec.partition(":")
    if Path(base).suffix in (".yaml", ".yml"):
        path = Path(base)
        if not path.is_file():
            raise ValueError(f"--env {spec!r}: no such env yaml {path}")
    else:
        path = Path(CONFIG_DIR) / "env" / f"{base}.yaml"
    cfg: dict[str, Any] = {"name": base}
    if path.is_file():
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--env {spec!r}: {path} is not a mapping")
        cfg = {k: v for k, v in loaded.items() if k != "defaults"}
    cfg.update(_options(opts, spec))
    return cfg


def load_env(spec: str, num_prompts: int) -> EnvSet:
    """Build the environment (its keys checked one by one) and take the first `num_prompts` held-out records."""
    cfg = env_config(spec)
    try:
        env = build_environment(cfg)
        records = env.records("heldout")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--env {spec!r}: {str(e).strip(chr(39))}") from None
    records = records[:num_prompts] if num_prompts > 0 else records
    if not records:
        env.close()
        raise ValueError(f"--env {spec!r}: no held-out records (env.heldout_size={env.config.heldout_size})")
    return EnvSet(spec, env, list(records), cfg)


def evaluate_env(
    engine: RolloutEngine, tokenizer: Any, es: EnvSet, gen: GenerationConfig, stop_token_ids: list[int],
    ks: list[int] | None = None,
) -> SetResult:
    """n episodes per held-out record (the env's per-turn `max_new_tokens`; `gen` gives n, temperature, top-p and
    the seed). Success = the episode's `correct`; mean@n / pass@k over episodes as for a set, plus the episode
    metrics (turns, tool calls, valid-call rate, reward, termination fractions)."""
    from mcore_rl.envs.chat import TurnRenderer
    from mcore_rl.envs.runner import EpisodeRunner

    env = es.env
    renderer = TurnRenderer(tokenizer, [t.schema() for t in env.tools])
    runner = EpisodeRunner(env, engine, renderer)
    sampling = SamplingParams(temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
                              stop_token_ids=list(stop_token_ids))
    t0 = time.perf_counter()
    try:
        trajs = runner.run(es.records, sampling, samples_per_prompt=gen.n)
    finally:
        if runner.tools is not None:
            runner.tools.close()
    t_gen = time.perf_counter() - t0
    matrix = np.asarray([t.correct for t in trajs], dtype=bool).reshape(len(es.records), gen.n)
    summary = summarize_correct(matrix, ks)
    policy = np.asarray([t.policy_tokens for t in trajs], dtype=np.float64)
    summary.update({
        "response_len": float(policy.mean()),  # policy tokens per episode (all its turns)
        "truncation_rate": float(np.mean([t.termination in TRUNCATIONS for t in trajs])),
        **episode_metrics(trajs, prefix=""),
        "time_generate_s": t_gen, "time_total_s": t_gen, "tokens_per_s": float(policy.sum() / max(t_gen, 1e-9)),
    })  # fmt: skip
    per_prompt = [
        {"prompt_id": r.prompt_id, "answer": r.answer, "correct": matrix[i].tolist(),
         "responses": [_last_reply(t) for t in trajs[i * gen.n : (i + 1) * gen.n]],
         "episodes": [_episode_row(t) for t in trajs[i * gen.n : (i + 1) * gen.n]]}
        for i, r in enumerate(es.records)
    ]  # fmt: skip
    return SetResult(es.spec, f"env_{env.name}", summary, per_prompt, matrix)


def _last_reply(t: Trajectory) -> str:
    return next((m["content"] for m in reversed(t.messages) if m["role"] == "assistant"), "")


def _episode_row(t: Trajectory) -> dict[str, Any]:
    """What --samples-out keeps of an episode: enough to recount every reported number."""
    return {"sample_index": t.sample_index, "correct": t.correct, "reward": t.reward, "turns": t.turns,
            "tool_calls": t.tool_calls, "valid_tool_calls": t.valid_tool_calls, "termination": t.termination,
            "policy_tokens": t.policy_tokens, "turn_rewards": t.turn_rewards, "messages": t.messages}


def format_env_table(rows: list[tuple[str, dict[str, float]]], ks: list[int], n: int) -> str:
    """One row per environment: success (mean@n, pass@k), turns, tool calls, valid-call rate, how episodes ended."""
    head = ["env", "prompts", f"mean@{n}", *[f"pass@{k}" for k in ks], "reward", "turns", "tools", "valid",
            "ended"]  # fmt: skip
    body = []
    for spec, s in rows:
        ends = sorted(((k[4:], v) for k, v in s.items() if k.startswith("end_")), key=lambda kv: -kv[1])
        body.append([spec, f"{int(s['num_prompts'])}", f"{s['mean_at_n']:.3f}",
                     *[f"{s[f'pass_at_{k}']:.3f}" for k in ks], f"{s['reward']:.3f}", f"{s['turns']:.2f}",
                     f"{s['tool_calls']:.2f}", f"{s['valid_tool_call_rate']:.2f}",
                     " ".join(f"{k}={v:.2f}" for k, v in ends)])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head, *body]]  # fmt: skip
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
