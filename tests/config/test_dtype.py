"""One dtype vocabulary (``medusa_train/config/dtype.py``) for every command: each takes the short spellings
(``bf16``), stores the canonical name (what the loader, vLLM's ``--dtype``, the run records and the folders keyed
by settings see) and refuses anything else with one message that names the key."""

import importlib
import re

import pytest
import torch

from medusa_train.cli.main import COMMANDS
from medusa_train.config.check import ConfigError, parse_config
from medusa_train.config.dtype import canonical_dtype, torch_dtype

RULE = "must be one of float32, bfloat16, float16 (or fp32, bf16, fp16)"
DEMO_RULE = "must be one of auto, float32, bfloat16 (or fp32, bf16)"


def _train():
    from medusa_train.config.train import TrainConfig, check
    return TrainConfig, check, ("model.dtype", "model.bnb_compute_dtype"), {}


# command -> () -> (config class, the check its command runs on the values alone, its dtype keys, the other keys
# it needs to pass); choose-k's schema is its own module
ROWS = {
    "train": _train,
    "capture": _train,  # the training command's config
    "distill": lambda: (*_classes("distill", "DistillConfig", "check_distill_config"),
                        ("model.dtype", "model.bnb_compute_dtype"), {}),
    "build-tree": lambda: (*_classes("build_tree", "BuildTreeConfig", "check_build_tree_config"), ("model.dtype",),
                           {"heads": "h"}),
    "evaluate": lambda: (*_classes("evaluate", "EvalConfig", "check_eval_config"), ("model.dtype",), {"heads": "h"}),
    "export": lambda: (*_classes("export", "ExportConfig", "check_export_config"), ("dtype",),
                       {"heads": "h", "format": "vllm", "output": "o"}),
    "choose-k": lambda: (*_classes("choose_k", "ChooseKConfig", "check_choose_k_config"), ("dtype",), {"heads": "h"}),
    "demo": lambda: (*_classes("demo", "DemoConfig", "check_demo_config"),
                     ("distill.dtype", "train.dtype", "eval.dtype"), {}),
}


def _classes(module: str, config: str, check: str):
    found = importlib.import_module(f"medusa_train.config.{module}")
    return getattr(found, config), getattr(found, check)


def _raw(base: dict, key: str, value) -> dict:
    raw = {**base}
    *sections, last = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    return raw


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def test_every_command_says_which_dtype_keys_it_takes():
    assert set(COMMANDS) <= set(ROWS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("given, stored", [("bf16", "bfloat16"), ("fp32", "float32"), ("bfloat16", "bfloat16")])
def test_every_command_takes_the_short_spellings_and_stores_the_canonical_name(command, given, stored):
    cls, check, keys, base = ROWS[command]()
    for key in keys:
        config = parse_config(cls, _raw(base, key, given), check)
        assert _get(config, key) == stored, key


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_refuses_a_dtype_outside_the_vocabulary_with_one_message(command):
    cls, check, keys, base = ROWS[command]()
    for key in keys:
        with pytest.raises(ConfigError) as refused:
            parse_config(cls, _raw(base, key, "bf17"), check)
        assert f"{key}='bf17': {DEMO_RULE if command == 'demo' else RULE}" in refused.value.problems, key


def test_the_demo_takes_auto_and_leaves_float16_to_the_commands():
    cls, check, keys, _ = ROWS["demo"]()
    config = parse_config(cls, {"train": {"dtype": "auto"}, "eval": {"dtype": "bf16"}}, check)
    assert (config.train.dtype, config.eval.dtype) == ("auto", "bfloat16")
    with pytest.raises(ConfigError, match=re.escape(f"train.dtype='fp16': {DEMO_RULE}")):
        parse_config(cls, {"train": {"dtype": "fp16"}}, check)


def test_a_null_dtype_stays_null_where_it_means_a_default():
    cls, check, _, base = ROWS["export"]()
    assert parse_config(cls, base, check).dtype is None
    cls, check, _, _ = _train()
    assert parse_config(cls, {}, check).model.bnb_compute_dtype is None


def test_torch_dtype_takes_every_spelling_and_names_the_value_it_refuses():
    assert torch_dtype("bf16") is torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("fp16") is torch.float16 and torch_dtype(torch.float32) is torch.float32
    assert canonical_dtype(torch.bfloat16) == "bfloat16" and canonical_dtype("auto") is None
    with pytest.raises(ValueError, match=re.escape(f"dtype='bf17': {RULE}")):
        torch_dtype("bf17")
