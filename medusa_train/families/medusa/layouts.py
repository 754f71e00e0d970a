"""The on-disk layouts of Medusa heads, and one reader for all of them.

Three layouts are known; which one a folder holds is read from its ``config.json``, never
guessed from a model name:

``native``
    ``config.json`` (``"format": "medusa_train"``, the fields of ``MedusaConfig``) and
    ``model.safetensors`` with ``heads.{h}.blocks.{l}.linear.weight|bias`` and
    ``heads.{h}.lm_head.weight`` (absent when the heads share the backbone's LM head); heads
    with ``next_token_input`` also have ``heads.{h}.blocks.0.token.weight`` (native only), of
    shape (hidden, hidden), or (hidden, (h + 1) * hidden) with ``path_input``. Heads with
    ``prefix_attention`` also have the layer they read through, ``prefix.*`` (native only). Heads
    with a draft vocabulary of K tokens have ``token_map`` (K,) int64 and output layers of K rows.
``medusa_v1``
    The original Medusa (FasterDecoding) / TensorRT-LLM layout: ``config.json`` with
    ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``; tensors
    ``{h}.{l}.linear.weight|bias`` and ``{h}.{num_layers}.weight`` (each head's output layer)
    in ``medusa_lm_head.safetensors`` (or, when only that exists, ``medusa_lm_head.pt``).
    The layout cannot say "shared LM head": every head carries its own output layer.
``vllm``
    vLLM's Medusa draft model: ``config.json`` with ``model_type: "medusa"``, ``num_heads``,
    ``num_hidden_layers`` (ResBlocks per head), ``hidden_size``, ``vocab_size``, …; tensors
    ``blocks.{h}.layers.{l}.weight|bias`` and ``lm_heads.{h}.weight`` in ``model.safetensors``,
    or one ``lm_head.weight`` for every head when ``original_lm_head`` is true. ResBlocks
    without bias (``medusa_fc_bias`` false, vLLM's default) read as a zero bias. A draft
    vocabulary is ``truncated_vocab_size`` (K) < ``vocab_size`` with a ``token_map`` (K,) tensor;
    the output layers then have K rows (vLLM also slices full-size ones; this reader wants K). The
    writer never emits one: vLLM 0.32 refuses every folder with a ``token_map`` at load (it makes it
    a parameter and never reports it loaded), so heads with a draft vocabulary that share the LM head
    are written with the whole LM head, and those with their own output layers are refused.

Every reader is strict: a missing tensor, an unexpected one or a wrong shape is an error that
names the tensor in the layout's own key scheme. Writers live in ``export.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from medusa_train.families.medusa.config import MedusaConfig
from medusa_train.model.files import CONFIG_NAME, WEIGHTS_NAME, check_tensors, read_config_json

LAYOUTS = ("native", "medusa_v1", "vllm")
MEDUSA_V1_WEIGHTS_NAME = "medusa_lm_head.safetensors"
MEDUSA_V1_PT_NAME = "medusa_lm_head.pt"
VLLM_WEIGHTS_NAME = "model.safetensors"
MEDUSA_FILES = (MEDUSA_V1_WEIGHTS_NAME, MEDUSA_V1_PT_NAME)  #: what its layouts write besides the files every family's do
# vLLM heads saved with ``original_lm_head`` carry one copy of the shared LM head; ``read_heads``
# returns it under this key so the loader can check it against the backbone's own.
SHARED_LM_HEAD_KEY = "lm_head.weight"
# Heads with a draft vocabulary (``MedusaConfig.draft_vocab_size``) store its token ids under this key, in
# the native layout and in vLLM's (which reads it with ``truncated_vocab_size``).
TOKEN_MAP_KEY = "token_map"
# Native name prefixes of what medusa-train adds to a backbone (every other parameter is the backbone's).
MEDUSA_PARAMETERS = ("heads.", "prefix.")


def medusa_layout(config: dict) -> str | None:
    """``native`` | ``medusa_v1`` | ``vllm`` from a heads folder's ``config.json``; None when it holds no Medusa heads
    (``model.family.family_of`` asks every family)."""
    if config.get("format") == "medusa_train":
        return "native"
    if config.get("model_type") == "medusa":
        return "vllm"
    if "medusa_num_heads" in config:
        return "medusa_v1"
    if "MedusaModel" in config.get("architectures", []) and "num_heads" in config:
        return "vllm"
    return None


# ---------------------------------------------------------------------------------- key schemes
def native_shapes(config: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """Every native tensor name of ``config``'s heads and its shape."""
    hidden, vocab = config.hidden_size, config.head_vocab_size
    shapes: dict[str, tuple[int, ...]] = {}
    for h in range(config.num_heads):
        for layer in range(config.num_layers):
            shapes[f"heads.{h}.blocks.{layer}.linear.weight"] = (hidden, hidden)
            shapes[f"heads.{h}.blocks.{layer}.linear.bias"] = (hidden,)
        if config.next_token_input:
            shapes[f"heads.{h}.blocks.0.token.weight"] = (hidden, config.token_inputs(h) * hidden)
        if not config.share_lm_head:
            shapes[f"heads.{h}.lm_head.weight"] = (vocab, hidden)
    if config.prefix_attention:
        width = config.prefix_intermediate_size
        shapes.update({"prefix.attn_norm.weight": (hidden,), "prefix.qkv.weight": (3 * hidden, hidden),
                       "prefix.out.weight": (hidden, hidden), "prefix.mlp_norm.weight": (hidden,),
                       "prefix.gate_up.weight": (2 * width, hidden), "prefix.down.weight": (hidden, width)})
    if config.draft_vocab_size:
        shapes[TOKEN_MAP_KEY] = (config.draft_vocab_size,)
    return shapes


def layout_names(num_heads: int, num_layers: int, layout: str) -> dict[str, str]:
    """Native tensor name -> the name ``layout`` gives it, for heads with their own LM heads.

    Args:
        num_heads: Number of heads.
        num_layers: ResBlocks per head.
        layout: ``native``, ``medusa_v1`` or ``vllm``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"format={layout!r}: must be one of {', '.join(LAYOUTS)}")
    names = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            for part in ("weight", "bias"):
                native = f"heads.{h}.blocks.{layer}.linear.{part}"
                names[native] = {"native": native, "medusa_v1": f"{h}.{layer}.linear.{part}",
                                 "vllm": f"blocks.{h}.layers.{layer}.{part}"}[layout]
        native = f"heads.{h}.lm_head.weight"
        names[native] = {"native": native, "medusa_v1": f"{h}.{num_layers}.weight",
                         "vllm": f"lm_heads.{h}.weight"}[layout]
    return names


# ---------------------------------------------------------------------------------- readers
def read_heads(directory: str | os.PathLike, raw: dict | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read a heads folder in any supported layout, strictly, returning native-keyed tensors.

    Args:
        directory: A folder written by ``save_pretrained`` or ``export_heads`` (or by the original
            Medusa, TensorRT-LLM's or vLLM's tooling).
        raw: Its ``config.json`` when already read (else read here).

    Returns:
        ``(config, tensors)``: tensors keyed by native name, plus, for vLLM heads saved with
        ``original_lm_head``, their copy of the shared LM head under ``SHARED_LM_HEAD_KEY``.
        ``medusa_v1`` heads always come back with their own LM heads (``share_lm_head=False``).

    Raises:
        FileNotFoundError: no ``config.json`` or weights file.
        ValueError: an unknown config, or a missing, unexpected or wrongly shaped tensor (named
            as the layout names it).
    """
    directory = Path(directory)
    raw = read_config_json(directory) if raw is None else raw
    layout = medusa_layout(raw)
    if layout is None:
        raise ValueError(f"{directory} holds no Medusa heads (native, medusa_v1 or vllm): load it with "
                         "model.load.load_draft, which reads every draft family's folder")
    reader = {"native": _read_native, "medusa_v1": _read_medusa_v1, "vllm": _read_vllm}[layout]
    return reader(directory, raw)


def _require_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return path


def _dtype_name(tensors: dict[str, torch.Tensor], default: str = "float32") -> str:
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if not dtypes:
        return default
    # Mixed files load in their widest float dtype so nothing is rounded on the way in.
    return str(max(dtypes, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")


def _read_native(directory: Path, raw: dict) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    config = MedusaConfig.from_dict(raw)
    tensors = load_file(str(_require_file(directory / WEIGHTS_NAME)))
    check_tensors(tensors, native_shapes(config), f"{directory}/{WEIGHTS_NAME}")
    return config, tensors


def _read_medusa_v1(directory: Path, raw: dict) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    num_heads = int(raw["medusa_num_heads"])
    num_layers = int(raw.get("medusa_num_layers", 1))  # the original MedusaConfig's default
    path = directory / MEDUSA_V1_WEIGHTS_NAME
    if path.is_file():
        tensors = load_file(str(path))
    else:
        path = directory / MEDUSA_V1_PT_NAME
        if not path.is_file():
            raise FileNotFoundError(f"neither {directory / MEDUSA_V1_WEIGHTS_NAME} nor {path} found")
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    names = layout_names(num_heads, num_layers, "medusa_v1")
    # The original config has no sizes; they follow from head 0's output layer.
    head0 = tensors.get(f"0.{num_layers}.weight")
    vocab = raw.get("vocab_size") or (head0.shape[0] if head0 is not None and head0.dim() == 2 else None)
    hidden = raw.get("hidden_size") or (head0.shape[1] if head0 is not None and head0.dim() == 2 else None)
    sizes_known = vocab is not None and hidden is not None
    config = MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden or 0,
                          vocab_size=vocab or 0, share_lm_head=False,
                          base_model_name_or_path=raw.get("base_model_name_or_path"), dtype=_dtype_name(tensors))
    shapes = native_shapes(config)
    check_tensors(tensors, {names[k]: shapes[k] if sizes_known else None for k in names}, str(path))
    if not sizes_known:
        raise ValueError(f"{path}: 0.{num_layers}.weight has shape {tuple(head0.shape)}; "
                         f"an output layer is 2-D (vocab_size, hidden_size)")
    return config, {native: tensors[name] for native, name in names.items()}


def _read_vllm(directory: Path, raw: dict) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    for key in ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in raw:
            raise ValueError(f"{directory}/{CONFIG_NAME}: vLLM Medusa config lacks {key!r}")
    truncated = int(raw.get("truncated_vocab_size") or raw["vocab_size"])
    draft = truncated if truncated < int(raw["vocab_size"]) else None
    path = _require_file(directory / VLLM_WEIGHTS_NAME)
    tensors = load_file(str(path))
    shared = bool(raw.get("original_lm_head", False))
    bias = bool(raw.get("medusa_fc_bias", False))  # vLLM's default: ResBlocks without bias
    config = MedusaConfig(num_heads=int(raw["num_heads"]), num_layers=int(raw["num_hidden_layers"]),
                          hidden_size=int(raw["hidden_size"]), vocab_size=int(raw["vocab_size"]),
                          share_lm_head=shared, base_model_name_or_path=raw.get("base_model_name_or_path"),
                          dtype=_dtype_name(tensors), draft_vocab_size=draft)
    names = {**layout_names(config.num_heads, config.num_layers, "vllm"), TOKEN_MAP_KEY: TOKEN_MAP_KEY}
    shapes = native_shapes(config)
    expected = {names[k]: shape for k, shape in shapes.items() if bias or not k.endswith(".bias")}
    if shared:
        expected[SHARED_LM_HEAD_KEY] = (config.head_vocab_size, config.hidden_size)
    check_tensors(tensors, expected, str(path))
    native = {}
    for key, shape in shapes.items():
        if key.endswith(".bias") and not bias:
            native[key] = torch.zeros(shape, dtype=getattr(torch, config.dtype))
        else:
            native[key] = tensors[names[key]]
    if shared:
        native[SHARED_LM_HEAD_KEY] = tensors[SHARED_LM_HEAD_KEY]
    return config, native


def check_shared_lm_head(stored: torch.Tensor, lm_head_weight: torch.Tensor, source: str) -> None:
    """The LM head stored with vLLM ``original_lm_head`` heads must be the backbone's, exactly.

    vLLM projects through the stored copy, the loader through the backbone's LM head; loading
    onto a backbone whose LM head differs would silently change what the heads predict. The two
    are compared in the less precise of their dtypes, so the same LM head loaded in another dtype
    (a float32 export on a bfloat16 backbone, say) still passes.

    Raises:
        ValueError: the shapes or the values differ.
    """
    if tuple(stored.shape) != tuple(lm_head_weight.shape):
        raise ValueError(f"{SHARED_LM_HEAD_KEY} in {source} has shape {tuple(stored.shape)}, the backbone's "
                         f"LM head {tuple(lm_head_weight.shape)}")
    dtype = max(stored.dtype, lm_head_weight.dtype, key=lambda d: torch.finfo(d).eps)
    ours, theirs = stored.to(dtype), lm_head_weight.detach().to(device=stored.device, dtype=dtype)
    if not torch.equal(ours, theirs):
        diff = (ours.float() - theirs.float()).abs().max().item()
        raise ValueError(f"{SHARED_LM_HEAD_KEY} in {source} (original_lm_head: true) differs from the "
                         f"backbone's LM head (max abs difference {diff:.3g}): these heads were exported "
                         f"with another backbone")
