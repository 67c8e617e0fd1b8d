"""Only what pyproject.toml cannot say: ship the top-level hydra_conf/ folder as `mcore_rl.hydra_conf`.

Why a mapping instead of moving the folder: hydra_conf/ stays where users and docs expect it in a checkout,
while a wheel (non-editable install) carries the configs inside the package, where mcore_rl.train finds them.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["mcore_rl", "mcore_rl.*"]), "mcore_rl.hydra_conf"],
    package_dir={"mcore_rl.hydra_conf": "hydra_conf"},
    package_data={"mcore_rl": ["py.typed"], "mcore_rl.hydra_conf": ["*.yaml", "**/*.yaml"]},
)
