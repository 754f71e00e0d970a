"""Greedy replies to many prompts at once on a CPU, each bitwise the reply HF ``generate`` gives that prompt alone.

The validation replies every figure before decoding is measured on (64 prompts, up to 128 tokens each) took 4 of
a demo's minutes one prompt at a time on the AVX2 code paths: a 1-token step reads every weight for one row. A step
over several prompts' next tokens reads them once for all rows, and where every part of the step treats a row the
same whatever the rows beside it, each reply is the one its prompt gets alone, token for token:

- the linears run the row kernel (``backbone/rows.py``) from one row on: each output summed the same way at any
  number of rows (on an Intel CPU a 1-token step stays on MKL's GEMV, which rounds otherwise: one at a time there);
- each row attends over its own keys alone (``attention.step_sdpa_forward`` given ``row_starts``), through the
  path its 1-token step takes, however far its prompt was padded on the left;
- each prompt's prefill runs alone, as ``generate`` runs it; norms, rotary positions and the rest work row by row.

``batch_rows`` says how many prompts a step may take on this backbone and why; ``batched_greedy`` steps them in
groups of that many, each group until its longest reply ends (a finished row leaves the batch). Elsewhere (a GPU,
an Intel CPU, layers off the kernel, another attention, a sliding-window cache) replies are made one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from medusa_train.backbone.appending_cache import AppendingLayer, plain_layers

#: prompts a batched step takes at most (the packaged model, float32, 32 validation prompts of 64 tokens: 8 rows
#: 16.8 s, 16 rows 13.5, 32 rows 12.5; one at a time ~5x as long)
DEFAULT_ROWS = 32


def batch_rows(backbone, wanted: int = DEFAULT_ROWS) -> tuple[int, str]:
    """``(rows, why)``: how many prompts one greedy step may take on ``backbone`` as it is now with every reply
    bitwise its one-prompt reply (1: one at a time), and what says so."""
    from transformers import AttentionInterface

    from medusa_train.backbone.attention import grouped_sdpa_forward, step_sdpa_forward
    from medusa_train.backbone.rows import RowLinear, row_range

    if wanted <= 1:
        return 1, "one prompt at a time (asked)"
    if backbone.get_input_embeddings().weight.device.type != "cpu":
        return 1, "one prompt at a time: not a CPU backbone (a batched step rounds otherwise than a 1-token one there)"
    linears = [m for m in backbone.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or any(type(m) is not RowLinear for m in linears):
        return 1, "one prompt at a time: not every linear layer runs the row kernel"
    fewest, most = row_range(linears[0].weight.dtype)
    if fewest != 1:
        return 1, "one prompt at a time: a 1-token step runs torch's GEMV on this CPU, which rounds otherwise"
    if (getattr(backbone.config, "_attn_implementation", None) != "sdpa"
            or AttentionInterface._global_mapping.get("sdpa") not in (step_sdpa_forward, grouped_sdpa_forward)):
        return 1, "one prompt at a time: the attention is not the decoders' grouped sdpa"
    if not plain_layers(backbone):
        return 1, "one prompt at a time: a cache layer that is not a plain dynamic one (a sliding window)"
    rows = min(wanted, most)
    return rows, f"{rows} prompts a step (the row kernel from one row, each row attending alone)"


def _prefill(backbone, ids: torch.Tensor):
    """One prompt's pass alone, as ``generate`` makes it: its cache and its first greedy token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=backbone.config)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    out = backbone(ids, attention_mask=torch.ones_like(ids), position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1)
    return cache, int(out.logits[0, -1].argmax())


def _left_padded(backbone, caches: list, lengths: list[int], room: int):
    """One cache holding ``caches`` (one prompt each) as rows, each left-padded with zeros to the longest, with
    ``room`` positions more kept for the steps to come."""
    from transformers import DynamicCache

    longest, merged = max(lengths), DynamicCache(config=backbone.config)
    for i in range(len(merged.layers)):
        first = caches[0].layers[i].keys
        keys = first.new_zeros(len(caches), first.shape[1], longest + room, first.shape[3])
        values = keys.clone()
        for row, (cache, length) in enumerate(zip(caches, lengths)):
            keys[row, :, longest - length:longest] = cache.layers[i].keys[0]
            values[row, :, longest - length:longest] = cache.layers[i].values[0]
        merged.layers[i] = AppendingLayer()
        merged.layers[i].hold(keys, values, longest)
    return merged


@torch.no_grad()
def batched_greedy(backbone, prompts: Sequence[torch.Tensor], max_new_tokens: int, eos: Sequence[int], rows: int,
                   finished: Callable[[int], None] | None = None) -> list[list[int]]:
    """The greedy reply (new ids, the eos that ended it included) to each ``(1, len)`` prompt, ``rows`` prompts a
    step; ``finished(index)`` is called as each reply ends. Bitwise ``generate``'s one-prompt replies only where
    ``batch_rows`` gave ``rows``."""
    if max_new_tokens < 1 or rows < 1:
        raise ValueError(f"batched_greedy: max_new_tokens and rows at least 1, not {max_new_tokens} and {rows}")
    replies: list[list[int]] = [[] for _ in prompts]
    stops = set(int(t) for t in eos)
    for first in range(0, len(prompts), rows):
        group = list(range(first, min(first + rows, len(prompts))))
        caches, lengths = [], []
        for index in group:
            cache, token = _prefill(backbone, prompts[index])
            caches.append(cache)
            lengths.append(prompts[index].shape[1])
            replies[index].append(token)
        cache = _left_padded(backbone, caches, lengths, max_new_tokens)
        del caches
        width = max(lengths)  # the merged cache's length before this group's first step
        live = list(range(len(group)))  # positions in the group of the rows still stepping
        device = prompts[group[0]].device
        steps = 0
        while True:
            ended = [slot for slot in live
                     if replies[group[slot]][-1] in stops or len(replies[group[slot]]) >= max_new_tokens]
            for slot in ended:
                if finished:
                    finished(group[slot])
            if ended:
                keep = [j for j, slot in enumerate(live) if slot not in ended]
                live = [live[j] for j in keep]
                if not live:
                    break
                cache.batch_select_indices(torch.tensor(keep))
            starts = [width - lengths[slot] for slot in live]
            tokens = torch.tensor([[replies[group[slot]][-1]] for slot in live], device=device)
            positions = torch.tensor([[lengths[slot] + steps] for slot in live], device=device)
            mask = torch.ones(len(live), width + steps + 1, dtype=torch.long, device=device)
            for j, start in enumerate(starts):
                mask[j, :start] = 0
            out = backbone(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           cache_position=torch.tensor([width + steps], device=device), use_cache=True,
                           logits_to_keep=1, row_starts=starts)
            for slot, token in zip(live, out.logits[:, -1].argmax(-1).tolist()):
                replies[group[slot]].append(int(token))
            steps += 1
    return replies
