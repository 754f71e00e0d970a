"""The cache every decoder steps over (``medusa_train/backbone/appending_cache.py``): it holds exactly what
transformers' ``DynamicLayer`` holds through every edit a decoder or ``generate`` makes (appends of any length,
crops, a batch's rows selected, repeated, reordered, a reset), writes a sized room in place (no step copies the
cache), and a model decodes over it token for token and logit for logit as over a ``DynamicCache``."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from medusa_train.backbone.appending_cache import AppendingCache, AppendingLayer, plain_layers


def _states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def _same(a: DynamicLayer, b: AppendingLayer) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    if a.get_seq_length():
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("room", [0, 9, 64])
def test_an_appending_layer_holds_what_a_dynamic_one_holds_through_every_edit(room):
    rng = random.Random(room)
    for trial in range(12):
        plain, appending, batch = DynamicLayer(), AppendingLayer(room), 3
        for step in range(30):
            length = plain.get_seq_length()
            op = rng.choice(["append"] * 5 + ["crop", "select", "repeat", "reorder", "reset"])
            if op == "append" or length == 0:
                keys, values = _states(batch, rng.randint(1, 7), seed=1000 * trial + step)
                got, want = appending.update(keys, values), plain.update(keys, values)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            elif op == "crop":
                drop = rng.randint(0, length)
                plain.crop(-drop)
                appending.crop(-drop)
            elif op == "select" and batch > 1:
                keep = torch.tensor(sorted(rng.sample(range(batch), rng.randint(1, batch))))
                plain.batch_select_indices(keep)
                appending.batch_select_indices(keep)
                batch = len(keep)
            elif op == "repeat" and batch < 6:
                plain.batch_repeat_interleave(2)
                appending.batch_repeat_interleave(2)
                batch *= 2
            elif op == "reorder":
                order = torch.randperm(batch, generator=torch.Generator().manual_seed(step))
                plain.reorder_cache(order)
                appending.reorder_cache(order)
            elif op == "reset":
                plain.reset()
                appending.reset()
                assert appending.key_room is None
            _same(plain, appending)


def test_a_sized_room_is_written_in_place_and_doubles_when_outgrown():
    layer = AppendingLayer(room=20)
    layer.update(*_states(1, 5, seed=0))
    room = layer.key_room.data_ptr()
    for step in range(15):  # positions 6-20: every one into the same room
        keys, _ = layer.update(*_states(1, 1, seed=step + 1))
        assert layer.key_room.data_ptr() == room and keys.data_ptr() == room
    layer.crop(-3)  # 17 left: the next appends overwrite the dropped positions
    layer.update(*_states(1, 3, seed=99))
    assert layer.key_room.data_ptr() == room and layer.get_seq_length() == 20
    before = layer.keys.clone()
    layer.update(*_states(1, 1, seed=100))  # the 21st position: a room twice as long, the filled part moved
    assert layer.key_room.data_ptr() != room and layer.key_room.shape[2] == 40
    assert torch.equal(layer.keys[:, :, :20], before)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_model_decodes_over_it_as_over_a_dynamic_cache(arch, one_thread):
    backbone = make_tiny_backbone(arch, seed=2)
    assert plain_layers(backbone)
    ids = torch.randint(0, backbone.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # prefill, a 1-token step and a 3-token step with an explicit mask: every logit alike
        caches = [DynamicCache(), AppendingCache(room=32)]
        logits = [[backbone(ids, past_key_values=c, use_cache=True).logits] for c in caches]
        for c, seen in zip(caches, logits):
            seen.append(backbone(ids[:, :1], past_key_values=c, use_cache=True).logits)
            mask = torch.zeros(1, 1, 3, 15)
            seen.append(backbone(ids[:, 1:4], attention_mask=mask, position_ids=torch.arange(12, 15)[None],
                                 past_key_values=c, use_cache=True).logits)
        assert all(torch.equal(a, b) for a, b in zip(*logits))
    for lookup in ({}, {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2}):  # lookup crops the cache
        settings = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids), **lookup)
        want = backbone.generate(ids, **settings)
        got = backbone.generate(ids, past_key_values=AppendingCache(room=ids.shape[1] + 30), **settings)
        assert torch.equal(got, want)


def test_every_decoder_steps_over_it_and_decodes_what_hf_generate_does_over_its_own(one_thread):
    """HF ``generate`` (``plain_generate``, with and without prompt lookup) and our tree decoder each hand the model an
    ``AppendingCache`` on every pass, and give the tokens HF ``generate`` gives over transformers' own cache."""
    from helpers.decoding import hf_greedy, install_oracle_heads

    from medusa_train import MedusaModel
    from medusa_train.backbone.generation import plain_generate
    from medusa_train.decoding import tree_generate

    backbone = make_tiny_backbone("llama", seed=5)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    want = hf_greedy(backbone, ids, 30, [])[0, ids.shape[1]:].tolist()
    seen = []
    hook = backbone.get_decoder().register_forward_pre_hook(  # what generate and our decoder both call
        lambda module, args, kwargs: seen.append(type(kwargs.get("past_key_values"))), with_kwargs=True)
    try:
        for lookup in (None, (3, 2)):
            got, timing = plain_generate(backbone, ids, 30, [], 0, prompt_lookup=lookup)
            assert got == want and timing["forwards"] == len(seen)
            assert set(seen) == {AppendingCache}, seen
            seen.clear()
        model = MedusaModel.from_backbone(backbone, num_heads=4).eval()
        install_oracle_heads(model, torch.cat([ids, torch.tensor([want])], dim=1))  # one pass, no cache
        seen.clear()
        out = tree_generate(model, ids, "default", max_new_tokens=30, eos_token_id=[])
    finally:
        hook.remove()
    assert out.sequences[0, ids.shape[1]:].tolist() == want and out.steps < 30  # the oracle's guesses were taken
    assert set(seen) == {AppendingCache} and len(seen) > out.steps, seen
