"""Runnable wrapper: `python tools/convert_ckpt/convert.py {hf-to-mcore,mcore-to-hf,verify} ...`.

Same as the installed `mcore-rl-convert` entry point; works from a source checkout without installing.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcore_rl.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
