"""PEagleModel: an EAGLE-3 draft that drafts K tokens in one pass (``families/peagle/config.py`` says how).

Training (the training-time test of ``Eagle3Model.chained_steps``, each step a masked slot): step 0 at row ``p``
reads ``x[p + 1]`` and ``fc`` of the backbone's states at ``p``; step ``s >= 1`` reads the mask token and
``fc(mask_hidden)`` at position ``p + s``, attending causally to step 0's keys and to row ``p``'s keys of steps
1 .. s: the slots vLLM lays out after position ``p``. Row ``p`` at step ``s`` guesses ``x[p + s + 2]``, the loss
EAGLE-3 trains with (``families/eagle3/loss.py``).

Decoding: the draft runs once a step over the positions verified since the last step (their keys kept, as
EAGLE-3's) followed by ``depth - 1`` masked slots (their keys dropped after the step): slot ``d`` scores depth
``d + 1``. A slot does not read the tokens guessed before it, so every node at a depth takes its children from the
same slot's ranking: a tree here is a Medusa tree (the ``k``-th best of slot ``d`` at each node), a chain its
top-1 path, as vLLM serves it.
"""

from __future__ import annotations

from functools import partial

import torch

from medusa_train.families.eagle3.decode_state import Eagle3DecodeState
from medusa_train.families.eagle3.model import Eagle3Model, export_eagle3_folder
from medusa_train.families.peagle.config import PEagleConfig


class PEagleModel(Eagle3Model):
    """A causal LM backbone plus a P-EAGLE draft."""

    config_class = PEagleConfig

    def step_inputs(self, s: int, input_ids: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0: EAGLE-3's; every later step a masked slot: the mask token and ``fc(mask_hidden)`` at every row."""
        if s == 0:
            return super().step_inputs(s, input_ids, feature)
        tokens = torch.full_like(input_ids, self.config.mask_token_id)
        return tokens, self.draft.mask_feature().to(feature.dtype).expand_as(feature)

    def new_decode_state(self, room: int | None = None, graphs: bool = False) -> Eagle3DecodeState:
        """Fresh decode-time state for one sequence: the eager one whatever ``room`` and ``graphs`` (its single masked
        pass is not graphed)."""
        return Eagle3DecodeState()

    @torch.no_grad()
    def propose(self, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor, root_token: int,
                state) -> torch.Tensor:
        """(num_nodes,) tokens: the root, then at each depth ``d`` the children's ranks in slot ``d``'s scores; one
        draft pass over the verified positions and ``tree.depth - 1`` masked slots (``Eagle3Model.propose``'s
        arguments)."""
        draft, device = self.draft, accepted_inputs.device
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)
        tokens[0] = root_token
        after = torch.cat([accepted_tokens.to(device).long().reshape(-1)[1:], tokens[:1]])  # the token after each
        masked = max(tree.depth - 1, 0)
        start, verified = state.length, len(after)
        inputs = torch.cat([after, torch.full((masked,), self.config.mask_token_id, dtype=torch.long, device=device)])
        features = draft.features(accepted_inputs)
        features = torch.cat([features, draft.mask_feature().to(features.dtype).expand(masked, -1)])
        positions = torch.arange(start, start + verified + masked, device=device)[None]
        q, k, v, residual = draft.qkv(self._embed(inputs)[None], features[None], positions)
        keys, values = state.cache.update(k, v)  # in place, after the verified positions
        causal = torch.ones(len(inputs), keys.shape[-2], dtype=torch.bool, device=device).tril(start)
        try:
            normed, _ = draft.finish(self._attend(q, keys, values, causal), residual)
        finally:
            state.cache.keep(start + verified)  # the masked slots dropped: written again by the next step
        if tree.depth == 0:
            return tokens
        slots = draft.logits(normed[0, verified - 1:])  # (depth, draft vocab): the root's row, then each masked slot
        _, levels = tree.path_buffers(device)
        for d, (_, children, rows, ranks) in enumerate(levels):
            top = slots[d:d + 1].topk(tree.head_top_k[d], dim=-1).indices
            tokens[children] = self.guessed_tokens(top[torch.zeros_like(rows), ranks])
        return tokens


#: the converter of ``model/family.py``'s row: EAGLE-3's, reading P-EAGLE's config
export_peagle_folder = partial(export_eagle3_folder, config_class=PEagleConfig)
