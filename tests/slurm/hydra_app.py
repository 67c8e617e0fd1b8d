"""Tiny Hydra app for the submitit launcher test, used until `mcore_rl.train` exists.

Its primary config lives in the ConfigStore, and the repo's hydra_conf/ is on the search path (passed as
`hydra.searchpath=[file://...]`), so `hydra/launcher=slurm` composes our launcher config. Each job records
where it ran (Slurm ids, host) in its own output dir and returns `2 * x`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

ConfigStore.instance().store(name="tiny_app", node={"x": 1, "tag": "none"})


@hydra.main(version_base="1.3", config_path=None, config_name="tiny_app")
def main(cfg: DictConfig) -> int:
    out = Path(HydraConfig.get().runtime.output_dir)
    record = {
        "x": cfg.x,
        "tag": cfg.tag,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "array_job_id": os.environ.get("SLURM_ARRAY_JOB_ID"),
        "array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "host": socket.gethostname(),
        "launcher": HydraConfig.get().launcher._target_,
        "mem_gb": HydraConfig.get().launcher.mem_gb,
    }
    (out / "result.json").write_text(json.dumps(record))
    return 2 * int(cfg.x)


if __name__ == "__main__":
    main()
