"""A KV cache that appends in place: every decoder's cache on a step (ours, HF ``generate``, HF prompt lookup, the cost
curve, the batched replies) and every draft's own (the heads' prefix attention, EAGLE-3's and P-EAGLE's layer), so a
step pays for its own keys and values, not for copying the whole context again.

transformers' ``DynamicLayer`` grows by ``torch.cat``: each step copies every layer's whole cache, a cost growing with
the context that no server pays (vLLM writes each step's keys into its blocks). On the AVX-512 CPU (float32, the
packaged model, both caches in turns in one process) a plain step over this one costs 1.2-1.8 ms less at 256 cached
tokens, 2.9-3.8 at 512, 4.0 at 1,024 (docs/results.md, "Step cost").

``AppendingLayer`` keeps its keys and values in a room longer than they are; ``keys`` and ``values`` are views of the
filled part (so everything that reads a ``DynamicLayer`` reads them alike: their length is the cache's, ``crop`` cuts
the view), and ``update`` writes the new positions after them. Out of room it takes one twice the size (one copy,
amortised: a generation sized up front, as every decoder here sizes it, never grows). The keys and values are the
same numbers a ``DynamicLayer`` holds, in the same layout along a head (a view's rows are a cache's rows), so every
attention path reads them as it read the copies."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class AppendingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of a room (batch, heads, room, dim) written in place."""

    def __init__(self, room: int = 0):
        super().__init__()
        self.wanted = room  #: positions the first update keeps room for (at least those it writes)
        self.key_room: torch.Tensor | None = None
        self.value_room: torch.Tensor | None = None

    def hold(self, key_room: torch.Tensor, value_room: torch.Tensor, length: int) -> None:
        """Take ``key_room`` and ``value_room`` (batch, heads, room, dim), their first ``length`` positions filled."""
        if not self.is_initialized:
            self.lazy_initialization(key_room, value_room)
        self.key_room, self.value_room = key_room, value_room
        self.keys, self.values = key_room.narrow(2, 0, length), value_room.narrow(2, 0, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length = self.get_seq_length()
        end = length + key_states.shape[2]
        if self.key_room is None or end > self.key_room.shape[2]:
            filled = (self.keys, self.values) if length else (key_states[:, :, :0], value_states[:, :, :0])
            self._move(*filled, max(end, self.wanted, 2 * length))
        # narrow and copy_, not indexing: a layer's update and crop 26.2 -> 23.2 us of Python (30 layers a step)
        self.key_room.narrow(2, length, end - length).copy_(key_states)
        self.value_room.narrow(2, length, end - length).copy_(value_states)
        self.keys, self.values = self.key_room.narrow(2, 0, end), self.value_room.narrow(2, 0, end)
        return self.keys, self.values

    def _move(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        """Into a new room of ``room`` positions: ``keys`` and ``values`` (batch, heads, length, dim), the filled part."""
        batch, heads, length, _ = keys.shape
        key_room = keys.new_empty(batch, heads, room, keys.shape[3])
        value_room = values.new_empty(batch, heads, room, values.shape[3])
        key_room[:, :, :length], value_room[:, :, :length] = keys, values
        self.hold(key_room, value_room, length)

    def keep(self, length: int) -> None:
        """Keep the first ``length`` positions (a draft dropping its guesses' slots, a rewind), the room kept."""
        if self.get_seq_length() > length:
            self.keys, self.values = self.keys.narrow(2, 0, length), self.values.narrow(2, 0, length)

    def reset(self) -> None:
        self.key_room = self.value_room = None
        super().reset()

    # a DynamicLayer's batch-wise edits, made to the filled part and kept in a room of the same size
    def _edit_rows(self, edit) -> None:
        if self.get_seq_length() > 0:
            self._move(edit(self.keys), edit(self.values), self.key_room.shape[2])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._edit_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._edit_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._edit_rows(lambda t: t[indices])


class AppendingCache(DynamicCache):
    """A ``DynamicCache`` of ``AppendingLayer``s, one a layer as the model first writes it, each with room for ``room``
    positions (a generation's prompt, reply and largest step: then no step copies the cache)."""

    def __init__(self, room: int = 0):
        Cache.__init__(self, layer_class_to_replicate=lambda: AppendingLayer(room))


def appending_cache_for(backbone, room: int) -> AppendingCache | None:
    """The cache a plain decoding of ``backbone`` steps over (HF ``generate``, prompt lookup, distillation), with room
    for ``room`` positions: an ``AppendingCache`` where the backbone's own would be plain full-attention layers
    (``plain_layers``), else None (the caller keeps the cache transformers makes: a sliding window, a running state)."""
    return AppendingCache(room=room) if plain_layers(backbone) else None


def plain_layers(backbone) -> bool:
    """Whether the cache transformers makes for ``backbone`` is plain full-attention layers alone (exact type
    ``DynamicLayer``): then an ``AppendingCache`` holds what it would, for ``generate`` as for our decoder."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=backbone.config).layers)
