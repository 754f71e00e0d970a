"""One validation set per prompt source: a seeded sample of the whole source, never an evaluation prompt or a
follow-up, held out of distillation and removed (every copy) from every training set."""

from __future__ import annotations

import json
import random

from medusa_train.data.benchmarks import benchmark_prompt_texts, normalise_prompt
from medusa_train.data.cache import tokenized_splits
from medusa_train.data.validation import held_out, holds_out, prompt_source, validation_prompts

SHAREGPT = "packaged:sharegpt-v3"


def test_the_validation_set_is_a_seeded_sample_of_the_whole_source():
    from medusa_train.data.sources import load_conversations

    first = validation_prompts(SHAREGPT, 64, 0)
    assert first == validation_prompts(SHAREGPT, 64, 0) and len(first) == 64
    assert validation_prompts(SHAREGPT, 16, 0) == first[:16]  # a smaller set is a prefix: sizes nest
    assert set(validation_prompts(SHAREGPT, 64, 1)) != set(first)
    keys = [normalise_prompt(p) for p in first]
    assert len(set(keys)) == 64 and not set(keys) & benchmark_prompt_texts("packaged:mt-bench")
    conversations, _ = load_conversations(SHAREGPT, max_samples=None)
    follow_ups = {normalise_prompt(m["content"]) for c in conversations
                  for m in [m for m in c if m["role"] == "user"][1:]}
    assert not set(keys) & follow_ups  # never "Continue" and the like
    # drawn from the whole source, not its first conversations (what max_samples would keep)
    positions = [next(i for i, c in enumerate(conversations) if holds_out(c, held_out([p]))) for p in first]
    assert max(positions) > len(conversations) // 2


def chats(path, prompts: list[str], copies: dict[str, int]) -> str:
    with open(path, "w") as f:
        for p in prompts:
            for _ in range(copies.get(p, 1)):
                f.write(json.dumps({"messages": [{"role": "user", "content": p},
                                                 {"role": "assistant", "content": f"About {p}: yes."}]}) + "\n")
    return str(path)


def test_every_training_copy_of_a_validation_prompt_is_removed_and_counted(bpe_tokenizer, tmp_path):
    prompts = [f"question number {i} about {w}" for i, w in enumerate(random.Random(0).choices("abcdefgh", k=60))]
    copies = {p: 3 for p in prompts[::7]}  # some prompts asked three times
    source = chats(tmp_path / "chats.jsonl", prompts, copies)
    held = validation_prompts(source, 64, 0)
    assert len(held) == 6  # a tenth of the 60 distinct prompts: a small source keeps its data
    keys = held_out(held)
    expected_removed = sum(copies.get(p, 1) for p in prompts if normalise_prompt(p) in keys)
    data = tokenized_splits(bpe_tokenizer, source, 64, None, 4, 0, num_proc=1, cache_root=tmp_path / "cache",
                            held_out=keys)
    assert data.stats.skipped["validation_prompt"] == expected_removed
    assert data.stats.kept == sum(copies.get(p, 1) for p in prompts) - expected_removed
    texts = [bpe_tokenizer.decode(ids) for split in (data.train, data.evals) for ids in split["input_ids"]]
    assert not any(p in t for p in held for t in texts)
    again = tokenized_splits(bpe_tokenizer, source, 64, None, 4, 0, num_proc=1, cache_root=tmp_path / "cache")
    assert again.folder != data.folder and "validation_prompt" not in again.stats.skipped  # keyed apart


def test_distillation_never_selects_a_conversation_holding_a_validation_prompt(bpe_tokenizer, tmp_path):
    from medusa_train.config.distill import build_distill_config
    from medusa_train.data.distill.prompts import select_prompts

    prompts = [f"tell me about topic {i}" for i in range(50)]
    source = chats(tmp_path / "chats.jsonl", prompts, {})
    cfg = build_distill_config({"source": source, "num_prompts": None, "exclude_benchmark": None,
                                "validation": {"size": 64, "seed": 3}})
    selection = select_prompts(cfg, bpe_tokenizer, set())
    held = held_out(validation_prompts(source, 64, 3))
    assert selection.excluded["validation_prompt"] == len(held) == 5
    assert not any(normalise_prompt(s[-1]["content"]) in held for p in selection.prompts for s in p.segments)


def test_a_distilled_files_prompts_come_from_its_own_source(tmp_path):
    distilled = tmp_path / "d.jsonl"
    distilled.write_text("")
    (tmp_path / "d.stats.json").write_text(json.dumps({"source": SHAREGPT}))
    assert prompt_source(str(distilled)) == SHAREGPT
    assert prompt_source(str(tmp_path / "other.jsonl")) == str(tmp_path / "other.jsonl")


def test_a_cached_continuation_names_the_linears_it_was_made_on(bpe_tokenizer, monkeypatch):
    """The row kernel rounds its sums otherwise than torch's GEMM: greedy replies made on one are not the text the
    decoders produce on the other, so the cache keeps them apart."""
    from helpers.backbones import make_tiny_backbone

    from medusa_train.backbone.rows import row_dtypes, row_kernel
    from medusa_train.data.validation import continuations_key

    backbone = make_tiny_backbone("llama")
    on = continuations_key(backbone, bpe_tokenizer, "float32", ["a prompt"], 8, 16)
    built = not isinstance(row_kernel(), str)
    monkeypatch.setenv("MEDUSA_TRAIN_ROW_KERNEL", "0")
    row_kernel.cache_clear(), row_dtypes.cache_clear()
    try:
        off = continuations_key(backbone, bpe_tokenizer, "float32", ["a prompt"], 8, 16)
    finally:
        monkeypatch.undo()
        row_kernel.cache_clear(), row_dtypes.cache_clear()
    assert (on != off) == built
    assert continuations_key(backbone, bpe_tokenizer, "float32", ["a prompt"], 8, 16) == on


def test_a_cached_continuation_names_the_attention_it_was_made_on(bpe_tokenizer):
    """A bf16 1-token step attends in float32 under the decoders' attention and in bf16 under transformers' own:
    replies made under one are not the text the decoders produce under the other."""
    from helpers.backbones import make_tiny_backbone
    from transformers import AttentionInterface

    from medusa_train.backbone.attention import transformers_sdpa, use_grouped_attention
    from medusa_train.data.validation import continuations_key

    backbone = make_tiny_backbone("llama")
    before = AttentionInterface._global_mapping["sdpa"]
    try:
        transformers_sdpa()
        theirs = continuations_key(backbone, bpe_tokenizer, "bfloat16", ["a prompt"], 8, 16)
        use_grouped_attention()
        ours = continuations_key(backbone, bpe_tokenizer, "bfloat16", ["a prompt"], 8, 16)
    finally:
        AttentionInterface.register("sdpa", before)
    assert theirs != ours
