"""A micro-step's several backward passes as one forward and one backward, so accelerate's wrappers apply.

The heads' loss runs backward once per head (and once more into the prefix layer or the backbone),
so that only one head's logits exist at a time. DDP, which ``accelerator.prepare`` applies, expects
one backward per forward of the wrapped module and averages the gradients in that backward.
``OneBackward`` runs the micro-step inside its forward with the trainable parameters' gradients
set aside, takes what the micro-step's backward passes left in ``.grad`` as this micro-step's
gradient ``g``, puts the earlier gradients back and returns ``sum(p * g)``: the one backward of that
adds exactly ``g`` to each parameter's gradient, and DDP averages the sum over processes there (or
leaves it local under ``accelerator.no_sync``, for all but the last micro-batch of an optimizer step).

The micro-step's own backward passes run while DDP expects none (its hooks ignore them), so they
accumulate locally as in a single process; parameters a micro-step does not reach get ``g = 0``, so
every process's backward reaches every parameter and DDP needs no unused-parameter search.

Trainable parameters sharded by FSDP (Medusa-2's LoRA inside sharded layers, ``shard.py``) are left to FSDP:
DDP ignores them, their gradients are reduce-scattered in the micro-step's own backward and accumulate there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from medusa_train.training.shard import is_sharded

R = TypeVar("R")


class OneBackward(torch.nn.Module):
    """Wraps ``model``; ``forward(step) -> (surrogate, step())``, and ``surrogate.backward()`` yields the gradients
    ``step``'s own backward passes computed."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        # frozen weights (4-bit ones too) and buffers are the same everywhere: DDP need not broadcast them;
        # sharded ones (DTensors) are FSDP's
        self._ddp_params_and_buffers_to_ignore = (
            [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad or is_sharded(p)]
            + [f"model.{n}" for n, _ in model.named_buffers()])

    def forward(self, step: Callable[[], R]) -> tuple[torch.Tensor, R]:
        params = [p for p in self.model.parameters() if p.requires_grad and not is_sharded(p)]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            result = step()
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        finally:
            for p, g in zip(params, earlier):
                p.grad = g
        surrogate = torch.stack([(p * g).sum() for p, g in zip(params, grads)]).sum()
        return surrogate, result

