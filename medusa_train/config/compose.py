"""Every default written once: the config dataclasses, registered with Hydra; YAML holds only presets over them.

``register_defaults()`` stores each command's dataclass defaults in Hydra's ConfigStore (``train_defaults``,
``distill_defaults``, ...): a command's YAML lists its node first in ``defaults:`` and sets only what differs
(interpolations such as ``outputs/${method}``, Hydra's own settings), and the config groups (``data=sharegpt``,
``debug=smoke``, ``experiment=demo``, the recipes) are overlays that name only what they change. The nodes are
plain mappings, not typed structured configs: the dataclasses' own parser (``config.check.parse_config``) checks
types and ranges, and some fields are unions OmegaConf cannot type (``peft.target_modules: str | list[str]``).

``compose_config(name, overrides)`` composes a command's config as its command line would (tests, benchmarks,
the demo); ``compose_training(overrides)`` is the train command's, resolved to plain values. Both work inside a
running Hydra app too: that app's Hydra is set aside and restored afterwards.
"""

from __future__ import annotations

import dataclasses

from medusa_train.config.check import ConfigError
from medusa_train.config.paths import COMMANDS_DIR, CONFIG_DIR


def defaults_nodes() -> dict[str, dict]:
    """ConfigStore name -> the defaults it holds (a dataclass instance's fields, as plain values)."""
    from medusa_train.config.commands import COMMANDS
    from medusa_train.config.train import LoggerConfig

    schemas = {c.config: c.schema_class() for c in COMMANDS.values() if c.schema}
    schemas["logger"] = LoggerConfig  # the logger=wandb group's node
    return {f"{name}_defaults": dataclasses.asdict(cls()) for name, cls in schemas.items()}


def register_defaults() -> None:
    """Store every command's defaults in Hydra's ConfigStore (idempotent): before any config is composed."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, node in defaults_nodes().items():
        store.store(name=name, node=node)


def compose_config(name: str, overrides: list[str] = ()):
    """The ``DictConfig`` command ``name`` (train, distill, evaluate, build_tree, export, demo, choose_k) composes with
    ``overrides``, unresolved (a command registers its own resolvers).

    Raises:
        ConfigError: an override Hydra cannot apply (an unknown key or group option, a malformed value).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf.errors import OmegaConfBaseException

    register_defaults()
    outer = get_gh_backup()  # the calling command's own Hydra, if it is one
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR if name == "train" else COMMANDS_DIR), version_base="1.3"):
            return compose(name, list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError([f"{name} overrides {' '.join(overrides)}: {str(err).splitlines()[0]}"]) from err
    finally:
        restore_gh_from_backup(outer)


def compose_training(overrides: list[str]) -> dict:
    """``configs/train.yaml`` composed with ``overrides`` as ``medusa-train train`` would run it, resolved
    (``${method}`` and the like filled in)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_config("train", overrides), resolve=True)
