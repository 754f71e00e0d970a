"""``model.attn_implementation=flash_attention_2``: allowed for training, distillation and capture where it runs,
refused with the way out where it does not, and refused by evaluation and build-tree, whose tree decoder
attends through a 4D mask flash attention does not take."""

from __future__ import annotations

import pytest
from helpers.training import compose_config

from medusa_train.cli.build_tree import build_build_tree_config
from medusa_train.cli.evaluate import build_eval_config
from medusa_train.config.check import ConfigError
from medusa_train.config.distill import build_distill_config
from medusa_train.config.model import ModelConfig, check_model, flash_attention_available

KEY = "model.attn_implementation='flash_attention_2'"


@pytest.mark.skipif(flash_attention_available("flash_attention_2"), reason="flash-attn is installed here")
@pytest.mark.parametrize("recipe", ["medusa1", "medusa2"])
def test_training_and_capture_without_flash_attn_say_how_to_fix(recipe):
    # capture (scripts/capture.py) runs on the training command's own config
    with pytest.raises(ConfigError) as err:
        compose_config(["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16"], recipe=recipe)
    (line,) = [line for line in str(err.value).splitlines() if KEY in line]
    assert "pip install flash-attn" in line and "model.attn_implementation=sdpa" in line


@pytest.mark.skipif(flash_attention_available("flash_attention_2"), reason="flash-attn is installed here")
def test_distillation_without_flash_attn_says_how_to_fix():
    with pytest.raises(ConfigError, match=r"flash_attention_2'.*pip install flash-attn.*attn_implementation=sdpa"):
        build_distill_config({"model": {"attn_implementation": "flash_attention_2", "dtype": "bfloat16"}})


def test_flash_attention_is_a_known_choice_and_needs_half_precision():
    problems = check_model(ModelConfig(attn_implementation="flash_attention_2", dtype="float32"))
    assert not any("must be sdpa" in p for p in problems)  # a known value: what is missing is said instead
    assert any("bfloat16 or float16 only" in p and "model.dtype=bfloat16" in p for p in problems)
    assert check_model(ModelConfig(attn_implementation="sdpa")) == []
    assert any("must be sdpa, eager, flash_attention_2, flash_attention_3 or null" in p
               for p in check_model(ModelConfig(attn_implementation="flash")))


@pytest.mark.skipif(not flash_attention_available("flash_attention_2"), reason="flash-attn not installed (CUDA)")
def test_training_accepts_flash_attention_where_it_is_installed():
    cfg = compose_config(["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16"])
    assert cfg.model.attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("build", [build_eval_config, build_build_tree_config], ids=["evaluate", "build-tree"])
@pytest.mark.parametrize("kernel", ["flash_attention_2", "flash_attention_3"])
def test_tree_decoding_commands_refuse_flash_attention_for_the_4d_mask(build, kernel, tmp_path):
    with pytest.raises(ConfigError) as err:
        build({"heads": str(tmp_path), "model": {"attn_implementation": kernel}})
    (line,) = [line for line in str(err.value).splitlines() if f"model.attn_implementation='{kernel}'" in line]
    assert "4D" in line and "model.attn_implementation=sdpa" in line
