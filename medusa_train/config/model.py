"""The ``model`` section every command shares, in one place: how the backbone is loaded.

Two shapes of it: ``ModelConfig`` for the commands that run the backbone to make data or train (distill, capture,
train: any dtype, quantization, flash attention, placement over devices), ``EvalModelConfig`` for those that run
the tree decoder on exported heads (export's checks, build-tree, evaluate: the backbone the heads name by default,
float32 by default, attention that takes a 4D tree mask). Each comes with its checks, naming the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from medusa_train.config.chat_template import chat_template_problem
from medusa_train.config.dtype import parse_dtype


@dataclass
class ModelConfig:
    name_or_path: str = "packaged:smollm2-135m-instruct"  #: local HF folder, hub id, .gguf, or packaged:NAME
    dtype: str = "bfloat16"  #: backbone weight dtype: bfloat16 | float32 | float16 (or bf16, fp32, fp16)
    quantization: str | None = None  #: null | nf4 | int8 (bitsandbytes; the medusa2 recipe uses nf4)
    trust_remote_code: bool = False  #: allow custom modeling code shipped with the model
    #: sdpa | eager | flash_attention_2 | flash_attention_3 (installed, CUDA, bf16/fp16) | null (transformers' default)
    attn_implementation: str | None = "sdpa"
    bnb_compute_dtype: str | None = None  #: compute dtype of 4-bit layers (default: dtype)
    bnb_double_quant: bool = True  #: double-quantise the 4-bit scales
    #: null (one device per process) | auto (accelerate's big-model placement over every GPU, then CPU and
    #: disk: for a backbone larger than one device, in medusa-train capture with one process)
    device_map: str | None = None
    #: with several processes: shard the backbone's decoder layers over them (FSDP2), each process holding 1/N of
    #: them (medusa1: the frozen backbone; medusa2: the NF4 layers with their LoRA, FSDP-QLoRA); the heads stay
    #: whole on every process. Implied by accelerate's FSDP (configs/accelerate/fsdp.yaml)
    fsdp: bool = False


def check_model(m: ModelConfig) -> list[str]:
    """Problems of a ``model`` section (shared by training and distillation), each naming its key; its dtypes
    are stored by their canonical names (``bf16`` -> ``bfloat16``)."""
    problems: list[str] = []
    parse_dtype(problems, m, "model.dtype")
    parse_dtype(problems, m, "model.bnb_compute_dtype", "bnb_compute_dtype", optional=True)
    rules = [(bool(m.name_or_path), "name_or_path", m.name_or_path, "must name a model"),
             (m.quantization in (None, "nf4", "int8"), "quantization", m.quantization, "must be null, nf4 or int8"),
             (m.attn_implementation in (None, "sdpa", "eager", *FLASH_ATTENTION), "attn_implementation",
              m.attn_implementation, f"must be sdpa, eager, {', '.join(FLASH_ATTENTION)} or null")]
    if m.attn_implementation in FLASH_ATTENTION:
        rules += [(m.dtype != "float32", "attn_implementation", m.attn_implementation,
                   "runs in bfloat16 or float16 only: set model.dtype=bfloat16, or use model.attn_implementation=sdpa"),
                  (flash_attention_available(m.attn_implementation), "attn_implementation", m.attn_implementation,
                   f"not available here: it needs CUDA and {FLASH_ATTENTION[m.attn_implementation]}, "
                   "or use model.attn_implementation=sdpa")]
    return problems + [f"model.{key}={value!r}: {rule}" for ok, key, value, rule in rules if not ok]


#: attention kernels training, distillation and capture may use, and what each needs installed
FLASH_ATTENTION = {"flash_attention_2": "the flash-attn package: pip install flash-attn --no-build-isolation",
                   "flash_attention_3": "FlashAttention-3: install flash_attn_interface from flash-attention's hopper/"}


def flash_attention_available(name: str) -> bool:
    """Whether transformers can run ``name`` (``flash_attention_2`` / ``_3``) here: package installed, CUDA present."""
    from transformers import utils

    return utils.is_flash_attn_3_available() if name == "flash_attention_3" else utils.is_flash_attn_2_available()


@dataclass
class EvalModelConfig:
    name_or_path: str | None = None  #: backbone; default: the one named in the heads' config.json
    dtype: str = "float32"  #: float32 | bfloat16 | float16 (float32: greedy parity without near-ties)
    #: sdpa | eager | null (transformers' default); not flash attention: the tree's verify pass needs a 4D mask
    attn_implementation: str | None = "sdpa"
    trust_remote_code: bool = False
    form: str = "merged"  #: Medusa-2 exports: merged (plain transformers) | adapter (4-bit base + LoRA; peft, bitsandbytes)
    #: null: the template the heads were trained with (their chat_template.jinja), else the tokenizer's; or a
    #: Jinja template's text, or a file holding one, to render the prompts with instead
    chat_template: str | None = None


def check_decoder_attention(m: EvalModelConfig) -> list[str]:
    """``model.attn_implementation`` and ``model.chat_template`` of a command that runs the tree decoder
    (evaluate, build-tree)."""
    template = chat_template_problem("model.chat_template", m.chat_template)
    value = m.attn_implementation
    if value in (None, "sdpa", "eager"):
        return [template] if template else []
    if "flash" in str(value):
        why = ("the tree decoder's verify pass attends through a 4D tree mask, which flash attention does not take "
               "(training, distillation and capture can use it): use model.attn_implementation=sdpa (or eager)")
    else:
        why = "must be sdpa, eager or null"
    return [f"model.attn_implementation={value!r}: {why}", *([template] if template else [])]
