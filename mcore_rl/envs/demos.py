"""`python -m mcore_rl.envs.demos env=NAME [env.KEY=VALUE ...] --split train --n N --out FILE.jsonl`: supervised
(SFT) demonstrations written by an environment's scripted solver (`Environment.solve`), for a cold start before RL.

Why every demonstration is replayed before it is written: a solver is code next to the environment, and a slip
(a call spelled in another tool format, a wrong operand order, an answer the judge does not parse) would teach the
policy exactly what RL then punishes. The replay walks the episode the way `EpisodeRunner` does (its turn and
per-turn call limits, tool calls parsed in `env.tool_format` and run in the same sandboxed pool, each result
compared with the solver's tool message, `respond` on each reply without calls) and keeps only episodes that end
`correct` with reward 1.0 and every call valid. Rows are `{"messages", "prompt_messages", "prompt_id", "answer",
"tools"}`: the environment's start messages and the solver's, in the roles the runner uses (`tool` for tool
results); how many of them are the prompt (calculator's prompt holds a solved example with assistant turns of its
own, which RL never trains on); and the tool schemas the runner's `TurnRenderer` renders into the prompt.
`TurnRenderer.episode_ids(row["messages"], row["prompt_messages"])` tokenizes a row exactly as the runner would
have built the episode (ids and policy mask).

Env keys are given as mcore-rl-train takes them: `env=NAME` (hydra_conf/env/NAME.yaml, else the registered
environment's defaults) and `env.KEY=VALUE` overrides (values typed as Hydra types them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import Environment, Episode, Message, build_environment, check_split
from mcore_rl.envs.tool_calls import ToolCall, parse_tool_calls
from mcore_rl.envs.tools import ToolRunner, tool_message

PROG = "python -m mcore_rl.envs.demos"


def env_config(overrides: Sequence[str]) -> dict[str, Any]:
    """`env=NAME` and `env.KEY=VALUE` overrides -> the environment's config dict (nothing is built yet). Values are
    YAML-typed as Hydra types them; a dotted KEY reaches into a mapping (`env.task_options.max_terms=2`)."""
    from omegaconf._utils import get_yaml_loader  # OmegaConf's (Hydra's) typing: 5e-5 is a float

    from mcore_rl.config.paths import CONFIG_DIR

    name, sets = None, []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.lstrip("+")  # Hydra's "add a key" prefix: every env key is accepted the same way here
        if not sep or not (key == "env" or key.startswith("env.")):
            raise ValueError(f"override {item!r}: expected env=NAME or env.KEY=VALUE")
        try:
            value = yaml.load(text, Loader=get_yaml_loader()) if text.strip() else None  # a SafeLoader
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: not a YAML value ({getattr(e, 'problem', e)})") from None
        if key == "env":
            name = text
        else:
            sets.append((key[len("env.") :].split("."), value))
    if not name:
        raise ValueError("no environment: give env=NAME (a hydra_conf/env/NAME.yaml or a registered name)")
    path = Path(CONFIG_DIR) / "env" / f"{name}.yaml"
    cfg: dict[str, Any] = {"name": name}
    if path.is_file():
        cfg = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}
    for parts, value in sets:
        node = cfg
        for part in parts[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ValueError(f"override env.{'.'.join(parts)}: env.{part} is not a mapping")
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return cfg


class Replay:
    """Replays solver episodes through an environment and its tools, as the episode runner would run them."""

    def __init__(self, env: Environment) -> None:
        self.env, self.cfg = env, env.config
        self.tools = (
            ToolRunner(
                env.tools,
                num_workers=self.cfg.tool_workers,
                timeout_s=self.cfg.tool_timeout_s,
                memory_limit_mb=self.cfg.tool_memory_limit_mb,
            )
            if env.tools
            else None
        )

    def check(self, record: PromptRecord, turns: Sequence[Message]) -> str | None:
        """None if `turns` (the messages after `start(record)`) is a correct episode, else why it is not."""
        episode = Episode(record, 0, self.env.start(record))
        k = 0
        while k < len(turns):
            msg = turns[k]
            if msg.get("role") != "assistant":
                return f"message {k} is {msg.get('role')!r} where the model's turn comes"
            episode.turn += 1
            if episode.turn > self.cfg.max_turns:
                return f"more than env.max_turns={self.cfg.max_turns} model turns"
            episode.messages.append({"role": "assistant", "content": msg["content"]})
            calls = parse_tool_calls(msg["content"], self.cfg.tool_format) if self.env.tools else []
            if calls:
                expected, why = self._tool_turn(episode, calls)
            else:
                expected, why = self._reply_turn(episode, msg["content"], last=k == len(turns) - 1)
            if why is not None:
                return why
            if not expected:
                return None
            if [dict(m) for m in turns[k + 1 : k + 1 + len(expected)]] != expected:
                return f"the messages after turn {episode.turn} are not {expected!r}"
            episode.messages.extend(expected)
            k += 1 + len(expected)
        return "the episode ends without a judged answer"

    def _tool_turn(self, episode: Episode, calls: list[ToolCall]) -> tuple[list[Message], str | None]:
        if episode.turn >= self.cfg.max_turns:
            return [], f"tool calls in the last allowed turn ({episode.turn}) are never run"
        if len(calls) > self.cfg.max_tool_calls_per_turn:
            return [], f"{len(calls)} calls in one turn > env.max_tool_calls_per_turn"
        assert self.tools is not None
        results = self.tools.run(calls)
        bad = [r for r in results if not r.ok]
        if bad:
            return [], f"invalid tool call in turn {episode.turn}: {bad[0].text}"
        return [tool_message(r) for r in results], None

    def _reply_turn(self, episode: Episode, reply: str, last: bool) -> tuple[list[Message], str | None]:
        episode.attempts += 1
        fb = self.env.respond(episode, reply)
        if fb.done:
            if not last:
                return [], f"the environment ended the episode at turn {episode.turn}, before the demo's end"
            if not (fb.correct and float(fb.reward) == 1.0):
                return [], f"judged {fb.reason or 'wrong'} (reward {fb.reward}, correct {fb.correct})"
            return [], None
        if not fb.messages:
            return [], "respond() returned done=False without messages"
        if episode.turn >= self.cfg.max_turns:
            return [], f"env.max_turns={self.cfg.max_turns} reached without a judged answer"
        return [dict(m) for m in fb.messages], None

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()


def solved_rows(env: Environment, records: Sequence[PromptRecord]) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows of the records whose solver episode replays to success, one line per dropped record)."""
    if type(env).solve is Environment.solve:
        raise ValueError(f"env={env.name!r} has no scripted solver (Environment.solve is not implemented)")
    tools = [t.schema() for t in env.tools]
    replay, rows, dropped = Replay(env), [], []
    try:
        for rec in records:
            turns = env.solve(rec)
            why = "the solver returned no episode" if not turns else replay.check(rec, turns)
            if why is not None:
                dropped.append(f"{rec.prompt_id}: {why}")
                continue
            start = env.start(rec)
            rows.append(
                {
                    "messages": [*start, *[dict(m) for m in turns]],
                    "prompt_messages": len(start),  # assistant turns before this index are prompt
                    "prompt_id": rec.prompt_id,
                    "answer": rec.answer,
                    "tools": tools,
                }
            )
    finally:
        replay.close()
    return rows, dropped


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument(
        "overrides", nargs="*", metavar="env=NAME | env.KEY=VALUE", help="the environment, as for training"
    )
    p.add_argument("--split", default="train", help="train | heldout (default train)")
    p.add_argument(
        "--n", type=int, default=0, help="demonstrations from the split's first N records (0 = all)"
    )
    p.add_argument("--out", required=True, help="the jsonl file to write")
    p.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="import this module first (an environment of your own), repeatable")  # fmt: skip
    return p


def run(argv: Sequence[str] | None = None) -> tuple[int, int]:
    """Write the demonstrations; (written, dropped). ValueError (one line) for bad input."""
    from mcore_rl import plugins

    a = _parser().parse_intermixed_args(argv)
    plugins.load(a.plugins)
    check_split(a.split)
    if a.n < 0:
        raise ValueError(f"--n {a.n}: must be >= 0")
    env = build_environment(env_config(a.overrides))
    try:
        records = env.records(a.split)
        if a.n > len(records):
            key = "size" if a.split == "train" else "heldout_size"
            raise ValueError(f"--n {a.n} > the {len(records)} {a.split} records: raise env.{key}")
        rows, dropped = solved_rows(env, records[: a.n] if a.n else records)
    finally:
        env.close()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for line in dropped[:5]:
        print(f"dropped {line}", file=sys.stderr)
    print(
        f"wrote {len(rows)} demonstrations to {out} (env {env.name}, split {a.split}); dropped {len(dropped)}"
    )
    return len(rows), len(dropped)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        run(argv)
    except (ValueError, KeyError, TypeError) as e:
        msg = " ".join(str(e).strip("'").split())
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
