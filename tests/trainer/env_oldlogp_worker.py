"""tests/e2e/oldlogp_worker.py for environment runs: the test plugins registered first (episode_plugins.py).

python tests/trainer/env_oldlogp_worker.py OUT.json override ...     (or under torchrun)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.trainer.episode_plugins  # noqa: E402,F401  (registers test_graded_calc and test_hash_calls)
from tests.e2e.oldlogp_worker import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
