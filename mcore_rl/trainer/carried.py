"""What a partial rollout carries from one round to the next: a group of `samples_per_prompt` samples (single-turn
continuations or multi-turn episodes), each with its tokens so far, their log-probs and weight versions, and what
is left of its budget.

Why plain-data state: a carried group is saved in every checkpoint (rank 0's schedule state, loaded with
`torch.load(weights_only=True)`), so each unit turns into lists, ints and strings and back, and a resumed run
continues exactly the tokens the killed run had kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.envs.base import Episode
from mcore_rl.envs.batch import trajectory_sample
from mcore_rl.envs.runner import _Live
from mcore_rl.rollout.protocol import GenerationRequest, Sample, SamplingParams, sample_seed

# seeds of a sample's later chunks: distinct from every request seed of the schedule (those step by 10_007)
_CHUNK_STRIDE = 1_000_000_009


@dataclass
class Continuation:
    """One single-turn sample generated in chunks: each chunk is a request whose prompt is the original prompt
    plus every token generated so far (the engine never sees a restart), its own seed, and at most the tokens
    left of `max_new_tokens`."""

    sid: str  # "<group id>#<j>": the sample's id in every round it lives through
    index: int  # j: which of the group's samples
    seed: int | None
    prompt_ids: list[int]
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # stop | length once finished
    matched: int | str | None = None
    chunks: int = 0

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def policy_versions(self) -> list[int]:
        return self.versions

    def request(self, cap: int, max_new_tokens: int, sp: dict[str, Any]) -> GenerationRequest:
        """The next chunk: at most `cap` tokens (0 = no cap) of what the sample may still generate. Its routing key
        is the sample's id: behind sglang-router's `manual` policy every chunk of a sample goes to the worker that
        served the earlier ones, whose prefix cache holds the prompt and the tokens so far."""
        left = max_new_tokens - len(self.out)
        seed = None if self.seed is None else self.seed + self.chunks * _CHUNK_STRIDE
        n = min(left, cap) if cap > 0 else left
        return GenerationRequest(self.prompt_ids + self.out, SamplingParams(max_new_tokens=n, seed=seed, **sp),
                                 rid=f"{self.sid}/c{self.chunks}", metadata={"routing_key": self.sid})  # fmt: skip

    def apply(self, s: Sample, max_new_tokens: int) -> bool:
        """Append a chunk's tokens; False (nothing kept) for an aborted chunk, which is generated again."""
        if s.finish_reason == "abort":
            return False
        self.out += list(s.output_ids)
        self.logprobs += [float(x) for x in s.output_logprobs]
        self.versions += [int(v) for v in s.weight_versions]
        self.chunks += 1
        if s.finish_reason == "stop":
            self.finish, self.matched = "stop", s.matched_stop
        elif len(self.out) >= max_new_tokens:
            self.finish = "length"
        return True

    def restart(self) -> int:
        """Drop the tokens so far (the old-logit source needs one version per turn): returns how many."""
        n = len(self.out)
        self.out, self.logprobs, self.versions, self.finish, self.matched = [], [], [], None, None
        return n

    def sample(self, rid: str, tokenizer: Any) -> Sample:
        text = tokenizer.decode(self.out, skip_special_tokens=True) if tokenizer is not None else None
        if text is not None and isinstance(self.matched, str) and self.matched in text:
            text = text[: text.index(self.matched)]
        return Sample(rid=rid, prompt_ids=list(self.prompt_ids), output_ids=list(self.out),
                      output_logprobs=list(self.logprobs), weight_versions=list(self.versions),
                      finish_reason=self.finish or "abort", text=text, matched_stop=self.matched,
                      sample_index=self.index)  # fmt: skip

    def state(self) -> dict[str, Any]:
        return {"sid": self.sid, "index": self.index, "seed": self.seed, "prompt_ids": self.prompt_ids,
                "out": self.out, "logprobs": self.logprobs, "versions": self.versions, "finish": self.finish,
                "matched": self.matched, "chunks": self.chunks}  # fmt: skip

    @classmethod
    def from_state(cls, st: dict[str, Any], prompt: Any = None) -> Continuation:
        return cls(**{**st, "prompt_ids": list(st["prompt_ids"]), "out": list(st["out"]),
                      "logprobs": list(st["logprobs"]), "versions": list(st["versions"])})  # fmt: skip


@dataclass
class EpisodePart:
    """One multi-turn episode in progress (the episode runner's record of it). A chunk runs whole turns: the
    episode is paused at a turn boundary, ready for its next turn, so no turn ever spans two rounds."""

    sid: str
    index: int
    seed: int | None
    live: _Live

    @property
    def finished(self) -> bool:
        return self.live.termination is not None

    @property
    def out(self) -> list[int]:
        return self.live.ids[self.live.prompt_len :]

    @property
    def policy_versions(self) -> list[int]:
        return [v for v, m in zip(self.live.versions, self.live.mask, strict=True) if m]

    @property
    def policy_tokens(self) -> int:
        return sum(self.live.mask)

    def sample(self, rid: str, tokenizer: Any = None) -> Sample:
        s = trajectory_sample(self.live.trajectory(), rid=rid)
        s.sample_index = self.index
        return s

    def state(self) -> dict[str, Any]:
        lv, ep = self.live, self.live.episode
        return {"sid": self.sid, "index": self.index, "seed": self.seed, "rid": lv.rid, "ids": lv.ids,
                "prompt_len": lv.prompt_len, "mask": lv.mask, "logprobs": lv.logprobs, "versions": lv.versions,
                "turn_spans": [list(t) for t in lv.turn_spans], "turn_rewards": lv.turn_rewards,
                "tool_calls": lv.tool_calls, "valid_tool_calls": lv.valid_tool_calls,
                "tool_reasons": dict(lv.tool_reasons), "termination": lv.termination, "reward": lv.reward,
                "correct": lv.correct, "messages": ep.messages, "turn": ep.turn, "attempts": ep.attempts,
                "env_state": ep.state}  # fmt: skip

    @classmethod
    def from_state(cls, st: dict[str, Any], prompt: Any = None) -> EpisodePart:
        """`prompt`: the EpisodePrompt the data source looks up by id (its record is what the env judges)."""
        ep = Episode(prompt.record, int(st["index"]), [dict(m) for m in st["messages"]], turn=int(st["turn"]),
                     attempts=int(st["attempts"]), state=dict(st["env_state"]))  # fmt: skip
        live = _Live(ep, st["rid"], list(st["ids"]), int(st["prompt_len"]))
        live.mask, live.logprobs, live.versions = list(st["mask"]), list(st["logprobs"]), list(st["versions"])
        live.turn_spans = [(int(a), int(b)) for a, b in st["turn_spans"]]
        live.turn_rewards, live.tool_reasons = list(st["turn_rewards"]), dict(st["tool_reasons"])
        live.tool_calls, live.valid_tool_calls = int(st["tool_calls"]), int(st["valid_tool_calls"])
        live.termination, live.reward, live.correct = (
            st["termination"],
            float(st["reward"]),
            bool(st["correct"]),
        )
        return cls(st["sid"], int(st["index"]), st["seed"], live)


@dataclass
class Group:
    """One prompt's `samples_per_prompt` samples; it trains once every sample has finished."""

    gid: str  # unique per issued prompt (the same prompt drawn again gets a new id)
    prompt: Any  # trainer.prompts.Prompt / trainer.episodes.EpisodePrompt
    seed: int
    born: int  # the round it was issued in
    parts: list  # Continuation | EpisodePart

    @property
    def complete(self) -> bool:
        return all(p.finished for p in self.parts)

    def age(self, version: int) -> int:
        """Versions its oldest policy token lags `version` (0 before it has any)."""
        return version - min((v for p in self.parts for v in p.policy_versions if v >= 0), default=version)

    def samples(self, tokenizer: Any) -> list[Sample]:
        return [p.sample(self.gid, tokenizer) for p in self.parts]

    def state(self) -> dict[str, Any]:
        return {
            "gid": self.gid,
            "prompt_id": self.prompt.prompt_id,
            "seed": self.seed,
            "born": self.born,
            "episodes": isinstance(self.parts[0], EpisodePart),
            "parts": [p.state() for p in self.parts],
        }

    @classmethod
    def from_state(cls, st: dict[str, Any], lookup: Any) -> Group:
        prompt = lookup(st["prompt_id"])
        unit = EpisodePart if st["episodes"] else Continuation
        return cls(
            st["gid"],
            prompt,
            int(st["seed"]),
            int(st["born"]),
            [unit.from_state(p, prompt) for p in st["parts"]],
        )


def new_group(gid: str, prompt: Any, seed: int, born: int, G: int, runner: Any = None) -> Group:
    """A freshly issued prompt: G continuations, or (with an episode runner) G episodes before their first turn."""
    if runner is None:
        parts = [
            Continuation(f"{gid}#{j}", j, sample_seed(seed, j), list(prompt.prompt_ids)) for j in range(G)
        ]
    else:
        lives = runner.start([prompt.record], G)
        for j, lv in enumerate(lives):
            lv.rid = f"{gid}#{j}"
        parts = [EpisodePart(f"{gid}#{j}", j, seed, lv) for j, lv in enumerate(lives)]
    return Group(gid, prompt, seed, born, parts)
