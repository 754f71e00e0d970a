"""One validation set per prompt source: the prompts every figure before decoding is measured on.

``validation_prompts``: a seeded sample of first user turns drawn from the whole source (independent of
``data.max_samples``: runs at any data size share it), never a prompt of the evaluation benchmark nor a text the source
also asks as a follow-up turn ("Continue"), one per normalised text. Distillation passes over every conversation that contains one of them and training removes every copy
(``held_out``), so the draft never trains on them. ``continuations``: the backbone's greedy replies to them (untrimmed,
unfiltered, ``max_new_tokens`` long at most), made once and cached under ``$MEDUSA_TRAIN_CACHE/validation``, keyed by
the model, the tokenizer with its chat template, the dtype, what the linears run on and the prompts. Training walks
its draft along them (``model/walk.py``), build-tree calibrates on them and ``evaluate bench.source=validation``
decodes them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_train.data.benchmarks import benchmark_prompt_texts, normalise_prompt
from medusa_train.data.held_out import held_out, holds_out, keys_digest  # noqa: F401 - this set's names

VALIDATION = "validation"  #: the name that means this set (build-tree's calibration=, evaluate's bench.source=)
EXCLUDED_BENCHMARK = "packaged:mt-bench"  #: the evaluation's prompts are never validation prompts
MAX_PROMPT_CHARS = 4000  #: longer first turns are not drawn (tokens are checked where a tokenizer is at hand)
FORMAT = 2  #: bump when what a cached continuation holds, or how it is made, changes (2: the backbone's eos alone)
DEFAULT_PROMPT_SOURCE = "packaged:sharegpt-v3"  #: a draft with no training config: the packaged ShareGPT prompts


def prompt_source(data_source: str) -> str:
    """The source of ``data_source``'s prompts: a distilled file's own source (its ``.stats.json``), else itself."""
    from medusa_train.data.distill.writer import sidecar

    path = Path(data_source).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        stats = sidecar(path, ".stats.json")
        if stats.is_file():
            source = json.loads(stats.read_text()).get("source")
            if source:
                return source
    return data_source


def validation_source(d) -> str:
    """Where a ``data`` section's validation prompts come from: ``data.validation.source``, else the prompt source of
    ``data.source``."""
    return d.validation.source or prompt_source(d.source)


@functools.lru_cache(maxsize=8)
def _drawn(source: str, seed: int) -> tuple[str, ...]:
    """Every usable distinct first user turn of ``source``, in a seeded order."""
    from medusa_train.data.sources import load_conversations

    conversations, _ = load_conversations(source, max_samples=None)
    firsts = [next((m["content"] for m in c if m["role"] == "user" and m["content"].strip()), "") for c in conversations]
    # a text some conversation asks as a follow-up ("Continue", "Please continue") leans on what came before it
    follow_ups = {normalise_prompt(m["content"]) for c in conversations
                  for m in [m for m in c if m["role"] == "user"][1:] if isinstance(m["content"], str)}
    banned = benchmark_prompt_texts(EXCLUDED_BENCHMARK) | follow_ups
    order = list(range(len(firsts)))
    random.Random(seed).shuffle(order)
    candidates = {}  # normalised text -> the first turn, in the seeded order
    for i in order:
        text = firsts[i]
        key = normalise_prompt(text)
        if key and key not in banned and key not in candidates and len(text) <= MAX_PROMPT_CHARS:
            candidates[key] = text
    return tuple(candidates.values())


def validation_prompts(source: str, size: int = 64, seed: int = 0) -> list[str]:
    """``size`` first user turns of ``source``, a seeded sample of the whole source; at most a tenth of its distinct
    usable first turns (``validation_cap``), so a small source keeps most of its data for training."""
    return list(_drawn(source, seed)[:validation_cap(source, size, seed)]) if size else []


def validation_cap(source: str, size: int, seed: int = 0) -> int:
    """How many validation prompts ``source`` gives for ``size``: ``size``, or a tenth of its distinct usable first
    turns when that is fewer (the log says so)."""
    return min(size, len(_drawn(source, seed)) // 10)


def held_out_line(source: str, prompts: Sequence[str], size: int, seed: int) -> str:
    """What the log says about a validation set: how many prompts of which source, and why fewer than asked."""
    line = f"{len(prompts)} prompts of {source} held out (size {size}, seed {seed}"
    if len(prompts) < size:
        line += f"; at most a tenth of its {len(_drawn(source, seed)):,} distinct first turns"
    return line + ")"


@dataclass
class Continuations:
    """The backbone's greedy replies to the validation prompts: ``sequences`` ``(ids (1, len), prompt length)``."""

    prompts: list[str]  #: the prompts walked (those whose rendered prompt fits), in the set's order
    sequences: list[tuple[torch.Tensor, int]]
    too_long: int  #: prompts passed over: longer than max_prompt_tokens through the chat template
    path: Path
    from_cache: bool

    def summary(self) -> str:
        tokens = sum(ids.shape[1] - n for ids, n in self.sequences)
        return (f"{len(self.sequences)} prompts, {tokens:,} reply tokens"
                + (f" ({self.too_long} longer than the prompt limit passed over)" if self.too_long else "")
                + f"; {'read' if self.from_cache else 'made and cached'} {self.path}")


def model_fingerprint(backbone) -> str:
    """What names the backbone's weights: its path or hub id and its config (not the weights themselves)."""
    config = backbone.config
    return hashlib.sha256((str(getattr(config, "_name_or_path", "")) + config.to_json_string(use_diff=False)).encode()
                          ).hexdigest()[:20]


def continuations_key(backbone, tokenizer, dtype: str, prompts: Sequence[str], max_new_tokens: int,
                      max_prompt_tokens: int) -> str:
    from medusa_train.backbone.attention import attention_for, head_dim_of
    from medusa_train.backbone.row_norms import norms_for
    from medusa_train.backbone.rows import linears_for
    from medusa_train.data.cache import tokenizer_fingerprint

    # the linears' and the attention's paths too: the row kernel rounds its sums otherwise than torch's GEMM, a bf16
    # 1-token step in float32 otherwise than in bf16, so a reply made on one is not the text the decoders produce
    # on the other (``continuations`` makes them with the decoders' attention)
    device, torch_dtype = backbone.get_input_embeddings().weight.device, getattr(torch, dtype)
    parts = {"format": FORMAT, "model": model_fingerprint(backbone), "tokenizer": tokenizer_fingerprint(tokenizer),
             "dtype": dtype, "linears": linears_for(device, torch_dtype), "norms": norms_for(device, torch_dtype),
             "attention": attention_for(device, torch_dtype, head_dim_of(backbone)),
             "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
             "prompts": hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cache_root() -> Path:
    from medusa_train.backbone import assets

    return assets.cache_dir() / "validation"


def prompt_fits(tokenizer, text: str, max_prompt_tokens: int | None) -> bool:
    """Whether ``text`` as a user turn, through the chat template, is at most ``max_prompt_tokens`` (None: any)."""
    from medusa_train.backbone.generation import encode_chat

    return max_prompt_tokens is None or encode_chat(tokenizer, [{"role": "user", "content": text}]).shape[1] <= \
        max_prompt_tokens


@torch.no_grad()
def greedy_replies(backbone, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                   max_prompt_tokens: int | None = None, progress: bool = True, desc: str = "greedy continuations",
                   ) -> tuple[list[str], list[tuple[torch.Tensor, int]]]:
    """``(prompts kept, [(ids (1, len), prompt length)])``: the backbone's greedy reply to each prompt (HF ``generate``'s
    for that prompt alone, stopping at the backbone's eos as the evaluation's decoders do), prompts longer than
    ``max_prompt_tokens`` passed over. A CPU backbone's steps run the row kernel, as the decoders' do (a training
    backbone's validation replies took 6.8 min at 16 tokens/s on torch's GEMV, AVX2 code paths), and where each
    reply stays bitwise its one-prompt reply, many prompts a step (``backbone/batched.py``; 4.0 min one at a time
    on the AVX2 code paths): the first group's first reply is checked against ``generate``'s for that prompt
    alone, and a difference turns batching off, with a line saying so."""
    from tqdm.auto import tqdm

    from medusa_train.backbone.attention import use_grouped_attention
    from medusa_train.backbone.batched import batch_rows, batched_greedy
    from medusa_train.backbone.generation import encode_chat, eos_token_ids, plain_generate
    from medusa_train.backbone.row_layers import row_kernel_during

    use_grouped_attention()  # the decoders' attention too (a bf16 1-token step in float32 rounds otherwise)
    device = backbone.get_input_embeddings().weight.device
    eos = eos_token_ids(backbone)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    kept, encoded = [], []
    for text in prompts:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}]).to(device)
        if max_prompt_tokens is None or ids.shape[1] <= max_prompt_tokens:
            kept.append(text)
            encoded.append(ids)
    with row_kernel_during(backbone):
        rows, _ = batch_rows(backbone)
        replies: list[list[int] | None] = [None] * len(encoded)
        with tqdm(total=len(encoded), desc=f"{desc} ({rows} a step)" if rows > 1 else desc, unit="prompt",
                  disable=not progress) as bar:
            if rows > 1 and encoded:  # the first group batched, its first reply checked against generate's alone
                alone = plain_generate(backbone, encoded[0], max_new_tokens, eos, pad)[0]
                group = batched_greedy(backbone, encoded[:rows], max_new_tokens, eos, rows)
                if group[0] == alone:
                    replies[:len(group)] = group
                else:
                    print(f"[medusa_train] {desc}: a batched step's reply differs from generate's for the first "
                          "prompt; one prompt at a time")
                    replies[0], rows = alone, 1
                bar.update(sum(r is not None for r in replies))
            rest = [i for i, r in enumerate(replies) if r is None]
            if rows > 1:
                for i, reply in zip(rest, batched_greedy(backbone, [encoded[i] for i in rest], max_new_tokens, eos,
                                                         rows, finished=lambda _: bar.update(1))):
                    replies[i] = reply
            else:
                for i in rest:
                    replies[i] = plain_generate(backbone, encoded[i], max_new_tokens, eos, pad)[0]
                    bar.update(1)
    sequences = [(torch.cat([ids[0], torch.tensor(new, dtype=ids.dtype, device=device)])[None], ids.shape[1])
                 for ids, new in zip(encoded, replies)]
    return kept, sequences


def continuations(backbone, tokenizer, prompts: Sequence[str], max_new_tokens: int, max_prompt_tokens: int = 256,
                  progress: bool = True, root: str | os.PathLike | None = None) -> Continuations:
    """The backbone's greedy continuations of ``prompts`` (``greedy_replies``), read from the cache or made and cached;
    the file is written whole, then renamed."""
    from medusa_train.backbone.attention import use_grouped_attention

    use_grouped_attention()  # the decoders' attention, before the key names it (a bf16 1-token step in float32)
    dtype = str(next(backbone.parameters()).dtype).removeprefix("torch.")
    key = continuations_key(backbone, tokenizer, dtype, prompts, max_new_tokens, max_prompt_tokens)
    path = Path(root or cache_root()) / f"{key}.json"
    device = backbone.get_input_embeddings().weight.device
    if path.is_file():
        stored = json.loads(path.read_text())
        sequences = [(torch.tensor([s["ids"]], device=device), s["prompt_len"]) for s in stored["sequences"]]
        return Continuations(stored["prompts"], sequences, stored["too_long"], path, True)
    started = time.perf_counter()
    kept, sequences = greedy_replies(backbone, tokenizer, prompts, max_new_tokens, max_prompt_tokens, progress,
                                     "validation continuations")
    too_long = len(prompts) - len(kept)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"prompts": kept, "too_long": too_long, "dtype": dtype, "max_new_tokens": max_new_tokens,
                               "seconds": round(time.perf_counter() - started, 1),
                               "sequences": [{"ids": ids[0].tolist(), "prompt_len": n} for ids, n in sequences]}))
    os.replace(tmp, path)
    return Continuations(kept, sequences, too_long, path, False)
