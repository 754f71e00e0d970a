"""A peer on our data: NVIDIA Model Optimizer's Medusa-1 heads and EAGLE-3 draft, trained on our training split and
written where our commands read them. Runs in the peers' environment (``bash scripts/peers_env.sh`` makes it):

    .venv-peers/bin/python -m benchmarks peers data=outputs/demo/distill-1200-5e29b078.jsonl
    .venv-peers/bin/python -m benchmarks peers data=... limit=16 max_steps=2 max_length=128 out=outputs/peers/smoke

Stages (each skipped when its output exists; ``summary.json`` under ``out`` is written as each one ends):

1. ``data``: our ``train`` split, made by our own pipeline exactly as ``medusa-train train +recipe=medusa1
   experiment=demo data.source=<data>`` makes it (``data.examples.load_examples``: the chat template, assistant-only
   labels, ``max_length``, the held-out eval conversations and every conversation holding a validation prompt
   removed), saved as ``data/train.pt``.
2. ``medusa-peer`` / ``medusa-ours``: ``mtsp.convert(model, [("medusa", ...)])`` trained by ``transformers.Trainer``
   as the peer's ``examples/speculative_decoding/main.py`` does, at the peer's defaults and at our step budget
   (the demo preset: 4 epochs of batch 8, lr 2e-3, cosine with 5% warm-up, clipping at 1.0; steps counted as our
   loop counts them, ``ceil(train / 8)`` an epoch). Written as the ``medusa_v1`` layout (``medusa-train evaluate``
   and ``export format=vllm`` read it).
3. ``eagle3-peer`` / ``eagle3-ours``: ``mtsp.convert(model, [("eagle", EAGLE3 recipe)])`` likewise; written twice:
   ``modelopt-export/`` (the peer's own exporter, for vLLM) and ``export/`` (our EAGLE-3 layout, our decoder and
   vLLM both load it: ``layers.0.`` renamed ``midlayer.``, the rope it was trained with).

Each training runs in a process of its own, so its peak RSS is its own. Scoring is left to our commands; they are
printed at the end. Options: ``data``, ``out``, ``model``, ``limit`` (first N training examples), ``max_steps``
(cap on every run: smoke), ``max_samples`` (the first N conversations of ``data``, as ``medusa-train train
data.max_samples=N``), ``max_length`` (512, the demo's), ``stages`` (comma list), ``answer_only`` (true: the
loss on our assistant-only labels; false: on every real token, the peer's ``answer_only_loss: false``),
``compile`` (false: the peer's torch.compile of its EAGLE forward, off on CPU), ``threads``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODEL = "packaged:smollm2-135m-instruct"
DEFAULTS = {"data": "outputs/demo/distill-1200-5e29b078.jsonl", "out": "outputs/peers", "model": MODEL,
            "max_samples": "", "limit": "", "max_steps": "", "max_length": "512", "stages": "data,medusa-peer,medusa-ours,eagle3-peer,"
            "eagle3-ours", "answer_only": "true", "compile": "false", "threads": ""}
IGNORE = -100
#: The peer's documented defaults, nvidia-modelopt 0.47.0. Training: the one speculative-training recipe the wheel
#: ships, modelopt_recipes/general/speculative_decoding/eagle3.yaml (lines 29-48; no Medusa recipe ships, so Medusa
#: takes the same training section). Medusa: modelopt/torch/speculative/config.py MedusaConfig (lines 303-311).
PEER = {"epochs": 1, "batch_size": 1, "lr": 1e-4, "warmup_steps": 1000, "scheduler": "linear", "weight_decay": 0.0,
        "drop_last": True, "max_grad_norm": 1.0, "medusa_num_heads": 2, "medusa_num_layers": 1, "eagle_ttt_steps": 3}
#: Our step budget: configs/experiment/demo.yaml and eagle3.yaml over medusa_train/config/train.py's OptimConfig.
OURS = {"epochs": 4, "batch_size": 8, "lr": 2e-3, "warmup_ratio": 0.05, "scheduler": "cosine", "weight_decay": 0.0,
        "drop_last": False, "max_grad_norm": 1.0, "medusa_num_heads": 2, "medusa_num_layers": 1, "eagle_ttt_steps": 3}
RUNS = {"medusa-peer": ("medusa", PEER), "medusa-ours": ("medusa", OURS), "eagle3-peer": ("eagle3", PEER),
        "eagle3-ours": ("eagle3", OURS)}
ENV_HINT = ("Model Optimizer is not importable here. Create its environment (a venv of its own, never a product "
            "dependency) and run the benchmark with it:\n  bash scripts/peers_env.sh\n"
            "  .venv-peers/bin/python -m benchmarks peers data=<distilled .jsonl>")


# ---------------------------------------------------------------------------------------------- data (our pipeline)
def make_data(opts: dict, target: Path) -> dict:
    """Our ``train`` split of ``opts["data"]`` as ``medusa-train train experiment=demo`` makes it, saved to ``target``."""
    import torch

    from medusa_train.backbone.load import load_tokenizer
    from medusa_train.config.compose import compose_config
    from medusa_train.config.train import build_config
    from medusa_train.data.examples import load_examples

    first = [f"data.max_samples={opts['max_samples']}"] if opts["max_samples"] else []  # as train's data.max_samples
    cfg = build_config(compose_config("train", ["+recipe=medusa1", "experiment=demo", f"data.source={opts['data']}",
                                                f"data.max_length={opts['max_length']}", f"model.name_or_path={opts['model']}",
                                                *first]))
    tokenizer = load_tokenizer(opts["model"])

    class OneProcess:  # what load_examples asks of an accelerator, for a single process
        is_main_process = True

        @staticmethod
        def main_process_first():
            import contextlib

            return contextlib.nullcontext()

    train, evals = load_examples(cfg.data, tokenizer, OneProcess())
    rows = {"input_ids": [list(map(int, r)) for r in train["input_ids"]],
            "labels": [list(map(int, r)) for r in train["labels"]]}
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rows, str(target) + ".partial")
    os.replace(str(target) + ".partial", target)
    return {"train": len(train), "held_out_eval": len(evals), "max_length": cfg.data.max_length,
            "source": opts["data"], "tokens": sum(len(r) for r in rows["input_ids"]),
            "supervised_tokens": sum(sum(t != IGNORE for t in r) for r in rows["labels"])}


class Examples:
    """Our tokenised examples for the peer's Trainer (a map-style dataset)."""

    def __init__(self, rows: dict, limit: int | None):
        n = len(rows["input_ids"]) if not limit else min(limit, len(rows["input_ids"]))
        self.ids, self.labels = rows["input_ids"][:n], rows["labels"][:n]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def collate(targets: str, pad_id: int, answer_only: bool):
    """Right-padded batches (to the longest, not to the peer's ``training_seq_len``) in the form the peer's model
    reads: Medusa ``labels[t]`` = the token after ``t`` (its data pipeline's shift; its loss shifts 1 + i more for head
    i); EAGLE-3 ``loss_mask[t]`` = 1 where the token after ``t`` is supervised (its loss pairs position ``t`` of the
    teacher's distribution, which predicts ``t + 1``, with the draft's step-0 output one position earlier)."""
    import torch

    def fn(batch):
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        target = torch.full_like(ids, IGNORE)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n], mask[i, :n] = torch.tensor(b["input_ids"]), 1
            target[i, :n] = torch.tensor(b["labels"]) if answer_only else ids[i, :n]
        shifted = torch.full_like(target, IGNORE)
        shifted[:, :-1] = target[:, 1:]
        if targets == "labels":
            return {"input_ids": ids, "attention_mask": mask, "labels": shifted}
        return {"input_ids": ids, "attention_mask": mask, "loss_mask": (shifted != IGNORE).long()}

    return fn


# ---------------------------------------------------------------------------------------------- one training run
def steps_for(n: int, h: dict) -> int:
    """Optimizer steps of a run: epochs x batches an epoch (the peer's Trainer drops the last short batch; our loop
    keeps it: ``LengthGroupedBatchSampler(drop_last=False)``)."""
    per_epoch = n // h["batch_size"] if h["drop_last"] else math.ceil(n / h["batch_size"])
    return h["epochs"] * per_epoch


def train_run(name: str, opts: dict, folder: Path) -> dict:
    """Train run ``name`` in this process; write its folders; return its figures (RSS, time, steps, losses)."""
    import torch
    import transformers

    from medusa_train.backbone.load import resolve_model_path

    if opts.get("threads"):
        torch.set_num_threads(int(opts["threads"]))
    family, h = RUNS[name]
    torch.manual_seed(0)  # as the peer's main.py
    hf_folder = resolve_model_path(opts["model"])[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype="auto", device_map="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_folder)
    PEER_METHODS[family].convert(model, h, opts)
    rows = torch.load(folder.parent / "data" / "train.pt")
    data = Examples(rows, int(opts["limit"]) if opts["limit"] else None)
    steps = steps_for(len(data), h)
    if opts["max_steps"]:
        steps = min(steps, int(opts["max_steps"]))
    warmup = h.get("warmup_steps", round(h.get("warmup_ratio", 0) * steps))
    args = transformers.TrainingArguments(
        output_dir=str(folder / "trainer"), max_steps=steps, per_device_train_batch_size=h["batch_size"],
        learning_rate=h["lr"], warmup_steps=warmup, lr_scheduler_type=h["scheduler"], weight_decay=h["weight_decay"],
        max_grad_norm=h["max_grad_norm"], dataloader_drop_last=h["drop_last"], bf16=True, use_cpu=True,
        save_strategy="no", logging_steps=max(1, steps // 20), report_to=[], remove_unused_columns=False,
        disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collate(PEER_METHODS[family].targets, tokenizer.pad_token_id, opts["answer_only"] == "true"))
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    model.eval()
    written = PEER_METHODS[family].write(model, folder, opts["model"])
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"run": name, "family": family, "hyper": {**h, "warmup_steps": warmup}, "examples": len(data),
            "steps": steps, "train_s": round(seconds, 1), "s_per_step": round(seconds / max(steps, 1), 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "train_loss": round(result.training_loss, 4), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "written": written,
            "draft_params": sum(p.numel() for n, p in model.named_parameters()
                                if n.startswith(("medusa_heads.", "eagle_module.")))}


def convert_heads(model, h: dict, opts: dict) -> None:
    """The peer's Medusa heads on ``model`` (its ``mtsp.convert``)."""
    import modelopt.torch.speculative as mtsp

    mtsp.convert(model, [("medusa", {"medusa_num_heads": h["medusa_num_heads"],
                                     "medusa_num_layers": h["medusa_num_layers"]})])


def convert_draft(model, h: dict, opts: dict) -> None:
    """The peer's EAGLE-3 draft on ``model`` (its recipe's defaults), with the two fixes this benchmark needs."""
    import modelopt.torch.speculative as mtsp
    from modelopt.recipe.config import ModelOptEagleRecipe

    eagle = ModelOptEagleRecipe().eagle  # the recipe's defaults (eagle3.yaml's eagle section)
    eagle.eagle_ttt_steps = h["eagle_ttt_steps"]
    eagle.eagle_use_torch_compile = opts["compile"] == "true"
    cfg = eagle.model_dump()
    # eagle3.yaml's `eagle_architecture_config: {}` over the EAGLE-3 default (config.py lines 41-53)
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG

    cfg["eagle_architecture_config"] = {**EAGLE3_DEFAULT_CFG["config"]["eagle_architecture_config"],
                                        **cfg["eagle_architecture_config"]}
    mtsp.convert(model, [("eagle", cfg)])
    # modelopt 0.47 builds the draft's rope with LlamaRotaryEmbedding(config=..., device=...) on its first forward
    # (plugins/modeling_eagle.py line 84), which transformers 5.23 refuses (config only): built here instead
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.eagle_module.rotary_emb = LlamaRotaryEmbedding(config=model.eagle_module.config)
    # modelopt 0.47 caches each training-time-test step's attention mask by step alone (plugins/hf_eagle.py lines
    # 431-437), built for the first batch's length: its own pipeline pads every batch to training_seq_len, and a
    # batch of another length fails ("size of tensor a (400) must match ... b (204)"). Keyed by length here (the
    # same masks, _compute_ttt_attention_mask's, for each length; only the last length's kept).
    model._get_ttt_attention_mask = ttt_masks_by_length(model)


def ttt_masks_by_length(model):
    """The peer's training-time-test mask for ``(batch, length, step)``, cached for the last length seen."""
    cache: dict = {}

    def mask(batch_size: int, seq_length: int, ttt_step: int):
        if cache.get("length") != seq_length:
            cache.clear()
            cache["length"] = seq_length
        if ttt_step not in cache:
            cache[ttt_step] = model._compute_ttt_attention_mask(batch_size, seq_length, ttt_step)
        return cache[ttt_step]

    return mask


# ---------------------------------------------------------------------------------------------- writing the drafts
def write_heads(model, folder: Path, base: str) -> dict:
    """The peer's heads as the ``medusa_v1`` layout (``medusa_heads.{h}.{l}.linear.*`` and ``medusa_heads.{h}.{L}.weight``
    are that layout's names once the prefix goes)."""
    from medusa_train.model.folder import write_heads_folder

    state = {k.removeprefix("medusa_heads."): v.detach().float().contiguous()
             for k, v in model.state_dict().items() if k.startswith("medusa_heads.")}
    vocab, hidden = model.lm_head.weight.shape
    config = {"medusa_num_heads": model.medusa_num_heads, "medusa_num_layers": model.medusa_num_layers,
              "base_model_name_or_path": base, "hidden_size": hidden, "vocab_size": vocab,
              "trained_by": "nvidia-modelopt 0.47.0 (benchmarks/bench_peers.py)"}
    path = write_heads_folder(folder / "export", {"medusa_lm_head.safetensors": state}, config)
    return {"export": str(path)}


def write_draft(model, folder: Path, base: str) -> dict:
    """The peer's draft twice: its own exporter's folder (``modelopt-export``, for vLLM), and our layout (``export``):
    ``layers.0.*`` renamed ``midlayer.*``, aux layers counted as vLLM counts them (the peer hooks layer i's output,
    transformers' ``hidden_states[i + 1]``), the rope it trained with (not the YaRN the peer's exporter writes)."""
    import torch
    from safetensors.torch import load_file

    from medusa_train.families.eagle3.config import Eagle3Config
    from medusa_train.model.folder import write_heads_folder

    theirs = folder / "modelopt-export"
    model.get_exporter().export(theirs, dtype=torch.float32)
    tensors = {k.replace("layers.0.", "midlayer.", 1): v.float().contiguous()
               for k, v in load_file(str(theirs / "model.safetensors")).items()}
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].long()
    e = model.eagle_config
    rope = dict(e.rope_parameters if getattr(e, "rope_parameters", None) else e.rope_scaling)
    text = model.config.get_text_config(decoder=True)
    config = Eagle3Config(
        hidden_size=e.hidden_size, num_attention_heads=e.num_attention_heads, num_key_value_heads=e.num_key_value_heads,
        head_dim=e.head_dim, intermediate_size=e.intermediate_size, vocab_size=e.vocab_size,
        draft_vocab_size=e.draft_vocab_size, aux_layer_ids=[i + 1 for i in e.eagle_aux_hidden_state_layer_ids],
        num_target_layers=text.num_hidden_layers, rms_norm_eps=e.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=e.max_position_embeddings, hidden_act=e.hidden_act, ttt_steps=model.eagle_ttt_steps,
        base_model_name_or_path=base, dtype="float32")
    path = write_heads_folder(folder / "export", {"model.safetensors": tensors}, config.to_dict())
    return {"export": str(path), "modelopt_export": str(theirs),
            "modelopt_rope_scaling": json.loads((theirs / "config.json").read_text()).get("rope_scaling")}


# ---------------------------------------------------------------------------------------------- stages


@dataclass(frozen=True)
class PeerMethod:
    """What the peer trains for one of our draft families, and how this benchmark reads it."""

    convert: Callable  #: ``(model, hyper-parameters, options)``: the peer's draft put on the model
    targets: str  #: how its batches carry the targets: ``labels`` (shifted tokens) | ``loss_mask``
    write: Callable  #: ``(model, folder, base) -> what was written``: the trained draft as a folder we read
    chain: bool  #: evaluated with ``tree=chain`` (a chained draft)
    export_for_vllm: bool  #: converted with ``medusa-train export format=vllm`` before vLLM serves it


#: per family of ours (``model/family.py``), the peer's method that trains one
PEER_METHODS = {
    "medusa": PeerMethod(convert_heads, "labels", write_heads, chain=False, export_for_vllm=True),
    "eagle3": PeerMethod(convert_draft, "loss_mask", write_draft, chain=True, export_for_vllm=False),
}


def save(folder: Path, summary: dict) -> None:
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"peers summary so far: {json.dumps(summary)}", flush=True)


def child(name: str, opts_json: str) -> int:
    """One run in its own process (``python -m benchmarks.bench_peers RUN OPTS``): prints its result line."""
    opts = json.loads(opts_json)
    folder = Path(opts["out"]) / name
    folder.mkdir(parents=True, exist_ok=True)
    result = train_run(name, opts, folder)
    (folder / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def score_commands(out: Path, summary: dict) -> list[str]:
    lines = []
    for name in RUNS:
        export = out / name / "export"
        if not (export / "config.json").is_file():
            continue
        method = PEER_METHODS[RUNS[name][0]]
        chain = " tree=chain" if method.chain else ""
        lines += [f"medusa-train evaluate heads={export}{chain} output_dir={out / name / 'eval'}",
                  f"medusa-train evaluate heads={export} engine=vllm tree=chain output_dir={out / name / 'eval-vllm'}"]
        if method.export_for_vllm:
            lines.append(f"medusa-train export heads={export} format=vllm output={out / name / 'vllm'}")
    return lines


def main(**overrides) -> int:
    from benchmarks.bench_options import bench_options

    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    try:
        import modelopt.torch.speculative  # noqa: F401
    except ImportError:
        print(ENV_HINT)
        return 2
    out = Path(opts["out"])
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    summary["options"] = opts
    stages = [s.strip() for s in opts["stages"].split(",") if s.strip()]
    data = out / "data" / "train.pt"
    if "data" in stages and not data.is_file():
        started = time.perf_counter()
        summary["data"] = {**make_data(opts, data), "seconds": round(time.perf_counter() - started, 1)}
        save(out, summary)
    if not data.is_file():
        print(f"{data} is missing: run with the data stage (stages=data,...)")
        return 2
    for name in [s for s in stages if s in RUNS]:
        result_path = out / name / "result.json"
        if not result_path.is_file():
            print(f"[peers] training {name} ...", flush=True)
            rc = subprocess.call([sys.executable, "-m", "benchmarks.bench_peers", name, json.dumps(opts)])
            if rc or not result_path.is_file():
                summary[name] = {"error": f"exit status {rc}: see the output above"}
                save(out, summary)
                continue
        summary[name] = json.loads(result_path.read_text())
        save(out, summary)
    print("\nscore each draft with our own commands (from the project's .venv):")
    for line in score_commands(out, summary):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in RUNS:
        sys.exit(f"one run in its own process: python -m benchmarks.bench_peers {{{'|'.join(RUNS)}}} OPTIONS_JSON; "
                 "the benchmark itself: python -m benchmarks peers ...")
    sys.exit(child(sys.argv[1], sys.argv[2]))
