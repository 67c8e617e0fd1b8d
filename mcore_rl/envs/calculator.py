"""`calculator`: multi-step word problems with operands too large to work out in the head, and a `calc` tool.

The model may call `calc` (exact arithmetic, calc.py) any number of times, then answers; the episode ends at the
first reply without a tool call, scored 1.0 if its final number equals the answer. Held-out problems come from
another seed and never repeat a training question.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs.base import ENVS, EnvConfig, Environment, Episode, Feedback, Message, Tool, check_split
from mcore_rl.envs.calc import evaluate
from mcore_rl.rewards.extract import extract_answer

# Problems by number of operations: (template, the expression that solves it), both over the operands a, b, c, d
# drawn per problem. The expression is the single source of the answer (evaluated by the calc tool's own code) and
# what the scripted solver (`CalculatorEnv.solve`) sends to `calc`, in the question's word order. Two operations (`b*c - d`, `b*c + a`) have the demonstration's shape; three (`a + b*c - d`) need one more operand
# placed right.
_PROBLEMS: dict[int, list[tuple[str, str]]] = {
    2: [
        (
            "A bakery bakes {b} trays of {c} cookies each and sells {d} cookies. How many cookies are left?",
            "{b}*{c} - {d}",
        ),
        (
            "A truck carries {b} crates of {c} apples each and drops off {d} apples. "
            "How many apples are still on the truck?",
            "{b}*{c} - {d}",
        ),
        (
            "A school buys {b} packs of {c} pencils each and already has {a} pencils. "
            "How many pencils does it have now?",
            "{b}*{c} + {a}",
        ),
        (
            "A library has {b} shelves of {c} books each and {a} more books in storage. "
            "How many books does it have in total?",
            "{b}*{c} + {a}",
        ),
    ],
    3: [
        (
            "A warehouse holds {a} boxes. It receives {b} shipments of {c} boxes each, then sends out {d} boxes. "
            "How many boxes are in the warehouse now?",
            "{a} + {b}*{c} - {d}",
        ),
        (
            "A farm has {b} fields that each yield {c} kg of grain, plus {a} kg in its silo. It sells {d} kg. "
            "How many kg of grain does it have left?",
            "{b}*{c} + {a} - {d}",
        ),
        (
            "A factory made {a} parts last month and {b} batches of {c} parts this month; {d} parts failed "
            "inspection. How many good parts did it make in the two months?",
            "{a} + {b}*{c} - {d}",
        ),
        (
            "A city had {a} residents. Over {b} years its population grew by {c} people a year, and {d} people "
            "moved away in total. How many residents does it have now?",
            "{a} + {b}*{c} - {d}",
        ),
    ],
}
_CALC = Tool(
    name="calc",
    description="Evaluate an arithmetic expression exactly (numbers, + - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 1234*56"}},
        "required": ["expression"],
    },
    function="mcore_rl.envs.calc:evaluate",
)


@dataclass
class CalculatorConfig(EnvConfig):
    min_operand: int = 1000  # a, c and d are drawn from [min_operand, max_operand]; b from [3, 99]
    max_operand: int = 99999
    operations: int = 3  # 3: a + b*c - d (the default task); 2: b*c - d or b*c + a, the demonstration's shape
    system_prompt: str = (
        "Solve the problem. You may call the calc tool to do arithmetic: write {call} and wait "
        "for its result. When you know the answer, reply with it as \\boxed{{N}}."
    )

    demonstration: bool = (
        True  # put one solved problem (a calc call, its result, the answer) before the question:
    )
    #   SmolLM2-135M-Instruct writes no tool call in 16 episodes without it, ~1 in 5 with it (docs/environments.md)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"env.min_operand={self.min_operand} must be in [1, max_operand={self.max_operand}]"
            )
        if self.operations not in _PROBLEMS:
            raise ValueError(f"env.operations={self.operations} must be one of {sorted(_PROBLEMS)}")
        if "{call}" not in self.system_prompt:
            raise ValueError("env.system_prompt must contain '{call}' (where the tool-call example goes)")


def example_call(tool_format: str, expression: str = "4817*23") -> str:
    """How a call is spelled in `tool_format` (the system prompt shows one: not every template renders tools)."""
    if tool_format == "llama":
        return json.dumps({"name": "calc", "parameters": {"expression": expression}})
    return f"<tool_call>{json.dumps({'name': 'calc', 'arguments': {'expression': expression}})}</tool_call>"


_DEMO_QUESTION = "A shop has 12 shelves of 3417 cans each and sells 5230 cans. How many cans are left?"
_DEMO_EXPRESSION = "12*3417 - 5230"


def solved_turns(tool_format: str, expression: str) -> list[Message]:
    """A correct episode's turns after the question: one `calc` call on the whole `expression`, spelled in
    `tool_format` as the system prompt shows it, the tool's result as the runner writes it, and the boxed answer.

    Why one combined call and not one per operation: it is the in-prompt demonstration's shape, and it takes two
    model turns whatever the number of operations, so it fits every `max_turns >= 2`."""
    value = evaluate(expression)
    return [
        {"role": "assistant", "content": example_call(tool_format, expression)},
        {"role": "tool", "name": "calc", "content": value},
        {"role": "assistant", "content": f"\\boxed{{{value}}}"},
    ]


def demonstration(tool_format: str) -> list[Message]:
    """One solved problem as chat turns: the question, a calc call in `tool_format`, its result, the answer. Its
    wording matches none of the generated problems, so it never leaks a training or held-out answer."""
    return [{"role": "user", "content": _DEMO_QUESTION}, *solved_turns(tool_format, _DEMO_EXPRESSION)]


def _problem(rng: random.Random, cfg: CalculatorConfig) -> tuple[str, str, str]:
    """(question, expression, answer) of one drawn problem."""
    problems = _PROBLEMS[cfg.operations]
    template, expr_template = problems[rng.randrange(len(problems))]
    a, c = rng.randint(cfg.min_operand, cfg.max_operand), rng.randint(cfg.min_operand, cfg.max_operand)
    b = rng.randint(3, 99)
    total = b * c + (a if cfg.operations == 3 else 0)  # what d is subtracted from: the answer stays positive
    d = rng.randint(cfg.min_operand, min(cfg.max_operand, total - 1))
    expression = expr_template.format(a=a, b=b, c=c, d=d)
    return template.format(a=a, b=b, c=c, d=d), expression, evaluate(expression)


def final_number(reply: str) -> int | None:
    """The reply's final answer as an integer (\\boxed{} first, then "answer is", then the last number)."""
    found = extract_answer(reply)
    if found is None:
        return None
    text = found.candidate.replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


@ENVS.register("calculator")
class CalculatorEnv(Environment):
    config_cls = CalculatorConfig
    config: CalculatorConfig

    @property
    def tools(self) -> list[Tool]:
        return [_CALC]

    def records(self, split: str) -> list[PromptRecord]:
        cfg = self.config
        train = self._generate("train", cfg.size, set())
        if check_split(split) == "train":
            return train
        return self._generate("heldout", cfg.heldout_size, {r.metadata["question"] for r in train})

    def _generate(self, split: str, size: int, exclude: set[str]) -> list[PromptRecord]:
        rng = random.Random(f"calculator:{split}:{self.config.seed}")
        out: list[PromptRecord] = []
        while len(out) < size:
            question, expression, answer = _problem(rng, self.config)
            if question in exclude:
                continue
            exclude.add(question)
            system = self.config.system_prompt.format(call=example_call(self.config.tool_format))
            demo = demonstration(self.config.tool_format) if self.config.demonstration else []
            prompt = [{"role": "system", "content": system}, *demo, {"role": "user", "content": question}]
            out.append(
                PromptRecord(
                    f"calc-{split}-s{self.config.seed}-{len(out)}",
                    prompt,
                    answer,
                    {"question": question, "expression": expression, "split": split},
                )
            )
        return out

    def start(self, record: PromptRecord) -> list[Message]:
        return [dict(m) for m in record.prompt]

    def solve(self, record: PromptRecord) -> list[Message] | None:
        """One `calc` call on the problem's expression, then the boxed result (`solved_turns`)."""
        expression = record.metadata.get("expression")
        return solved_turns(self.config.tool_format, expression) if expression else None

    def respond(self, episode: Episode, reply: str) -> Feedback:
        got = final_number(reply)
        ok = got is not None and str(got) == episode.record.answer
        episode.state["answer_given"] = got
        return Feedback(
            1.0 if ok else 0.0, True, correct=ok, reason="answered" if got is not None else "no_answer"
        )
