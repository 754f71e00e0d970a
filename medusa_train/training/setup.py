"""What a recipe builds before it trains, as free functions: the accelerator, the backbone, the heads, the data."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from medusa_train.config.train import TrainConfig, fsdp_problems, to_dict


def say(accelerator, message: str) -> None:
    """Print ``[medusa_train] message`` once (main process)."""
    if accelerator.is_main_process:
        print(f"[medusa_train] {message}", flush=True)


def mixed_precision(cfg: TrainConfig) -> str:
    """``trainer.mixed_precision``, with fp16 read as bf16 without a GPU (fp16 autocast needs one)."""
    mixed = cfg.trainer.mixed_precision
    return "bf16" if mixed == "fp16" and not torch.cuda.is_available() else mixed


def make_accelerator(cfg: TrainConfig):
    """An ``Accelerator`` for ``cfg`` (mixed precision, W&B when ``logger`` is set), seeded, its output folder made."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    output_dir = Path(cfg.trainer.output_dir)
    mixed = mixed_precision(cfg)
    use_wandb = cfg.logger is not None
    accelerator = Accelerator(mixed_precision=mixed, log_with="wandb" if use_wandb else None,
                              project_dir=str(output_dir))
    check_processes(accelerator)
    if cfg.model.device_map == "auto" and accelerator.num_processes > 1:
        raise ValueError("model.device_map=auto spreads one backbone over every device, which data parallelism "
                         "cannot wrap: drop it for training (each process then holds the backbone), or capture "
                         "with one process (medusa-train capture ... model.device_map=auto)")
    if under_fsdp(accelerator) and (problems := fsdp_problems(cfg, fsdp=True)):
        raise ValueError("\n".join(problems))
    output_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.trainer.seed)
    if use_wandb:
        accelerator.init_trackers(cfg.logger.project, config=to_dict(cfg), init_kwargs={"wandb": {
            "dir": str(output_dir), "name": cfg.logger.name, "entity": cfg.logger.entity, "tags": cfg.logger.tags}})
    return accelerator


def check_processes(accelerator) -> None:
    """Several launched processes must be one run: accelerate's FSDP without a GPU starts each on its own."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise ValueError(f"{launched} processes were launched but accelerate made each a run of its own "
                         f"({accelerator.distributed_type.value}): its FSDP runs only on GPUs. Without one, launch "
                         "with --cpu (configs/accelerate/ddp.yaml) and model.fsdp=true to shard the backbone")


def under_fsdp(accelerator) -> bool:
    return accelerator.distributed_type.value == "FSDP"


def shards_backbone(cfg: TrainConfig, accelerator) -> bool:
    """Whether the backbone's layers are sharded over the processes (``shard.py``; Medusa-2: the 4-bit layers
    with their LoRA): ``model.fsdp=true`` or a launch under accelerate's FSDP, with more than one process."""
    return (cfg.model.fsdp or under_fsdp(accelerator)) and accelerator.num_processes > 1


def load_backbone_for(cfg: TrainConfig, device: torch.device, sharded: bool = False):
    """``(backbone, tokenizer)`` as ``cfg.model`` says, on ``device`` (a quantized one is placed at load time).

    ``sharded``: its layers will be sharded over the processes (FSDP-QLoRA, ``shard.shard_backbone``), so 4-bit
    weights are stored as the compute dtype (``bnb_4bit_quant_storage``: the same bits, in elements FSDP shards
    with the layer's other weights)."""
    from medusa_train.backbone import assets
    from medusa_train.backbone.load import load_backbone

    m = cfg.model
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


def load_backbone_on_first_process(cfg: TrainConfig, accelerator, pad_token_id: int | None):
    """Process 0: the backbone read whole into CPU memory; the others: its modules without weights, to receive
    them from process 0 while sharding (``shard.shard_backbone``)."""
    if accelerator.process_index == 0:
        return load_backbone_for(cfg, torch.device("cpu"))[0]
    from medusa_train.backbone.without_layers import empty_backbone

    m = cfg.model
    return empty_backbone(m.name_or_path, m.dtype, m.trust_remote_code, m.attn_implementation, pad_token_id)


def captured_already(cfg: TrainConfig, tokenizer, accelerator, train: list[dict], evals: list[dict]) -> bool:
    """Whether both splits' hidden states are captured for these settings (training then never runs the backbone)."""
    from accelerate.utils import broadcast_object_list

    from medusa_train.data import capture

    folders = capture_folders(cfg, capture_settings(cfg, tokenizer, len(train), len(evals)))
    return broadcast_object_list([all(capture.read_index(f, key) is not None for f, key in folders.values())])[0]


def load_without_layers_for(cfg: TrainConfig, accelerator):
    """The backbone without its decoder layers on the device (what the heads read), or ``None`` when its
    checkpoint does not name its tensors as the model does (then load it whole)."""
    from medusa_train.backbone.without_layers import load_without_layers

    m = cfg.model
    backbone = load_without_layers(m.name_or_path, m.dtype, accelerator.device, m.trust_remote_code)
    if backbone is None:
        say(accelerator, f"model.name_or_path={m.name_or_path}: its checkpoint does not name the tensors outside its "
                         "layers as the model does; loading it whole")
    else:
        held = sum(p.numel() for p in backbone.parameters() if not p.is_meta)
        say(accelerator, f"hidden states already captured: backbone loaded without its decoder layers ({held:,} of "
                         f"{sum(p.numel() for p in backbone.parameters()):,} parameters: embeddings, norm, LM head)")
    return backbone


def build_heads(cfg: TrainConfig, backbone, device: torch.device, train: list[dict]):
    """Float32 trainable heads (and prefix layer) on ``backbone``: fresh, or from ``heads.init_from``.

    With ``heads.vocab_size=K`` fresh heads score the K tokens most often trained on in ``train`` (the
    tokenised training examples), a map every process computes alike from the same data.
    """
    from medusa_train.model.draft_vocab import most_frequent_tokens
    from medusa_train.model.medusa import MedusaModel

    h = cfg.heads
    features = {k: v for k, v in asdict(h).items() if k not in ("init_from", "vocab_size")}  # MedusaConfig's names
    if h.init_from:
        model = MedusaModel.from_pretrained(h.init_from, backbone=backbone)
        stored = {k: getattr(model.config, k) for k in features} | {"vocab_size": model.config.draft_vocab_size}
        wanted = features | {"vocab_size": h.vocab_size}
        if stored != wanted:
            differ = ", ".join(f"heads.{k}={_yaml(stored[k])}" for k in wanted if stored[k] != wanted[k])
            raise ValueError(f"heads.init_from={h.init_from} holds heads with {differ}: set these to match")
        for part in model.medusa_modules():
            part.float()
        model.config.dtype = "float32"
        model.config.base_model_name_or_path = str(cfg.model.name_or_path)
    else:
        vocab = backbone.get_output_embeddings().weight.shape[0]
        token_map = None if h.vocab_size is None else most_frequent_tokens(
            (e["labels"] for e in train), h.vocab_size, vocab)
        model = MedusaModel.from_backbone(backbone, dtype="float32", token_map=token_map, **features)
    for part in model.medusa_modules():
        part.requires_grad_(True)
        part.to(device)
    return model


def _yaml(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class TrainData:
    """The examples (token ids and labels, or cached hidden states), their batching, and the step counts."""

    train: list[dict]
    evals: list[dict]
    collator: Callable
    train_sampler: object
    eval_sampler: object
    batches_per_rank: int
    steps_per_epoch: int


def load_examples(cfg: TrainConfig, tokenizer, accelerator):
    """The tokenised train and held-out examples of ``data.source`` (``datasets.Dataset``s read from the on-disk
    cache: the first process makes it, the others and every later run read it), with ``data.chat_template``
    set on ``tokenizer`` first. Says how many conversations were used, and what was left out and why."""
    from medusa_train.backbone.chat_template import resolve_chat_template
    from medusa_train.data.cache import tokenized_splits

    d = cfg.data
    if d.chat_template:
        tokenizer.chat_template = resolve_chat_template(d.chat_template)
    with accelerator.main_process_first():
        data = tokenized_splits(tokenizer, d.source, d.max_length, d.max_samples, d.eval_size, d.seed, d.num_proc)
    for line in data_lines(cfg, data):
        say(accelerator, line)
    if not len(data.train):
        raise ValueError(f"data.source={d.source}: no usable training conversation ({data.stats.summary()})")
    return data.train, data.evals


def data_lines(cfg: TrainConfig, data) -> list[str]:
    """What the log says about the data: used of available, what was left out (capped, cut, skipped), from where."""
    d, st, selected = cfg.data, data.stats, data.selected
    used = f"data: {selected:,} of {selected + st.capped:,} conversations selected"
    if st.capped:
        used += f" (capped by data.max_samples={d.max_samples}; null reads them all)"
    lines = [f"{used}; {st.kept:,} usable after tokenising: {len(data.train):,} train, {len(data.evals):,} held out "
             "for evaluation (data.eval_size)"] + data.notes
    if st.skipped:
        lines.append(f"data: skipped {st.total_skipped:,} records: "
                     + ", ".join(f"{reason} {n:,}" for reason, n in sorted(st.skipped.items())))
    if st.truncated:
        lines.append(f"data: {st.truncated:,} conversations cut at data.max_length={d.max_length} tokens")
    how = "read the tokenised cache" if data.from_cache else "tokenised and cached"
    lines.append(f"data: {how} {data.folder} in {data.seconds:.1f} s")
    return lines


def build_data(cfg: TrainConfig, tokenizer, model, accelerator, train: list[dict], evals: list[dict],
               states_fn=None) -> TrainData:
    """Length-grouped batches of the tokenised examples (``load_examples``); with ``data.cache_hidden_states``
    of the frozen backbone's states instead (``states_fn(input_ids, attention_mask)``: what to capture; by default
    ``model``'s final hidden states)."""
    from medusa_train.data import LengthGroupedBatchSampler, MedusaCollator, example_lengths

    d = cfg.data
    collator = MedusaCollator(tokenizer.pad_token_id)
    if d.cache_hidden_states:
        states_fn = states_fn or (lambda ids, mask: model(ids, attention_mask=mask).hidden_states)
        train, evals, collator = capture_hidden_states(cfg, tokenizer, states_fn, accelerator, train, evals)
    train_sampler = LengthGroupedBatchSampler(example_lengths(train), d.batch_size, seed=d.seed, shuffle=True)
    eval_sampler = LengthGroupedBatchSampler(example_lengths(evals), d.eval_batch_size or d.batch_size,
                                             seed=d.seed, shuffle=False)
    world = accelerator.num_processes
    per_rank = len(train_sampler) // world
    if per_rank < 1:
        raise ValueError(f"{len(train)} training examples make fewer batches than processes ({world}); "
                         "lower data.batch_size or raise data.max_samples")
    steps = per_rank // cfg.optim.grad_accum_steps
    if steps < 1:
        raise ValueError(f"{per_rank} batches per process make no full optimizer step with "
                         f"optim.grad_accum_steps={cfg.optim.grad_accum_steps}; lower it")
    return TrainData(train, evals, collator, train_sampler, eval_sampler, per_rank, steps)


def capture_settings(cfg: TrainConfig, tokenizer, n_train: int, n_eval: int) -> dict:
    """Everything that changes the captured hidden states (the model section but its placement: quantization
    and its settings change them as much as the weights do), and the examples' identity as the tokenised cache
    keys it (tokenizer and chat template, the source files' size and time, lengths and split)."""
    from medusa_train.data.cache import cache_key

    d, m = cfg.data, cfg.model
    model_section = {k: v for k, v in asdict(m).items() if k not in ("device_map", "fsdp")}
    return {"examples": cache_key(tokenizer, d.source, d.max_length, d.max_samples, d.eval_size, d.seed),
            "model": m.name_or_path, "model_section": json.dumps(model_section, sort_keys=True), "source": d.source,
            "max_samples": d.max_samples, "max_length": d.max_length, "eval_size": d.eval_size, "seed": d.seed,
            "tokenizer": tokenizer.name_or_path, "n_train": n_train, "n_eval": n_eval, **eagle3_states(cfg)}


def eagle3_states(cfg: TrainConfig) -> dict:
    """What an EAGLE-3 capture stores beyond Medusa's, in its settings (so the key tells them apart); nothing for
    Medusa, whose keys stay as they were."""
    if cfg.method != "eagle3":
        return {}
    return {"states": "eagle3: aux hidden states, then the final one; token ids",
            "aux_layer_ids": cfg.eagle3.aux_layer_ids or "default (2, L//2, L-3)"}


def capture_folders(cfg: TrainConfig, settings: dict) -> dict[str, tuple[Path, str]]:
    """``{split: (folder, settings key)}`` of the captured hidden states for ``settings``."""
    from medusa_train.data import capture

    key = capture.cache_key(**settings)
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else capture.default_cache_root()
    return {split: (root / f"{key}-{split}", key) for split in ("train", "eval")}


def capture_hidden_states(cfg: TrainConfig, tokenizer, hidden_fn, accelerator, train: list[dict], evals: list[dict]):
    """Capture the frozen backbone's states (``hidden_fn(input_ids, attention_mask) -> hidden``) of both splits,
    each process its share of the shards (finished shards are kept), then read them lazily: later epochs
    (and runs) never run the backbone. Returns ``(train, evals, collator)``."""
    from accelerate.utils import broadcast_object_list

    from medusa_train.data import capture

    settings = capture_settings(cfg, tokenizer, len(train), len(evals))
    loaded = []
    for split, examples in (("train", train), ("eval", evals)):
        folder, key = capture_folders(cfg, settings)[split]
        need = broadcast_object_list([capture.read_index(folder, key) is None])[0]  # every rank decides alike
        if need:
            with accelerator.autocast():
                done = capture.capture_split(
                    hidden_fn, examples, folder, key,
                    cfg.data.batch_size * 2, accelerator.device, accelerator.process_index,
                    accelerator.num_processes, cfg.data.shard_bytes, desc=f"capture {split}",
                    keep_tokens=cfg.method == "eagle3")
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                capture.write_index(folder, examples, key, {**settings, "split": split}, done["shard_tokens"])
            accelerator.wait_for_everyone()
            say(accelerator, f"captured {split} hidden states: {done['shards']} shard(s) written, {done['kept']} kept "
                             f"(process 0), in {folder}")
        loaded.append(capture.load_captured(folder, key))
        say(accelerator, f"hidden states of {len(examples)} {split} examples read from {folder}")
    return loaded[0], loaded[1], capture.HiddenCollator()
