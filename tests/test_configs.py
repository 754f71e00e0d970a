"""Every default is written once: in the config dataclasses. The YAML under configs/ adds nothing to them
(each command composes to exactly its dataclass defaults) and every preset sets only keys it changes."""

import dataclasses

import pytest
import yaml

from medusa_train.config.build_tree import BuildTreeConfig
from medusa_train.config.check import parse_config
from medusa_train.config.choose_k import ChooseKConfig
from medusa_train.config.compose import compose_config
from medusa_train.config.demo import DemoConfig, build_demo_config
from medusa_train.config.distill import DistillConfig, build_distill_config
from medusa_train.config.evaluate import EvalConfig, default_output_dir
from medusa_train.config.export import ExportConfig
from medusa_train.config.paths import CONFIG_DIR
from medusa_train.config.train import LoggerConfig, TrainConfig, build_config


def no_checks(cls):
    return lambda raw: parse_config(cls, raw, lambda c: [])


@pytest.mark.parametrize("name, build, expected", [
    ("train", build_config, TrainConfig()),
    ("distill", build_distill_config, DistillConfig()),
    ("build_tree", no_checks(BuildTreeConfig), BuildTreeConfig(heads="h")),
    ("export", no_checks(ExportConfig), ExportConfig()),
    ("demo", build_demo_config, DemoConfig()),
    ("choose_k", no_checks(ChooseKConfig), ChooseKConfig()),
])
def test_a_command_with_no_overrides_composes_exactly_its_dataclass_defaults(name, build, expected):
    overrides = ["heads=h"] if name == "build_tree" else []
    assert build(compose_config(name, overrides)) == expected


def test_evaluate_adds_only_its_derived_output_folder():
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("default_output_dir", default_output_dir, replace=True)
    composed = no_checks(EvalConfig)(compose_config("evaluate", ["heads=/runs/a/export"]))
    assert composed == dataclasses.replace(EvalConfig(), heads="/runs/a/export", output_dir=default_output_dir("/runs/a/export"))


def flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def preset_files() -> list:
    return sorted(p for group in ("recipe", "data", "model", "debug", "experiment", "logger")
                  for p in (CONFIG_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("path", preset_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_preset_sets_only_what_it_changes(path):
    """No key of a preset repeats the value it already has where the preset applies: the defaults, or the preset it
    builds on (experiment=served over experiment=demo)."""
    text = path.read_text()
    node = yaml.safe_load(text) or {}
    base = flat(dataclasses.asdict(TrainConfig()))
    for parent in node.pop("defaults", []):
        if isinstance(parent, str) and not parent.startswith(("/", "_")):  # another preset of the same group
            base.update(flat(yaml.safe_load((path.parent / f"{parent}.yaml").read_text())))
    package = "" if "@package _global_" in text else f"{path.parent.name}."
    if path.parent.name == "logger":
        base = flat({"logger": dataclasses.asdict(LoggerConfig())})
    named = {"method"} if path.parent.name == "recipe" else set()  # a recipe names its method, the default's too
    repeated = [key for key, value in flat(node, package).items()
                if key in base and base[key] == value and key not in named]
    assert repeated == [], f"{path.name} repeats what is already so: {repeated}"


def test_command_yaml_holds_no_key_of_its_own_but_derived_ones():
    """configs/commands/*.yaml: the defaults node, Hydra's settings and a value derived from others only."""
    for path in sorted((CONFIG_DIR / "commands").glob("*.yaml")):
        keys = set(yaml.safe_load(path.read_text())) - {"defaults", "hydra"}
        assert keys <= ({"output_dir"} if path.stem == "evaluate" else set()), (path.name, keys)
