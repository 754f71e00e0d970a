"""Plain generation helpers shared by distillation, decoding, evaluation and tree fitting: chat prompts,
eos ids, temperature / top-p sampling, the backbone's own decoding (the baseline Medusa must reproduce),
and a synchronised clock."""

from __future__ import annotations

import time

import torch

from medusa_train.backbone.appending_cache import appending_cache_for


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    """(1, len) ids of ``messages`` through the chat template, ready for the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; evaluation prompts go through one "
                         "(use an instruct/chat model, or set tokenizer.chat_template)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def eos_token_ids(backbone, tokenizer=None, override=None) -> list[int]:
    """End-of-turn ids: the backbone's (or ``override``), plus the tokenizer's eos when a tokenizer is given.

    Args:
        backbone: A causal LM; its ``generation_config.eos_token_id``, else its ``config.eos_token_id``.
        tokenizer: When given, its ``eos_token_id`` is appended if not already listed.
        override: Id(s) to use instead of the backbone's (an int, a sequence or a tensor; ``[]`` = none).

    Returns:
        The ids in order (empty when nothing names one).
    """
    eos = override
    if eos is None:
        eos = getattr(getattr(backbone, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(backbone.config, "eos_token_id", None)
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    extra = getattr(tokenizer, "eos_token_id", None)
    if extra is not None and extra not in ids:
        ids.append(int(extra))
    return ids


def sampling_probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float32 with the mass outside the top-p nucleus set to 0.

    The nucleus keeps the most likely tokens until their mass reaches ``top_p`` (at least one token).
    Not renormalised: ``torch.multinomial`` takes weights as they are.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(mass_before >= top_p, 0.0))
    return probs


def sample_next_tokens(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """(rows,) next token of each row of (rows, vocab) ``logits``: the argmax at ``temperature`` 0,
    else a draw from the temperature / top-p distribution (with ``generator``, or torch's global one)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = sampling_probabilities(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def now(device: torch.device) -> float:
    """Wall-clock seconds, after waiting for the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives (the end of the prefill)."""

    def __init__(self, device: torch.device):
        self.device, self.calls, self.first_token_at = device, 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt, call 2 the first new token
            self.first_token_at = now(self.device)

    def end(self) -> None:
        pass


def plain_generate(backbone, input_ids: torch.Tensor, max_new_tokens: int, eos: list[int], pad_token_id: int,
                   temperature: float = 0.0, top_p: float = 1.0, prompt_lookup: tuple[int, int] | None = None,
                   ) -> tuple[list[int], dict[str, float]]:
    """Plain decoding with ``backbone.generate``: greedy argmax (or sampling at ``temperature > 0``).

    The model's own generation defaults (penalties, beams, top-k) are overridden so that the
    output is exactly what Medusa must reproduce. A backbone of plain full-attention layers decodes over the cache
    our decoder steps over (``AppendingCache``: each step's keys written in place, not the cache copied); others
    over the one transformers makes for them.

    Args:
        prompt_lookup: ``(num_tokens, max_matching_ngram_size)``: Hugging Face's prompt-lookup decoding
            (drafts copied from the context after a matching n-gram, verified by the backbone in one
            forward): the free baseline that needs no training. ``None``: one token per forward.

    Returns:
        The new token ids and ``{prefill_s, decode_s, wall_s, forwards}``; ``forwards`` counts the
        backbone's forward passes, the prefill included.
    """
    from transformers import GenerationConfig

    sampling = temperature > 0
    lookup = {} if prompt_lookup is None else {"prompt_lookup_num_tokens": int(prompt_lookup[0]),
                                                "max_matching_ngram_size": int(prompt_lookup[1])}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=sampling, num_beams=1, repetition_penalty=1.0,
        no_repeat_ngram_size=0, temperature=temperature if sampling else 1.0, top_p=top_p if sampling else 1.0,
        top_k=0 if sampling else 50, typical_p=1.0, eos_token_id=eos or None, pad_token_id=pad_token_id, **lookup)
    device = input_ids.device
    clock = _FirstTokenClock(device)
    # the cache our decoder steps over (appending in place), with room for the reply and a lookup's guesses
    cache = appending_cache_for(backbone, input_ids.shape[1] + max_new_tokens + 1 + (
        prompt_lookup[0] if prompt_lookup else 0))
    forwards = [0]
    # the LM head runs once per forward, whatever wraps the model (a peft model's generate calls the one inside)
    hook = backbone.get_output_embeddings().register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        start = now(device)
        out = backbone.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                streamer=clock, **({} if cache is None else {"past_key_values": cache}))
        wall = now(device) - start
    finally:
        hook.remove()
    prefill = (clock.first_token_at or start + wall) - start
    return out[0, input_ids.shape[1]:].tolist(), {"prefill_s": prefill, "decode_s": wall - prefill, "wall_s": wall,
                                                  "forwards": forwards[0]}
