"""The environment contract: what one episode is made of and what an environment must say at each turn.

Why the framework, not the environment, owns tokens, tools and limits: an environment only ever sees text (the
model's reply) and answers with text (feedback messages) and a reward. Tokens are appended by the episode runner
(runner.py) exactly as the engine produced them, tool calls are parsed and executed by the runner in a sandboxed
pool (tools.py), and turn / token limits are enforced in one place. A new environment is therefore a small class:
its prompts (`records`), optionally its tools, and `respond` (judge a reply that called no tool).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mcore_rl.data.records import PromptRecord
from mcore_rl.registry import Registry
from mcore_rl.rewards.base import RewardResult, record_dict, score_with_records

Message = dict[str, Any]
SPLITS: tuple[str, ...] = ("train", "heldout")
TRUNCATED_TURN: tuple[str, ...] = ("end", "close")


@dataclass
class EnvConfig:
    """Keys every environment shares (`hydra_conf/env/*.yaml`); an environment adds its own in a subclass."""

    name: str = ""
    size: int = 256  # training prompts
    heldout_size: int = 64  # held-out prompts, disjoint from the training ones
    seed: int = 0
    max_turns: int = 4  # model turns per episode (tool turns included)
    max_total_tokens: int = 1024  # prompt + every turn; the last turn's max_new_tokens shrinks to fit
    max_new_tokens: int = 128  # per model turn
    max_tool_calls_per_turn: int = 4  # calls beyond this in one reply get an error message, not a run
    tool_format: str = "qwen"  # how replies spell tool calls: qwen | smollm2 | llama (tool_calls.py)
    truncated_turn: str = (
        "end"  # a turn cut at max_new_tokens: end the episode | close it (end-of-turn token,
    )
    #                              mask 0) and let the environment judge the text so far
    tool_timeout_s: float = 5.0  # hard per-call deadline (the worker is killed and replaced)
    tool_workers: int = 2
    tool_memory_limit_mb: int = 512  # address space a tool worker may add (RLIMIT_AS)

    def __post_init__(self) -> None:
        from mcore_rl.envs.tool_calls import TOOL_FORMATS

        checks = [
            ("size", self.size >= 1, "must be >= 1"),
            ("heldout_size", self.heldout_size >= 0, "must be >= 0"),
            ("max_turns", self.max_turns >= 1, "must be >= 1"),
            ("max_total_tokens", self.max_total_tokens >= 2, "must be >= 2"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("max_tool_calls_per_turn", self.max_tool_calls_per_turn >= 0, "must be >= 0"),
            (
                "tool_format",
                self.tool_format in TOOL_FORMATS,
                f"must be one of {', '.join(TOOL_FORMATS.names())}",
            ),
            (
                "truncated_turn",
                self.truncated_turn in TRUNCATED_TURN,
                f"must be one of {', '.join(TRUNCATED_TURN)}",
            ),
            ("tool_timeout_s", self.tool_timeout_s > 0, "must be > 0"),
            ("tool_workers", self.tool_workers >= 1, "must be >= 1"),
            ("tool_memory_limit_mb", self.tool_memory_limit_mb >= 0, "must be >= 0 (0 = no limit)"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise ValueError(f"env.{key}={getattr(self, key)!r} {why}")


@dataclass(frozen=True)
class Tool:
    """A tool the model may call. `function` is "module:name", imported inside the sandboxed worker (never in the
    trainer): it takes the call's arguments as keywords and returns the text the model sees."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    function: str

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style entry chat templates render into the system prompt (`tools=[...]`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class Feedback:
    """An environment's answer to a reply that called no tool."""

    reward: float  # this turn's reward; the episode's reward is the last one given
    done: bool
    messages: list[Message] = field(default_factory=list)  # shown to the model before its next turn
    correct: bool = False
    reason: str = ""  # termination reason when done (e.g. "answered", "out_of_attempts")


@dataclass
class Episode:
    """What an environment may read while judging: the record, the text conversation so far, its own state."""

    record: PromptRecord
    sample_index: int
    messages: list[Message]
    turn: int = 0  # model turns taken so far (this one included)
    attempts: int = 0  # replies judged by `respond` so far (this one included)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One finished episode. Lists are per token; `mask[i] == 1` iff the policy produced `token_ids[i]`.

    `logprobs` and `versions` hold the engine's log-prob and weight version of each policy token (0.0 and -1 on
    prompt / tool / environment tokens), so staleness and off-policy corrections stay exact per token.
    """

    prompt_id: str
    sample_index: int
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int  # tokens of the first prompt (before the first model turn)
    turn_spans: list[tuple[int, int]]  # [start, end) of each model turn in token_ids
    turn_rewards: list[float]  # one per model turn (0.0 for turns that only called tools)
    reward: float
    correct: bool
    tool_calls: int
    valid_tool_calls: int
    termination: str  # answered | out_of_attempts | max_turns | max_total_tokens | length | abort | ...
    messages: list[Message]  # the text conversation (for logs and evaluation)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def turns(self) -> int:
        return len(self.turn_spans)

    @property
    def policy_tokens(self) -> int:
        return sum(self.mask)


class Environment:
    """Base class. Subclasses set `config_cls`, implement `records` and `respond`, may list `tools` and may
    implement `solve` (a scripted solver for SFT demonstrations)."""

    config_cls: ClassVar[type[EnvConfig]] = EnvConfig

    def __init__(self, config: EnvConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def tools(self) -> list[Tool]:
        return []

    def records(self, split: str) -> list[PromptRecord]:
        """The prompts of `split` (train | heldout); held-out ones never occur in training."""
        raise NotImplementedError

    def start(self, record: PromptRecord) -> list[Message]:
        """The first messages of an episode (default: the record's chat prompt)."""
        if isinstance(record.prompt, str):
            return [{"role": "user", "content": record.prompt}]
        return [dict(m) for m in record.prompt]

    def respond(self, episode: Episode, reply: str) -> Feedback:
        """Judge `reply` (the model's text this turn; it called no tool)."""
        raise NotImplementedError

    def solve(self, record: PromptRecord) -> list[Message] | None:
        """Optional scripted solver: the messages of a correct episode that follow `start(record)`'s, or None.

        The hook an environment implements to give supervised (SFT) demonstrations (`python -m
        mcore_rl.envs.demos`, docs/environments.md): assistant messages written exactly as the policy would have to
        write them (tool calls in `config.tool_format`), each followed by what the episode runner would put after
        it (one `{"role": "tool", "name": ..., "content": ...}` per call, or `respond`'s feedback messages). Every
        demonstration is replayed through this environment and kept only if it scores 1.0, so a solver cannot teach
        what RL would not reward. The default (None) means the environment has no solver."""
        return None

    def close(self) -> None:
        pass


def score_reply(reward: Any, episode: Episode, reply: str) -> RewardResult:
    """Score one reply with a reward from `mcore_rl.rewards.build_reward` (a reward function, a remote service or a
    built-in), so an environment's `respond` can use the same rewards as single-turn training: the episode's record
    goes along as a plain dict (prompt_id, prompt, answer, metadata). The environment builds the reward once (e.g.
    in `__init__` from a `reward` section of its own config dataclass) and closes it in `close` (docs/rewards.md)."""
    return score_with_records(reward, [reply], [episode.record.answer], [record_dict(episode.record)])[0]


ENVS: Registry[type[Environment]] = Registry(
    "env", {"calculator": "mcore_rl.envs.calculator", "retry": "mcore_rl.envs.retry"}
)


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    return split


def build_environment(cfg: Mapping[str, Any]) -> Environment:
    """The environment named by `cfg["name"]`, its config checked key by key (one-line errors naming the key)."""
    data = dict(cfg)
    name = str(data.get("name") or "")
    cls = ENVS.get(ENVS.check(name))
    known = {f.name for f in dataclasses.fields(cls.config_cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"env={name!r}: unknown key(s) {unknown}; known: {sorted(known)}")
    for f in dataclasses.fields(cls.config_cls):
        if f.name in data:
            _check_type(f, data[f.name])
    config = cls.config_cls(**data)
    return cls(config)


_SCALARS: tuple[type, ...] = (bool, int, float, str)


def _check_type(f: dataclasses.Field, value: Any) -> None:
    """A scalar key gets a value of its default's type (an int where a float is due), so `env.size=abc` is a
    one-line error naming the key, not a TypeError from deep inside a comparison."""
    default = f.default
    if type(default) not in _SCALARS:
        return
    want = type(default)
    ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
    ok = ok or (want is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ValueError(f"env.{f.name}={value!r} must be of type {want.__name__}")
