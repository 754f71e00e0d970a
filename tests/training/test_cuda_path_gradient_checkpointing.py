"""Medusa-2's ``peft.gradient_checkpointing``: on by default, the backbone's layers really recompute in the
backward pass, and a joint step's loss and gradients equal those without it (LoRA dropout included: the
recomputation replays the same dropout masks)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers.backbones import PACKAGED_MODEL
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, train_overrides
from torch.utils.data import DataLoader

from medusa_train.families.medusa.recipe_medusa2 import Medusa2Recipe

compose_medusa2 = partial(compose_config, recipe="medusa2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gc")
    return make_model_dir(root / "model"), make_chat_jsonl(root / "chat.jsonl", n=24)


def _recipe(model_dir, data, out, checkpointing: bool, **extra) -> Medusa2Recipe:
    values = {"peft.r": 4, "peft.alpha": 8, "peft.dropout": 0.1, "loss.head_warmup_steps": 0,
              "trainer.merge_export": "false", "trainer.eval_every": 0, "trainer.save_every": 0,
              "peft.gradient_checkpointing": str(checkpointing).lower(), **extra}
    recipe = Medusa2Recipe(compose_medusa2(train_overrides(model_dir, data, out, **values)))
    recipe.setup()
    gen = torch.Generator().manual_seed(0)  # LoRA B starts at zero: give every LoRA weight a gradient
    with torch.no_grad():
        for name, p in recipe.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return recipe


def _layers(recipe):
    return recipe.peft_model.get_base_model().get_decoder().layers


def _layer_forwards(recipe) -> list[int]:
    """A counter of decoder-layer runs, taken as each layer's attention starts: the checkpoint wraps the layer's
    ``forward`` (its own hooks miss the recomputation) and stops recomputing once it has what backward needs."""
    calls = [0]
    for layer in _layers(recipe):
        layer.self_attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _step(recipe, batch_size: int = 4):
    loader = DataLoader(recipe.run.data.train, batch_sampler=[list(range(batch_size))],
                        collate_fn=recipe.run.data.collator)
    batch = next(iter(loader))
    calls = _layer_forwards(recipe)
    torch.manual_seed(1234)  # the same LoRA dropout masks in both runs
    result = recipe.micro_step(batch, loss_scale=1.0)
    grads = {n: p.grad.clone() for n, p in recipe.run.parameters.items() if p.grad is not None}
    return result, grads, calls[0]


def _compare(on_recipe, off_recipe, rtol: float, atol: float, batch_size: int = 4):
    assert all(layer.gradient_checkpointing for layer in _layers(on_recipe))
    assert not any(layer.gradient_checkpointing for layer in _layers(off_recipe))
    (on, on_grads, on_calls), (off, off_grads, off_calls) = _step(on_recipe, batch_size), _step(off_recipe, batch_size)
    layers = len(_layers(on_recipe))
    assert on_calls == off_calls + layers  # each layer ran again in the backward pass: it kept no activations
    assert float(on.loss) == pytest.approx(float(off.loss), rel=rtol, abs=atol)
    assert sorted(on_grads) == sorted(off_grads) and any(".lora_A" in n for n in on_grads)
    for name in on_grads:
        torch.testing.assert_close(on_grads[name], off_grads[name], rtol=rtol, atol=atol, msg=name)


def test_the_key_defaults_on():
    assert compose_medusa2([]).peft.gradient_checkpointing is True


def test_checkpointing_recomputes_the_layers_and_changes_no_gradient(tiny, tmp_path):
    model_dir, data = tiny
    recipes = [_recipe(model_dir, data, tmp_path / str(flag), flag) for flag in (True, False)]
    _compare(*recipes, rtol=1e-5, atol=1e-7)
    for recipe in recipes:
        recipe.cleanup()


@pytest.mark.slow
def test_on_the_packaged_4bit_model_checkpointing_changes_no_gradient(tiny, tmp_path):
    _, data = tiny
    extra = {"model.dtype": "bfloat16", "data.max_length": 64, "heads.num_heads": 2}
    recipes = [_recipe(PACKAGED_MODEL, data, tmp_path / str(flag), flag, **extra) for flag in (True, False)]
    assert recipes[0].cfg.model.quantization == "nf4"
    _compare(*recipes, rtol=1e-4, atol=1e-6, batch_size=2)  # 4-bit layers are slow on a CPU: two examples
    for recipe in recipes:
        recipe.cleanup()
