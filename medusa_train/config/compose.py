"""The training config as the train command composes it, from inside another command (the demo).

``compose_training(["+recipe=medusa1", "experiment=demo", ...])`` returns exactly what
``medusa-train train +recipe=medusa1 experiment=demo ...`` would run with (``configs/train.yaml``, its
groups, the presets), resolved to plain values; a bad override raises ``ConfigError`` naming it.
It works inside a running Hydra app too: that app's Hydra is set aside and restored afterwards.
"""

from __future__ import annotations

from medusa_train.config.check import ConfigError
from medusa_train.config.paths import CONFIG_DIR


def compose_training(overrides: list[str]) -> dict:
    """``configs/train.yaml`` composed with ``overrides``, resolved (``${method}`` and the like filled in).

    Raises:
        ConfigError: an override Hydra cannot apply (an unknown key or group option, a malformed value).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    outer = get_gh_backup()  # the calling command's own Hydra, if it is one
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return OmegaConf.to_container(compose("train", list(overrides)), resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError([f"training overrides {' '.join(overrides)}: {str(err).splitlines()[0]}"]) from err
    finally:
        restore_gh_from_backup(outer)
