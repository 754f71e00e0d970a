"""A backbone without its decoder layers: only what the heads read outside its forward.

Training on captured hidden states never runs the backbone, yet the heads read its embeddings (the
next token's) and LM head (shared, or to start their own output layers from). Loading just those, a
70B backbone costs each process 2 x 1 GB instead of 140 GB. The model is built on the meta device
(no memory) from its config and only the tensors outside the decoder layers are read from its
safetensors (for a hub id, only the shard files that hold them are downloaded); the layers stay
on the meta device, so running the backbone fails loudly instead of computing anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel


def decoder_layers(backbone: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of the classes the backbone names as never split across devices (its decoder layers)."""
    names = set(getattr(backbone, "_no_split_modules", None) or [])
    return [m for m in backbone.modules() if type(m).__name__ in names]


def load_without_layers(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "bfloat16",
                        device: torch.device | str = "cpu", trust_remote_code: bool = False) -> PreTrainedModel | None:
    """The backbone with its embeddings, final norm and LM head on ``device`` and its decoder layers on the meta
    device; ``None`` when the checkpoint's tensor names do not match the model's (load it whole instead)."""
    from safetensors import safe_open

    from medusa_train.backbone.load import resolve_dtype, resolve_model_path

    path, _ = resolve_model_path(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    model = empty_backbone(name_or_path, torch_dtype, trust_remote_code)
    layers = decoder_layers(model)
    if not layers:
        return None
    inside = {id(p) for layer in layers for p in layer.parameters()}
    wanted = [(name, p) for name, p in model.named_parameters(remove_duplicate=False) if id(p) not in inside]
    files = _files_holding(path, [name for name, _ in wanted])
    if files is None:
        return None
    loaded: dict[int, torch.nn.Parameter] = {}  # tied weights: one tensor, several names
    for file in set(files.values()):  # each file opened once
        with safe_open(file, "pt", device="cpu") as f:
            for name, param in wanted:
                if files.get(name) == file and id(param) not in loaded:
                    loaded[id(param)] = torch.nn.Parameter(f.get_tensor(name).to(device=device, dtype=torch_dtype),
                                                           requires_grad=False)
    for name, param in wanted:
        if id(param) in loaded:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = loaded[id(param)]
    if any(p.is_meta for _, p in wanted if id(p) not in loaded):
        return None  # a tensor outside the layers the checkpoint does not name as the model does
    place_buffers(model, dict(model.named_buffers()), device)  # (rotary frequencies); .to() refuses the meta layers
    return model


def empty_backbone(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "bfloat16",
                   trust_remote_code: bool = False, attn_implementation: str | None = None,
                   pad_token_id: int | None = None) -> PreTrainedModel:
    """The backbone's modules without its weights: every parameter on the meta device (no memory), buffers
    computed as a load computes them (rotary frequencies). For the processes that receive the weights from
    process 0 instead of reading the checkpoint (``training/shard.py``)."""
    from accelerate import init_empty_weights

    from medusa_train.backbone.load import resolve_dtype, resolve_model_path

    path, _ = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code,
                                                 **extra)
    model.tie_weights()  # as a load ties them (from_config alone leaves tied weights apart)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    model.eval().requires_grad_(False)
    model.name_or_path = str(name_or_path)
    return model


def place_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor], device: torch.device | str) -> None:
    """Set each of ``model``'s buffers named in ``buffers`` to that tensor on ``device``, without touching its
    parameters (``Module.to`` would, and refuses meta ones)."""
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)


def _files_holding(path: str, names: list[str]) -> dict[str, str] | None:
    """``{tensor name: local safetensors file}`` for ``names`` (only those files fetched from the hub)."""
    folder = Path(path)
    index_name, single = "model.safetensors.index.json", "model.safetensors"

    def local(file: str) -> str | None:
        if folder.is_dir():
            return str(folder / file) if (folder / file).is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(path, file)
        except EntryNotFoundError:
            return None

    index = local(index_name)
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        needed = {weight_map[n] for n in names if n in weight_map}
        paths = {file: local(file) for file in needed}
        return {n: paths[weight_map[n]] for n in names if n in weight_map}
    whole = local(single)
    if whole is None:
        return None
    from safetensors import safe_open

    with safe_open(whole, "pt", device="cpu") as f:
        stored = set(f.keys())
    return {n: whole for n in names if n in stored}
