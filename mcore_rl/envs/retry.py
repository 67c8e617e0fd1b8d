"""`retry`: a reasoning-gym task where a wrong answer gets the environment's feedback and another attempt.

Reward: `discount ** (attempt - 1)` for a correct answer at that attempt (1.0 first time), 0.0 when the attempts run
out. Correctness is reasoning-gym's own `score_answer` (full marks only). The feedback never reveals the answer.
Held-out prompts come from seed + 1000 with every training question removed (reasoning-gym repeats short problems
across seeds, so seeds alone do not separate splits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import ENVS, EnvConfig, Environment, Episode, Feedback, Message, check_split
from mcore_rl.rewards.extract import extract_answer

HELDOUT_SEED_OFFSET = 1000


@dataclass
class RetryConfig(EnvConfig):
    task: str = "basic_arithmetic"  # any reasoning_gym.create_dataset name
    task_options: dict[str, Any] = field(default_factory=dict)  # its difficulty knobs
    max_attempts: int = 3  # answers judged per episode
    discount: float = 0.5  # reward factor per extra attempt
    prompt_template: str = "{question} Give only the final answer as <answer>...</answer>."
    feedback: str = "{answer} is not correct. Check your work and try again."

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_attempts < 1:
            raise ValueError(f"env.max_attempts={self.max_attempts} must be >= 1")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"env.discount={self.discount} must be in (0, 1]")
        if "{question}" not in self.prompt_template:
            raise ValueError("env.prompt_template must contain '{question}'")


def candidate(reply: str) -> str | None:
    """reasoning-gym's <answer> tag first, then our own extraction (boxed / "answer is" / last number)."""
    from reasoning_gym.utils import extract_answer as tagged

    found = tagged(reply)
    if found:
        return found.strip()
    ours = extract_answer(reply)
    return ours.candidate if ours is not None else None


@ENVS.register("retry")
class RetryEnv(Environment):
    config_cls = RetryConfig
    config: RetryConfig

    def __init__(self, config: RetryConfig) -> None:
        super().__init__(config)
        self._datasets: dict[str, Any] = {}

    def _dataset(self, split: str) -> Any:
        if split not in self._datasets:
            import reasoning_gym

            cfg = self.config
            size = cfg.size if split == "train" else cfg.heldout_size + cfg.size  # room for removed repeats
            seed = cfg.seed if split == "train" else cfg.seed + HELDOUT_SEED_OFFSET
            try:
                self._datasets[split] = reasoning_gym.create_dataset(
                    cfg.task, size=size, seed=seed, **cfg.task_options
                )
            except Exception as e:
                raise ValueError(
                    f"env.task={cfg.task!r}: reasoning_gym.create_dataset failed: {type(e).__name__}: {e}"
                ) from e
        return self._datasets[split]

    def records(self, split: str) -> list[PromptRecord]:
        check_split(split)
        train = self._dataset("train")
        seen = {train[i]["question"] for i in range(len(train))} if split == "heldout" else set()
        # within the training split, repeats stay (they are the task's own distribution)
        ds, limit = self._dataset(split), self.config.size if split == "train" else self.config.heldout_size
        out = []
        for i in range(len(ds)):
            entry = ds[i]
            if len(out) >= limit:
                break
            if split == "heldout":
                if entry["question"] in seen:
                    continue
                seen.add(entry["question"])
            text = self.config.prompt_template.replace("{question}", entry["question"])
            out.append(
                PromptRecord(
                    f"retry-{self.config.task}-{split}-{i}",
                    [{"role": "user", "content": text}],
                    str(entry["answer"]),
                    {"split": split, "index": i},
                )
            )
        return out

    def solve(self, record: PromptRecord) -> list[Message] | None:
        """The reference answer in the tag the prompt asks for, at the first attempt."""
        return [{"role": "assistant", "content": f"<answer>{record.answer}</answer>"}]

    def respond(self, episode: Episode, reply: str) -> Feedback:
        meta = episode.record.metadata
        entry = self._dataset(meta["split"])[meta["index"]]
        got = candidate(reply)
        ok = got is not None and float(self._dataset(meta["split"]).score_answer(got, entry)) >= 1.0 - 1e-9
        episode.state.setdefault("answers", []).append(got)
        if ok:
            reward = self.config.discount ** (episode.attempts - 1)
            return Feedback(reward, True, correct=True, reason="answered")
        if episode.attempts >= self.config.max_attempts:
            return Feedback(0.0, True, reason="out_of_attempts")
        msg = self.config.feedback.replace("{answer}", got if got is not None else "No answer given")
        return Feedback(0.0, False, [{"role": "user", "content": msg}])
