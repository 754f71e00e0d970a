"""Batched reply generation: one left-padded batch, rows leave it (and its KV cache) as soon as they are done."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa_train.backbone.generation import sample_next_tokens
from medusa_train.config.distill import FilterConfig, GenerationSettings
from medusa_train.data.distill.prompts import Message
from medusa_train.data.distill.repetition import LoopTracker


@dataclass
class Reply:
    """One generated reply."""

    text: str
    tokens: list[int]  # the reply's tokens, before the end-of-turn token (or before its loop)
    finished: bool  # an end-of-turn token was generated within max_new_tokens
    generated: int  # tokens generated for it (with the end-of-turn token and any cut-off loop)
    looped: bool = False  # stopped in a sustained loop; ``tokens`` end where the loop began


@torch.inference_mode()
def generate_replies(model, tokenizer, contexts: list[list[Message]], settings: GenerationSettings,
                     eos_ids: list[int], filters: FilterConfig | None = None) -> list[Reply]:
    """One reply per context, generated together from one left-padded batch.

    A row leaves the batch (and its KV cache) as soon as it is done: it generated an end-of-turn
    token, reached ``max_new_tokens``, or (with ``filters.loop_window``) got stuck in a loop, in
    which case its tokens end where the loop began. So no compute goes to finished rows, and
    long-looping rows do not hold the batch up. Greedy replies equal ``model.generate``'s.
    """
    from transformers import DynamicCache

    from medusa_train.backbone.appending_cache import appending_cache_for

    filters = filters or FilterConfig()
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in contexts]
    # generation continues from the last column, so pad on the left (the tokenizer's own setting is left alone)
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=False).to(model.device)
    mask = batch["attention_mask"]
    # each step's keys written in place (room for every reply's end), not the whole cache copied per step
    cache = appending_cache_for(model, batch["input_ids"].shape[1] + settings.max_new_tokens)
    cache = DynamicCache(config=model.config) if cache is None else cache
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   past_key_values=cache, use_cache=True).logits[:, -1]
    window = filters.loop_window or settings.max_new_tokens + 1  # (no loop can last longer: never stops)
    trackers = [LoopTracker(filters.repetition_ngram, window) for _ in contexts]
    replies: list[Reply | None] = [None] * len(contexts)
    rows = list(range(len(contexts)))  # the context of each batch row
    eos = set(eos_ids)
    for step in range(1, settings.max_new_tokens + 1):
        keep = []
        for position, (row, token) in enumerate(zip(rows, sample_next_tokens(logits, settings.temperature, settings.top_p).tolist())):
            tracker = trackers[row]
            if token in eos:
                replies[row] = Reply(_decode(tokenizer, tracker.tokens), list(tracker.tokens), True, step)
            elif tracker.push(token):
                tokens = tracker.tokens[:tracker.loop_start]
                replies[row] = Reply(_decode(tokenizer, tokens), tokens, False, step, looped=True)
            elif step == settings.max_new_tokens:
                replies[row] = Reply(_decode(tokenizer, tracker.tokens), list(tracker.tokens), False, step)
            else:
                keep.append(position)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave the batch and the cache
            index = torch.tensor(keep, device=mask.device)
            cache.batch_select_indices(index)
            mask, rows = mask[index], [rows[i] for i in keep]
        tokens = torch.tensor([[trackers[row].tokens[-1]] for row in rows], device=mask.device)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        logits = model(input_ids=tokens, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    return replies


def _decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)
