"""What both Medusa methods' recipes share (``recipe_medusa1.py``, ``recipe_medusa2.py``): the heads they train,
built fresh or from ``heads.init_from``, and the heads' loss on a batch's hidden states."""

from __future__ import annotations

from dataclasses import asdict

import torch

from medusa_train.config.train import TrainConfig
from medusa_train.families.medusa.model import MedusaModel
from medusa_train.model.draft_vocab import most_frequent_tokens
from medusa_train.training.losses import LossResult, depthwise_loss_backward
from medusa_train.training.targets import HeadTargets, inputs_and_targets


def build_heads(cfg: TrainConfig, backbone, device: torch.device, train: list[dict]):
    """Float32 trainable heads (and prefix layer) on ``backbone``: fresh, or from ``heads.init_from``.

    With ``heads.draft_vocab_size=K`` fresh heads score the K tokens most often trained on in ``train`` (the
    tokenised training examples), a map every process computes alike from the same data.
    """
    h = cfg.heads
    features = {k: v for k, v in asdict(h).items() if k not in ("init_from", "draft_vocab_size")}  # MedusaConfig's
    if h.init_from:
        model = MedusaModel.from_pretrained(h.init_from, backbone=backbone)
        wanted = features | {"draft_vocab_size": h.draft_vocab_size}
        stored = {k: getattr(model.config, k) for k in wanted}
        if stored != wanted:
            differ = ", ".join(f"heads.{k}={_yaml(stored[k])}" for k in wanted if stored[k] != wanted[k])
            raise ValueError(f"heads.init_from={h.init_from} holds heads with {differ}: set these to match")
        for part in model.draft_modules():
            part.float()
        model.config.dtype = "float32"
        model.config.base_model_name_or_path = str(cfg.model.name_or_path)
    else:
        vocab = backbone.get_output_embeddings().weight.shape[0]
        token_map = None if h.draft_vocab_size is None else most_frequent_tokens(
            (e["labels"] for e in train), h.draft_vocab_size, vocab)
        model = MedusaModel.from_backbone(backbone, dtype="float32", token_map=token_map, **features)
    for part in model.draft_modules():
        part.requires_grad_(True)
        part.to(device)
    return model


def _yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def heads_loss(run, hidden: torch.Tensor, labels: torch.Tensor, backward, loss_scale: float = 1.0,
               ) -> tuple[LossResult, HeadTargets]:
    """The heads' loss on ``hidden`` (backpropagated through ``backward`` unless it is ``None``)."""
    loss = run.cfg.loss
    with run.accelerator.autocast():
        features, targets = inputs_and_targets(loss.targets, run.model, hidden, labels)
        result = depthwise_loss_backward(run.model.head_logits, features, targets, head_decay=loss.head_decay,
                                      chunk_size=loss.chunk_size, backward=backward, loss_scale=loss_scale)
    return result, targets
