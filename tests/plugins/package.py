"""`guesspkg`: a user's plugin package, written by the tests into a folder outside the repository.

It holds what a user brings to RL post-training, each registered from its own module with mcore-rl's public
decorators, plus its yaml under its own `conf/` folder (found through `hydra.searchpath`):

- `guesspkg.envs`: `guess`, a single-turn Environment (questions whose answer is 7: the tiny model's task, so its
  rewards vary within groups, tests/e2e/sevens.py);
- `guesspkg.data`: data kind `words` (the same questions, from a loader with its own options dataclass);
- `guesspkg.rewards`: reward `has_seven` (a registered builder) and `score`, a plain function for `reward=function`;
- `guesspkg.algos`: algorithm `grpo_plugin`, GRPO with a config field of its own;
- `guesspkg.broken`: a module that raises on import.

Every module writes a marker file `<module>.<pid>` (holding the torchrun RANK, if any) into $GUESSPKG_MARKERS when it
is imported, so a test sees which processes imported it: each rank, the reward workers.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKERS_ENV = "GUESSPKG_MARKERS"

_MARK = '''
import os as _os
if _os.environ.get("GUESSPKG_MARKERS"):
    with open(_os.path.join(_os.environ["GUESSPKG_MARKERS"], f"{__name__}.{_os.getpid()}"), "w") as _f:
        _f.write(_os.environ.get("RANK", "-"))
'''

_QUESTIONS = '''
import re

SEVENS = [(a, 7 - a) for a in range(8)]


def question(i):
    a, b = SEVENS[i % len(SEVENS)]
    return f"What is {a} + {b}? Answer with just the number."


def last_number(text):
    found = re.findall(r"-?\\d+", text)
    return found[-1] if found else None
'''

_ENVS = _MARK + '''
from dataclasses import dataclass

from mcore_rl.data.records import PromptRecord
from mcore_rl.envs import ENVS, EnvConfig, Environment, Feedback

from guesspkg.questions import last_number, question


@dataclass
class GuessConfig(EnvConfig):
    target: str = "7"  # the answer every question has


@ENVS.register("guess")
class GuessEnv(Environment):
    """One turn: the reply's last number against the answer (1.0 or 0.0)."""

    config_cls = GuessConfig

    def records(self, split):
        n = self.config.size if split == "train" else self.config.heldout_size
        return [PromptRecord(f"guess-{split}-{i}", [{"role": "user", "content": question(i)}], self.config.target,
                             {"split": split}) for i in range(n)]

    def respond(self, episode, reply):
        ok = last_number(reply) == episode.record.answer
        return Feedback(1.0 if ok else 0.0, True, correct=ok, reason="answered")
'''

_DATA = _MARK + '''
from dataclasses import dataclass

from mcore_rl.data.records import LoadSummary, PromptRecord
from mcore_rl.data.registry import register_dataset

from guesspkg.questions import question


@dataclass
class WordsConfig:
    size: int = 64
    seed: int = 0


@register_dataset("words", WordsConfig)
def load_words(cfg):
    records = [PromptRecord(f"words-{cfg.seed}-{i}", [{"role": "user", "content": question(i + cfg.seed)}], "7")
               for i in range(cfg.size)]
    return records, LoadSummary("words", total_rows=cfg.size, loaded=cfg.size)
'''

_REWARDS = _MARK + '''
from mcore_rl.rewards.base import RewardResult
from mcore_rl.rewards.registry import register_reward

from guesspkg.questions import last_number


class HasSeven:
    def __init__(self, bonus):
        self.bonus = bonus

    def score(self, responses, answers):
        out = []
        for response, answer in zip(responses, answers):
            ok = last_number(response) == answer
            out.append(RewardResult(score=self.bonus if ok else 0.0, correct=ok, reason="ok" if ok else "wrong",
                                    extracted=last_number(response)))
        return out

    def close(self):
        pass


@register_reward("has_seven")
def build_has_seven(options):
    return HasSeven(float(options.get("bonus", 1.0)))


def score(response, answer, record):
    """For reward=function: runs in the reward workers."""
    return 1.0 if last_number(response) == answer else 0.0
'''

_ALGOS = _MARK + '''
from dataclasses import dataclass

from mcore_rl.algorithms import register_algorithm
from mcore_rl.algorithms.grpo import GRPO, GrpoConfig


@dataclass
class PluginGrpoConfig(GrpoConfig):
    name: str = "grpo_plugin"
    greeting: str = "hello"  # a key of the plugin's own, settable as algorithm.greeting=...


@register_algorithm("grpo_plugin")
class PluginGRPO(GRPO):
    config_cls = PluginGrpoConfig
'''

_BROKEN = _MARK + '''
raise RuntimeError("guesspkg.broken cannot start: no licence")
'''

YAML = {
    "env/guess.yaml": "name: guess\nsize: 64\nheldout_size: 8\nmax_turns: 1\nmax_new_tokens: 16\n"
                      "truncated_turn: close\n",  # a reply cut at max_new_tokens is judged too
    "data/words.yaml": "kind: words\nsize: 64\nsampler:\n  seed: 0\n  shuffle: true\n",
    "reward/has_seven.yaml": "name: has_seven\nhas_seven:\n  bonus: 1.0\n",
    "algorithm/grpo_plugin.yaml": "defaults:\n  - /schema/algorithm/grpo_plugin@_here_\n  - _self_\n\n"
                                  "name: grpo_plugin\nupdates_per_rollout: 1\nkl_coef: 0.0\n",
    # a yaml whose plugin is listed in a yaml: no schema line (the schema is stored only once the plugin loaded)
    "algorithm/grpo_plugin_untyped.yaml": "name: grpo_plugin\nupdates_per_rollout: 1\nkl_coef: 0.0\n"
                                          "greeting: from-yaml\n",
    # the user's own primary config (--config-dir conf --config-name guess_job): the plugin list in a yaml
    "guess_job.yaml": "defaults:\n  - config\n  - override algorithm: grpo_plugin_untyped\n"
                      "  - override data: words\n  - _self_\n\nplugins: [guesspkg.data, guesspkg.algos]\n",
}


def write_package(root: Path) -> Path:
    """Write guesspkg under `root` (the folder to put on PYTHONPATH); returns its conf folder."""
    pkg = root / "guesspkg"
    files = {"__init__.py": "", "questions.py": _QUESTIONS, "envs.py": _ENVS, "data.py": _DATA,
             "rewards.py": _REWARDS, "algos.py": _ALGOS, "broken.py": _BROKEN}
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text.lstrip())
    for rel, text in YAML.items():
        (pkg / "conf" / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / "conf" / rel).write_text(text)
    return pkg / "conf"


def markers(folder: Path, module: str) -> dict[int, str]:
    """pid -> RANK ('-' outside torchrun) of every process that imported `module`."""
    return {int(p.name.rsplit(".", 1)[1]): p.read_text() for p in folder.glob(f"{module}.*")
            if p.name.rsplit(".", 1)[1].isdigit()}


def plugin_env(root: Path, marker_dir: Path) -> dict[str, str]:
    """The environment a user's shell would have: the package folder on PYTHONPATH, markers on."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, MARKERS_ENV: str(marker_dir)}
