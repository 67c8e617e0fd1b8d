"""The calculator demo preset (`--config-name calculator_demo`, README) is the main job with the calculator
environment: it composes, validates, and the CLI reads it."""

from __future__ import annotations

import subprocess
import sys

import yaml

from mcore_rl.config import validate
from tests.config.keyscan import REPO, compose


def test_calculator_demo_preset_is_the_main_job_with_the_environment():
    demo, main = compose([], config_name="calculator_demo"), compose([])
    validate(demo)
    assert demo.env.name == "calculator" and demo.env.operations == 2 and demo.trainer.steps == 20
    assert demo.model == main.model and demo.algorithm == main.algorithm  # SmolLM2, the main job's GRPO
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.train", "--config-name", "calculator_demo", "--cfg", "job",
                           "trainer.steps=12"], capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = yaml.safe_load(proc.stdout)
    assert (job["env"]["name"], job["env"]["max_turns"], job["trainer"]["steps"]) == ("calculator", 3, 12)
