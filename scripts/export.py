"""Convert Medusa heads to another checkpoint layout.

    python scripts/export.py heads=<heads dir> format=native|medusa_v1|vllm output=<dir>
    python scripts/export.py heads=out/run/export format=medusa_v1 output=out/medusa lm_head_pt=true
    python scripts/export.py --help

The heads may be in any layout ``MedusaModel.from_pretrained`` reads. Options are in
``configs/export.yaml``; the work is ``medusa_train.model.export.export_folder``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

CONFIG_FILE = Path(__file__).resolve().parents[1] / "configs" / "export.yaml"
# Registered by name rather than found through configs/: there ``heads`` and ``model`` are config
# groups of the training config, and Hydra would read ``heads=<dir>`` as a group choice.
ConfigStore.instance().store(name="export", node=OmegaConf.load(CONFIG_FILE))


@hydra.main(config_path=None, config_name="export", version_base="1.3")
def main(cfg) -> None:
    """Validate every option, then convert (errors exit with status 2 and name the option)."""
    options = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    from medusa_train.model.export import export_folder, option_problems

    problems = [f"{key}=???: required" for key in ("heads", "format", "output") if options[key] == "???"]
    fmt = None if options["format"] == "???" else options["format"]
    problems += option_problems(fmt, options["lm_head_pt"], options["max_paths"], options["topk"])
    if problems:
        print("cannot export heads: " + "; ".join(problems), file=sys.stderr)
        sys.exit(2)

    try:
        path = export_folder(**options)
    except (ValueError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(f"wrote {options['format']} heads from {options['heads']} to {path}")


if __name__ == "__main__":
    main()
