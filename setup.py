"""Only what pyproject.toml cannot say: ship the top-level hydra_conf/ folder as `mcore_rl.hydra_conf`.

Why a mapping instead of moving the folder: hydra_conf/ stays where users and docs expect it in a checkout,
while a wheel (non-editable install) carries the configs inside the package, where mcore_rl.train finds them.
Each config group folder is listed as a (data-only) package: setuptools warns about, and will stop
installing, folders inside a package that are not declared.
"""

from pathlib import Path

from setuptools import find_packages, setup

CONF = Path(__file__).resolve().parent / "hydra_conf"
conf_packages = ["mcore_rl.hydra_conf"] + [
    "mcore_rl.hydra_conf." + ".".join(p.relative_to(CONF).parts) for p in sorted(CONF.rglob("*")) if p.is_dir()
]

setup(
    packages=[*find_packages(include=["mcore_rl", "mcore_rl.*"]), *conf_packages],
    package_dir={"mcore_rl.hydra_conf": "hydra_conf"},
    package_data={"mcore_rl": ["py.typed"], **{pkg: ["*.yaml"] for pkg in conf_packages}},
)
