"""The frozen backbone's decoder layers sharded over the processes (FSDP2), the heads replicated.

Medusa-1's backbone never trains: every process runs its forward, none needs its gradients. With each
decoder layer under ``torch.distributed.fsdp.fully_shard`` a process keeps 1/N of the layer's weights
and gathers the whole layer only while it runs (it is freed again after its forward), so a backbone
about N times larger than one device trains heads online. The embeddings, final norm and LM head
stay whole on every process: the heads read the LM head and the embeddings outside the backbone's
forward (a shared LM head, the next token's embedding), where a sharded weight would not be gathered.

The heads are small and replicated; their gradients are averaged by DDP as without sharding
(``OneBackward``). Why not ``accelerator.prepare`` under accelerate's FSDP: it shards the whole module
it is given, heads included, and it runs FSDP only on GPUs (``--cpu`` with an FSDP config starts
independent processes), so nothing on CPU could check it. ``fully_shard`` is the engine that
accelerate's FSDP2 itself calls, and it runs on gloo as on NCCL.

Only process 0 reads the checkpoint: the others build the backbone's modules with no
weights (``backbone.without_layers.empty_backbone``) and receive each tensor from process 0, one at a
time, keeping only their shard of each layer (torch's ``set_model_state_dict`` with
``broadcast_from_rank0``, as accelerate's FSDP2 loading does). Host memory is then one checkpoint on
the first process and a layer's worth on the others, not one checkpoint per process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa_train.backbone.without_layers import decoder_layers, place_buffers


@dataclass
class Sharded:
    """What ``shard_backbone`` did: layers sharded, the backbone's parameters in all and held here."""

    layers: int
    layer_class: str
    parameters: int
    held: int

    def summary(self, world: int) -> str:
        return (f"backbone sharded over {world} processes (FSDP2): {self.layers} {self.layer_class} layers, "
                f"{self.held:,} of its {self.parameters:,} parameters held by each process "
                "(embeddings, norm and LM head whole); read by process 0 and broadcast")


def shard_backbone(backbone: torch.nn.Module, device: torch.device, world: int) -> Sharded:
    """Shard ``backbone``'s decoder layers over the ``world`` processes of the default process group, onto
    ``device``; the rest of it moves there whole. Every process must then run the same backbone forwards.

    Process 0 holds the loaded backbone, the others an ``empty_backbone`` (parameters on the meta device):
    process 0's weights are broadcast, each process keeping its shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    layers = decoder_layers(backbone)
    if not layers:
        raise ValueError(f"{type(backbone).__name__} names no decoder layer class (_no_split_modules), so model.fsdp "
                         "cannot tell what to shard: drop model.fsdp (each process then holds the whole backbone)")
    layer_class = type(layers[0]).__name__  # (fully_shard renames the class: FSDP<name>)
    receives = dist.get_rank() != 0
    full = {} if receives else backbone.state_dict()  # process 0's whole tensors, to broadcast
    buffers = dict(backbone.named_buffers())  # computed at build time everywhere; to_empty would blank them
    mesh = init_device_mesh(device.type, (world,))
    for layer in layers:  # each gathers on its own forward and frees the gathered weights after it
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    if receives:  # storage for this process's shards and the whole rest, filled by the broadcast below
        backbone.to_empty(device=device)
        backbone.tie_weights()
    else:  # the rest, whole (tied weights stay tied: the same Parameter object)
        for param in backbone.parameters():
            if not isinstance(param, DTensor):
                param.data = param.data.to(device)
    place_buffers(backbone, buffers, device)
    set_model_state_dict(backbone, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in backbone.parameters())
    return Sharded(len(layers), layer_class, sum(p.numel() for p in backbone.parameters()), held)
