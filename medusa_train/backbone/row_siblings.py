"""Sibling layers on the row kernel: the linear layers a module applies to one input (a Llama-style attention's query,
key and value projections; its MLP's gate and up projections) in one kernel call.

A decoding step calls the row kernel once a layer: 211 calls a step for SmolLM2-135M, each paying Python, argument
checks, an output allocation and the threads' start and join (~5-10 us on the 2-core CPUs) beside its reads. Three of
a layer's seven linears read the same normed hidden state, and two more another. ``group_siblings(model)`` (called by
``row_layers.use_row_kernel``) gives each such set of ``RowLinear`` layers (same input width, dtype and bias kind) one
``Siblings``: the first of them called with an input runs the kernel once over their weights packed side by side and
hands each of the others its columns when it is called with that same tensor, unchanged since (its object and version
counter); a call with any other input, or one the kernel does not take, is the layer's own. Each output of the kernel
is one lane summing its own weights in order, so a layer's output is bitwise what it was alone (the tests hold it to
that): nothing that reads it changes.

The names of the sets (``SETS``) are transformers' Llama-style ones, kept by Llama, Qwen2/3, Mistral, Gemma and many
more; a model without them keeps one call a layer. The packed side-by-side weights replace the members' own (made only
if a member is ever called alone); they are packed again whenever a member's weight changes, as a layer's are.
"""

from __future__ import annotations

import torch

from medusa_train.backbone.rows import SIBLINGS, RowLinear, _rows_linear, pack_weight, rows_taken

#: the child layers a module applies to one input, by transformers' Llama-style names
SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Siblings:
    """One kernel call for a set of ``RowLinear`` layers that read the same input (``members``, in order); each member
    holds it at ``SIBLINGS`` as ``(siblings, its index)``. A copied or pickled model's members hold None there (their
    sets are made again when it is switched)."""

    def __init__(self, members: list[RowLinear]):
        self.members = members
        self.widths = [m.out_features for m in members]
        self._input: torch.Tensor | None = None  # the input the waiting outputs are of
        self._version = -1
        self._waiting: dict[int, torch.Tensor] = {}
        self._key: tuple | None = None  # the members' weights and biases (object, data, version) packed below
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``index``'s output for ``x``: its columns of the one call over all of them (made now, or by the
        member called first with this ``x``), or None where the kernel does not take the call (then the member runs
        its own)."""
        if x is self._input and x._version == self._version and index in self._waiting:
            return self._waiting.pop(index)
        self.forget()
        rows = None
        for member in self.members:  # every member's weight: none of them trains
            rows = rows_taken(x, member.weight, member.bias)
            if rows is None:
                return None
        self._pack()
        y = _rows_linear(x.reshape(rows, x.shape[-1]), self._packed, sum(self.widths), self._bias)
        parts = y.reshape(*x.shape[:-1], y.shape[-1]).split(self.widths, dim=-1)
        self._input, self._version = x, x._version
        self._waiting = {i: part for i, part in enumerate(parts) if i != index}
        return parts[index]

    def _pack(self) -> None:
        """The members' weights packed side by side (and their biases joined), again whenever one of them is another
        tensor or was written since (its data pointer or version counter): only the packed copy is kept."""
        key = tuple((m.weight, m.weight.data_ptr(), m.weight._version)
                    + ((None,) if m.bias is None else (m.bias, m.bias.data_ptr(), m.bias._version))
                    for m in self.members)
        if self._key is not None and len(key) == len(self._key) and all(
                all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(new, old))
                for new, old in zip(key, self._key)):
            return
        with torch.no_grad():
            self._packed = pack_weight(torch.cat([m.weight.detach() for m in self.members]).contiguous())
            self._bias = (None if self.members[0].bias is None
                          else torch.cat([m.bias.detach() for m in self.members]).contiguous())
        self._key = key

    def forget(self) -> None:
        """Let go of the waiting outputs and their input."""
        self._input, self._version, self._waiting = None, -1, {}

    def __reduce__(self):  # copy.deepcopy and pickle (torch.save of a model): None in the copy, never these buffers
        return _no_siblings, ()


def _no_siblings() -> None:
    return None


def group_siblings(model: torch.nn.Module) -> int:
    """Give each set of ``model``'s ``RowLinear`` children named in ``SETS`` (same input width, dtype, device and bias
    kind; not grouped yet) one ``Siblings``; how many layers are in a set now."""
    grouped = 0
    for module in model.modules():
        for names in SETS:
            members = [getattr(module, n, None) for n in names]
            if not all(type(m) is RowLinear for m in members):
                continue
            first = members[0]
            if all(m.__dict__.get(SIBLINGS, (None,))[0] is not None for m in members):  # grouped already
                grouped += len(members)
                continue
            if not all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                       and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
                       for m in members):
                continue
            siblings = Siblings(members)
            for i, member in enumerate(members):
                member.__dict__[SIBLINGS] = (siblings, i)
            grouped += len(members)
    return grouped


def ungroup(layer: torch.nn.Module) -> None:
    """``layer`` out of its set, if in one (its own call again)."""
    held = layer.__dict__.pop(SIBLINGS, None)
    if held is not None:
        held[0].forget()
