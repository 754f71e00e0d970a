"""LoRA adapters on a (4-bit, 8-bit or dense) backbone, for Medusa-2's joint training (peft)."""

from __future__ import annotations

from collections.abc import Sequence


def add_lora(backbone, r: int, alpha: int, dropout: float, target_modules: str | Sequence[str],
             gradient_checkpointing: bool = True):
    """Prepare a (quantized) backbone for k-bit training and wrap it with LoRA adapters.

    Args:
        backbone: A causal LM from ``load_backbone`` (4-bit, 8-bit or dense).
        r: LoRA rank.
        alpha: LoRA scaling numerator (``alpha / r``).
        dropout: Dropout on the LoRA input.
        target_modules: ``"all-linear"`` (every linear projection except the output layer) or a
            list of module names.
        gradient_checkpointing: Recompute each decoder layer's activations in the backward pass instead
            of keeping them (``peft.gradient_checkpointing``): what lets an 8B backbone train at 2,048
            tokens; the same loss and gradients, about a third more compute. Non-reentrant, so it needs no
            input that requires grad, and in training mode only (the adapter-disabled teacher pass keeps none).

    Returns:
        A ``peft.PeftModelForCausalLM``; only the LoRA weights require grad.

    Raises:
        ValueError: the targets include the output layer (the LM head is never adapted).
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from peft.tuners.tuners_utils import BaseTunerLayer

    output_name = next(n for n, m in backbone.named_modules() if m is backbone.get_output_embeddings())
    if not isinstance(target_modules, str):
        target_modules = list(target_modules)
        hit = [t for t in target_modules if output_name == t or output_name.endswith("." + t)]
        if hit:
            raise ValueError(f"peft.target_modules={target_modules}: {hit} is the output layer; "
                             "the LM head is never adapted (remove it)")
    if getattr(backbone, "is_loaded_in_4bit", False) or getattr(backbone, "is_loaded_in_8bit", False):
        backbone = prepare_model_for_kbit_training(backbone, use_gradient_checkpointing=False)
    if gradient_checkpointing:
        non_reentrant = {"use_reentrant": False}
        if hasattr(backbone, "activation_checkpointing_enable"):  # transformers >= 5.2x's name for it
            backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(backbone, config)
    if isinstance(model.get_output_embeddings(), BaseTunerLayer):
        raise ValueError(f"peft.target_modules={target_modules!r} matches the output layer {output_name}; "
                         "the LM head is never adapted")
    return model
