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

Medusa-2 (FSDP-QLoRA) shards the 4-bit backbone's layers with their LoRA weights the same way
(``loaded_everywhere=True``). Its weights cannot be broadcast like bf16 ones: a 4-bit weight is packed bytes
plus the quantization statistics bitsandbytes keeps beside the parameter (``quant_state``: absmax, code,
shape), which the state dict broadcast does not carry. So every process reads the checkpoint and quantizes
the whole backbone itself, onto its own device (the NF4 model once per process, at load), then keeps 1/N of
each layer's parameters; the statistics stay whole on every process (``Linear4bit.quant_state``, from which
bitsandbytes restores them when FSDP hands it the gathered weight). The packed weights are stored as the
compute dtype (``bnb_4bit_quant_storage``, set by ``backbone.load.load_backbone_for``), so a layer's parameters are
all floating point. The LoRA weights inside the layers become sharded trainable parameters: FSDP
reduce-scatters (averages) their gradients in the backward, the optimizer steps each process's shard, and
checkpoints and the adapter export gather them whole (``loop.save_checkpoint``, ``medusa2.py``).
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
    loaded_everywhere: bool = False  #: every process loaded the whole backbone itself (4-bit), nothing broadcast
    held_bytes: int = 0  #: bytes of the parameters held by each process
    parameter_bytes: int = 0  #: bytes of all the backbone's parameters
    statistics_bytes: int = 0  #: bytes of the 4-bit weights' quantization statistics, whole on every process

    def summary(self, world: int) -> str:
        source = (f"each process read and quantized the whole checkpoint itself (4-bit weights are not broadcast; "
                  f"their quantization statistics, {_mib(self.statistics_bytes)}, stay whole on every process)"
                  if self.loaded_everywhere else "read by process 0 and broadcast")
        return (f"backbone sharded over {world} processes (FSDP2): {self.layers} {self.layer_class} layers, "
                f"{self.held:,} of its {self.parameters:,} parameters held by each process ({_mib(self.held_bytes)} "
                f"of {_mib(self.parameter_bytes)}; embeddings, norm and LM head whole); {source}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def shard_backbone(backbone: torch.nn.Module, device: torch.device, world: int,
                   loaded_everywhere: bool = False) -> Sharded:
    """Shard ``backbone``'s decoder layers over the ``world`` processes of the default process group, onto
    ``device``; the rest of it moves there whole. Every process must then run the same backbone forwards.

    Process 0 holds the loaded backbone, the others an ``empty_backbone`` (parameters on the meta device):
    process 0's weights are broadcast, each process keeping its shards. ``loaded_everywhere``: every process
    holds the same loaded backbone (a 4-bit one, LoRA included) and keeps its shards of its own copy."""
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
    if loaded_everywhere:
        mesh = init_device_mesh(device.type, (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        for param in backbone.parameters():  # the rest, whole (placed at load already)
            if not isinstance(param, DTensor):
                param.data = param.data.to(device)
        return _sharded(backbone, layers, layer_class, True)
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
    return _sharded(backbone, layers, layer_class, False)


def _sharded(backbone: torch.nn.Module, layers: list, layer_class: str, loaded_everywhere: bool) -> Sharded:
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in backbone.parameters()]
    statistics = {}  # each 4-bit layer's absmax, code (nested ones too), by identity
    for module in backbone.modules():
        state = getattr(module, "quant_state", None)
        while state is not None and hasattr(state, "absmax"):
            statistics.update({id(t): t for t in (state.absmax, state.code, state.offset) if torch.is_tensor(t)})
            state = getattr(state, "state2", None)
    return Sharded(len(layers), layer_class, sum(p.numel() for p in backbone.parameters()),
                   sum(t.numel() for t in local), loaded_everywhere,
                   held_bytes=sum(t.numel() * t.element_size() for t in local),
                   parameter_bytes=sum(p.numel() * p.element_size() for p in backbone.parameters()),
                   statistics_bytes=sum(t.numel() * t.element_size() for t in statistics.values()))


def is_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sharded parameter (a DTensor: this process holds only its shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a sharded one gathered from every process (a collective: every process must call it, in
    the same order), anything else as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """``clip_grad_norm_`` over every process's whole gradients: sharded ones (DTensors, Medusa-2's LoRA under
    FSDP) count with every process's shard, replicated ones (the heads, averaged by DDP) once."""
    sharded = [p for p in params if p.grad is not None and is_sharded(p)]
    if not sharded:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    replicated = [p for p in params if p.grad is not None and not is_sharded(p)]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor()]
    if replicated:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in replicated]).to(norms[0].device))
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in (sharded, replicated):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
