"""Which packages the wheel holds: the code, and the top-level ``configs/`` as ``medusa_train/configs``.

Everything else is in pyproject.toml. The repository keeps ``configs/`` at its top level, where Hydra
users look for it; the wheel carries the same files as package data so an installed medusa_train
composes its configs and finds the built-in trees wherever it runs (``medusa_train/config/paths.py``).
An editable install (``pip install -e .``) reads ``configs/`` of the checkout. Every folder below
``configs/`` is listed as a package so that setuptools ships its YAML without warnings.
"""

from setuptools import find_namespace_packages, find_packages, setup

CONFIGS = "medusa_train.configs"
config_packages = [CONFIGS, *(f"{CONFIGS}.{name}" for name in find_namespace_packages("configs"))]

setup(
    packages=[*find_packages(include=["medusa_train", "medusa_train.*"]), *config_packages],
    package_dir={CONFIGS: "configs"},
    package_data={**{name: ["*.yaml"] for name in config_packages},
                  "medusa_train.backbone": ["*.cpp"]},  # the row kernel and the step attention, compiled where they run
)
