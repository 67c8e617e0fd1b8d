"""Where the packaged Hydra configs live. Here, in the config layer, so that tools below the CLI (mcore-rl-eval's
`--rollout` / `--env` specs) find the same yamls as `mcore-rl-train` without importing it."""

from __future__ import annotations

import os


def config_dir() -> str:
    """The packaged configs (`mcore_rl/hydra_conf` in a wheel) or, in a source checkout, the repo's hydra_conf/.
    Users add their own config folders through Hydra's search path: `hydra.searchpath=[file:///my/confs]`."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mcore_rl/
    for path in (os.path.join(pkg, "hydra_conf"), os.path.join(os.path.dirname(pkg), "hydra_conf")):
        if os.path.isfile(os.path.join(path, "config.yaml")):
            return path
    raise SystemExit(f"mcore-rl: no hydra_conf/config.yaml next to {pkg}; reinstall the package")


CONFIG_DIR = config_dir()
