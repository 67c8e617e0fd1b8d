"""curves.png: an environment run gets a third panel (valid tool-call rate, turns and tool calls per episode)."""

from __future__ import annotations

import json

import matplotlib.image

from mcore_rl.metrics_log import plot_run


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_env_runs_plot_tool_use_and_turns_single_turn_runs_do_not(tmp_path):
    train = [{"step": s, "reward_mean": 0.1 * s, "time_generate": 1.0, "time_train": 2.0} for s in range(1, 5)]
    plain, env = tmp_path / "plain", tmp_path / "env"
    for d in (plain, env):
        d.mkdir()
    _write(plain / "metrics.jsonl", train)
    _write(env / "metrics.jsonl", [{**r, "env/turns": 1.5, "env/tool_calls": 0.5,
                                    "env/valid_tool_call_rate": 0.25 * r["step"]} for r in train])  # fmt: skip
    _write(env / "eval.jsonl", [{"step": 0, "mean_at_k": 0.1, "pass_at_k": 0.2, "env/valid_tool_call_rate": 0.3}])
    widths = {d.name: matplotlib.image.imread(plot_run(d)).shape[1] for d in (plain, env)}
    assert widths == {"plain": 1200, "env": 1800}  # 12 vs 18 inches at 100 dpi: the third panel is there
