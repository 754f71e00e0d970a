"""The parts of a verify step timed alone (``python -m benchmarks decode``): what a step's cost is made of.

``DecodeSteps`` (``medusa_train/tree/cost.py``) times whole steps, as ``build_tree nodes=auto`` needs;
the breakdown into the heads' candidates, the backbone's tree pass and the LM head is only read here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from medusa_train.decoding.generate import propose, tree_forward
from medusa_train.decoding.tree import TokenTree
from medusa_train.tree.cost import DecodeSteps


class DecodeStepParts(DecodeSteps):
    """``DecodeSteps`` with a verify step's parts as steps of their own, each leaving the state as it found it."""

    def candidates_step(self, tree: TokenTree) -> Callable[[], None]:
        """Only the heads' part of a verify step over ``tree``: their candidates (a step's breakdown)."""

        @torch.no_grad()
        def step():
            tokens = propose(self.model, tree, self.out.draft_inputs[0, -1:], self.prompt[0, -1:], self.root,
                             self.heads_state)
            tokens[-1].item()  # wait for the result, as the tree pass would
            self.heads_state.rewind(self.heads_read)

        return step

    def forward_step(self, tree: TokenTree) -> Callable[[], None]:
        """Only the backbone's pass over ``tree``'s nodes with its mask (no LM head): a step's breakdown."""
        mask, offsets = tree.attention_mask(self.dtype).to(self.device), tree.position_offsets.to(self.device)
        tokens = torch.full((tree.num_nodes,), self.root, device=self.device)

        @torch.no_grad()
        def step():
            tree_forward(self.model, tokens, mask, offsets, self.cache, self.context)
            self.cache.crop(-tree.num_nodes)

        return step

    def lm_head_step(self, nodes: int) -> Callable[[], None]:
        """Only the LM head over ``nodes`` hidden states and their argmax: a step's breakdown."""
        hidden = self.out.hidden_states[0, -1:].expand(nodes, -1).contiguous()

        @torch.no_grad()
        def step():
            self.model.base_logits(hidden).argmax(-1)[-1].item()

        return step
