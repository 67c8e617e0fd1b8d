"""`env=second_chance`: the apples problems as two-turn episodes. A wrong first answer is told so (never the
answer) and gets one more try; a correct answer scores 1.0 on the first attempt and 0.5 on the second.

An environment gives its prompts (`records`) and judges each reply (`respond`); mcore-rl runs the turns, renders
them with the model's chat template, masks the feedback tokens out of the loss and trains on the episode's reward.
It judges with the same function the single-turn run trains on (my_task.rewards.score)."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import ENVS, EnvConfig, Environment, Episode, Feedback, check_split
from my_task.data import ApplesConfig, load_apples
from my_task.rewards import score


@dataclass
class SecondChanceConfig(EnvConfig):
    max_operand: int = 20
    discount: float = 0.5  # reward of a correct second answer
    feedback: str = "That is not right. Check your arithmetic and answer again with just the number."


def question(record: PromptRecord) -> str:
    return record.prompt if isinstance(record.prompt, str) else record.prompt[-1]["content"]


@ENVS.register("second_chance")
class SecondChance(Environment):
    config_cls = SecondChanceConfig
    config: SecondChanceConfig

    def records(self, split: str) -> list[PromptRecord]:
        """Training problems from `seed`; held-out ones from another seed, minus any training question (short
        problems recur across seeds), so held-out success measures problems the policy never trained on."""
        c = self.config
        train, _ = load_apples(ApplesConfig(size=c.size, seed=c.seed, max_operand=c.max_operand))
        if check_split(split) == "train":
            return train
        seen = {question(r) for r in train}
        more, _ = load_apples(ApplesConfig(size=c.heldout_size + c.size, seed=c.seed + 1000, max_operand=c.max_operand))
        return [r for r in more if question(r) not in seen][: c.heldout_size]

    def respond(self, episode: Episode, reply: str) -> Feedback:
        result = score(reply, episode.record.answer, episode.record.to_dict())
        if result["score"] > 0:
            return Feedback(self.config.discount ** (episode.attempts - 1), True, correct=True, reason="answered")
        if episode.attempts >= 2:
            return Feedback(0.0, True, reason="out_of_attempts")
        return Feedback(0.0, False, [{"role": "user", "content": self.config.feedback}])
