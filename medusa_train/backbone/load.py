"""Load the backbone causal LM and its tokenizer from any of the places users keep them.

``load_backbone`` accepts a local Hugging Face folder, a hub id, a ``.gguf`` file, or
``packaged:NAME`` (a real model that installs from the package registry, see ``assets.py``).
The model is returned unmodified (never a vendored copy of its modeling file) and frozen
unless asked otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from medusa_train.backbone import assets
from medusa_train.config.dtype import ALIASES as DTYPE_ALIASES
from medusa_train.config.dtype import DTYPES as DTYPE_NAMES
from medusa_train.config.dtype import torch_dtype
from medusa_train.config.model import ModelConfig

#: every dtype spelling a config takes -> its torch dtype (the vocabulary is ``medusa_train.config.dtype``'s)
DTYPES = {name: torch_dtype(name) for name in (*DTYPE_NAMES, *DTYPE_ALIASES)}
QUANTIZATIONS = (None, "nf4", "int8")
CONVERTED_FORMAT = 1  # bump when the packaged-model conversion changes


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config string (``"bfloat16"``, ``"bf16"``, ``"float32"``, ...) to a ``torch.dtype``
    (``medusa_train.config.dtype.torch_dtype``: one vocabulary, one error message)."""
    return torch_dtype(dtype)


def resolve_model_path(name_or_path: str | os.PathLike) -> tuple[str, dict]:
    """Turn a user's model reference into ``(path_or_id, from_pretrained kwargs)``.

    ``packaged:NAME`` and ``.gguf`` files are converted once into a safetensors folder in the
    cache, so every later load is a plain, fast, offline ``from_pretrained``.
    """
    name = str(name_or_path)
    if assets.is_packaged(name):
        gguf = assets.packaged_model_file(name)
        return str(_converted_gguf_dir(gguf, name[len(assets.PACKAGED_PREFIX):])), {}
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.name_or_path={name}: no such GGUF file")
        return str(_converted_gguf_dir(path.resolve(), path.stem)), {}
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.name_or_path={name}: the folder has no config.json; point at a Hugging Face "
                "model folder (config.json + weights), a .gguf file, or packaged:smollm2-135m-instruct")
        return str(path), {}
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model.name_or_path={name}: no such folder (and not a hub id of the form org/name)")
    return name, {}  # a hub id


def _converted_gguf_dir(gguf: Path, label: str) -> Path:
    """Dequantize a GGUF file to a cached safetensors folder (fp32), once; later calls reuse it."""
    stat = gguf.stat()
    key = f"{label}-{stat.st_size}-v{CONVERTED_FORMAT}"
    final = assets.cache_dir() / "models" / key
    if (final / "config.json").is_file():
        return final
    from transformers import GgufConfig

    print(f"[medusa_train] converting {gguf.name} to a safetensors folder (once) ...", flush=True)
    tmp = assets.atomic_dir(final)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _ensure_pad_token(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE").write_text(f"converted from {gguf.name} ({stat.st_size} bytes)\n")
    del model
    assets.publish_dir(tmp, final)
    return final


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token


def _hub_error(name: str, err: Exception) -> OSError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    why = "the hub is unreachable (HF_HUB_OFFLINE is set)" if offline else "it could not be loaded from the hub"
    return OSError(
        f"model.name_or_path={name}: not a local folder or file, and {why}: {err}\n"
        "Point model.name_or_path at a local Hugging Face folder (with config.json), a .gguf file, "
        "or packaged:smollm2-135m-instruct.")


def backbone_reference(backbone: PreTrainedModel) -> str | None:
    """The name or folder ``backbone`` was loaded from (what a draft trained on it records), if it knows one: a local
    folder or file as an absolute, resolved path; a hub id or ``packaged:`` name as it is."""
    name = getattr(backbone, "name_or_path", None) or getattr(backbone.config, "_name_or_path", None)
    if not name:
        return None
    local = Path(str(name)).expanduser()
    if not assets.is_packaged(str(name)) and local.exists():
        return str(local.resolve())  # a folder or file here: absolute, so the draft loads from anywhere, never a hub id
    return str(name)


def load_tokenizer(name_or_path: str | os.PathLike, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer that goes with ``name_or_path`` (pad token set, chat template kept)."""
    path, kwargs = resolve_model_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except OSError as err:
        if Path(path).exists():
            raise
        raise _hub_error(str(name_or_path), err) from err
    _ensure_pad_token(tokenizer)
    return tokenizer


def native_bf16(device: str | torch.device | None = None, cpu_flags: str | None = None) -> bool:
    """Whether bfloat16 matmuls run natively here: a CUDA device that supports them, or a CPU with
    AVX512-BF16 or AMX (on an AVX2-only CPU they are emulated, measured ~5x slower than float32).

    ``cpu_flags`` (``/proc/cpuinfo``'s flags line) is read from the machine when not given."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if cpu_flags is None:
        try:
            cpu_flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
        except OSError:
            return True  # not Linux: assume a modern CPU, as torch does
    flags = set(cpu_flags.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def load_backbone(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype = "bfloat16",
    quantization: str | None = None,
    trust_remote_code: bool = False,
    freeze: bool = True,
    device_map: str | dict | None = None,
    attn_implementation: str | None = None,
    bnb_compute_dtype: str | None = None,
    bnb_double_quant: bool = True,
    offload_folder: str | os.PathLike | None = None,
    bnb_quant_storage: str | torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: Local HF folder, hub id, ``.gguf`` file, or ``packaged:smollm2-135m-instruct``.
        dtype: Weight dtype (``"bfloat16"``, ``"float32"``, ``"float16"``).
        quantization: ``None``, ``"nf4"`` (4-bit, for QLoRA) or ``"int8"`` through bitsandbytes.
        trust_remote_code: Allow custom modeling code from the model folder (off by default).
        freeze: Set ``requires_grad=False`` on every backbone parameter.
        device_map: Passed to ``from_pretrained`` (``"cpu"`` is used for quantized loads on CPU).
        attn_implementation: ``"sdpa"`` / ``"eager"``; ``None`` keeps transformers' default.
        bnb_compute_dtype: Compute dtype of 4-bit layers (defaults to ``dtype``).
        bnb_double_quant: Double quantisation of the 4-bit scales.
        offload_folder: Where ``device_map="auto"`` puts the layers that fit neither GPU nor CPU memory.
        bnb_quant_storage: The element type the packed 4-bit weights are stored as (``bnb_4bit_quant_storage``;
            ``None``: bytes). The same bits either way; FSDP shards a 4-bit layer with its other weights when
            they are stored as the compute dtype (FSDP-QLoRA, ``training/shard.py``).

    Returns:
        ``(model, tokenizer)``: the model in eval mode, the tokenizer with a pad token.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"model.quantization={quantization!r}: must be one of null, nf4, int8")
    torch_dtype = resolve_dtype(dtype)
    path, kwargs = resolve_model_path(name_or_path)
    kwargs.update(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization is not None:
        kwargs["quantization_config"] = _bnb_config(quantization, bnb_compute_dtype or torch_dtype, bnb_double_quant,
                                                    bnb_quant_storage)
        kwargs["device_map"] = device_map or ("auto" if torch.cuda.is_available() else "cpu")
    elif device_map is not None:
        kwargs["device_map"] = device_map
    if offload_folder is not None and device_map == "auto":
        kwargs["offload_folder"] = str(offload_folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        if Path(path).exists():
            raise
        raise _hub_error(str(name_or_path), err) from err
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    if quantization == "nf4":
        disable_bnb_cpu_inference_repack(model)
    if freeze:
        model.requires_grad_(False)
    model.name_or_path = str(name_or_path)  # what MedusaModel.save_pretrained records as the base
    return model, tokenizer


def _bnb_config(quantization: str, compute_dtype, double_quant: bool, quant_storage=None):
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = {} if quant_storage is None else {"bnb_4bit_quant_storage": resolve_dtype(quant_storage)}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=resolve_dtype(compute_dtype),
                              bnb_4bit_use_double_quant=double_quant, **storage)


def disable_bnb_cpu_inference_repack(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for AVX512-BF16 CPU inference.

    On such CPUs the first no-grad eval forward repacks the weights, and LoRA gradients
    computed afterwards are silently wrong. Returns how many layers were changed.
    """
    count = 0
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def load_without_weights(name_or_path: str | os.PathLike, trust_remote_code: bool = False):
    """What a client of a serving engine needs of a model, without its weights.

    Returns:
        ``(tokenizer, end-of-turn ids, context length or None, the local folder or hub id an engine loads)``:
        the ids are ``generation.eos_token_ids``'s for the model (its generation config, else its config,
        plus the tokenizer's eos).
    """
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from medusa_train.backbone.generation import eos_token_ids

    path, _ = resolve_model_path(name_or_path)
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config names the eos
        generation = None
    eos = eos_token_ids(SimpleNamespace(generation_config=generation, config=config), tokenizer)
    return tokenizer, eos, getattr(config, "max_position_embeddings", None), path


def load_backbone_for(m: ModelConfig, device: torch.device, sharded: bool = False):
    """``(backbone, tokenizer)`` as a config's ``model`` section says, on ``device`` (a quantized one is placed at load time).

    ``sharded``: its layers will be sharded over the processes (FSDP-QLoRA, ``training/shard.py``), so 4-bit
    weights are stored as the compute dtype (``bnb_4bit_quant_storage``: the same bits, in elements FSDP shards
    with the layer's other weights)."""
    placement = "auto" if m.device_map == "auto" else ({"": device} if m.quantization else None)
    storage = (m.bnb_compute_dtype or m.dtype) if sharded and m.quantization == "nf4" else None
    backbone, tokenizer = load_backbone(
        m.name_or_path, dtype=m.dtype, quantization=m.quantization, trust_remote_code=m.trust_remote_code,
        attn_implementation=m.attn_implementation, bnb_compute_dtype=m.bnb_compute_dtype,
        bnb_double_quant=m.bnb_double_quant, device_map=placement, offload_folder=assets.cache_dir() / "offload",
        bnb_quant_storage=storage)
    if placement is None:
        backbone.to(device)
    return backbone, tokenizer
