"""What Medusa heads propose for one verify step: the tree filled depth by depth with each head's top-k guesses
(``MedusaModel.propose``; the decoder in ``decoding/generate.py`` verifies them), and what they score along a text
(``MedusaModel.calibration_scores``; ``tree/calibrate.py`` measures rank accuracies from it)."""

from __future__ import annotations

import torch


def heads_candidates(model, tree, accepted_hidden: torch.Tensor, root_token: int | torch.Tensor,
                     heads_state) -> torch.Tensor:
    """(num_nodes,) tokens: the root, then, depth by depth, each node's head's top-k guess at its rank
    (a token of the heads' draft vocabulary when they have one): the heads read the accepted positions
    (``heads_state.read``), then guess (``heads_guesses``).

    Args:
        model: A ``MedusaModel``.
        tree: The ``TokenTree``.
        accepted_hidden: (n, hidden) final hidden states of the positions accepted since the last
            step (the prompt at the first step).
        root_token: The base model's next token (node 0).
        heads_state: ``model.new_decode_state()`` of this sequence.
    """
    heads_state.read(model, accepted_hidden)
    return heads_guesses(model, tree, root_token, heads_state)


def heads_guesses(model, tree, root_token: int | torch.Tensor, heads_state) -> torch.Tensor:
    """(num_nodes,) tokens from what the heads read at the last accepted position (``heads_state.last``).

    Head d reads the path to each depth-d node that has children (root first) and its top-k fill
    those children. The model decides what the heads read (``MedusaModel.head_features``); when no
    guess follows the path before it, every head is asked at once. Every shape is the tree's and every
    index a buffer made once (``tree.path_buffers``): a CUDA graph replays it (``decode_state.py``).
    """
    device = heads_state.last.device
    tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)
    tokens[0] = root_token
    ancestors, levels = tree.path_buffers(device)
    if not levels:  # nothing to guess (the heads have read the accepted positions: their own cache, if any)
        return tokens
    if not model.guesses_follow_path:  # every head at once: one LM-head read when it is shared
        features = model.head_features(None, tokens[:1, None], heads_state)
        logits = model.all_head_logits(features, len(levels))  # (depth, 1, vocab)
        for d, (_, children, _, ranks) in enumerate(levels):
            tokens[children] = model.guessed_tokens(logits[d, 0].topk(tree.head_top_k[d]).indices[ranks])
        return tokens
    for d, (parents, children, rows, ranks) in enumerate(levels):
        paths = tokens[ancestors[parents, : d + 1]]  # (parents, d + 1): root, then the guesses on the way
        features = model.head_features(None, paths, heads_state)
        top = model.head_logits(features, d).topk(tree.head_top_k[d], dim=-1).indices
        tokens[children] = model.guessed_tokens(top[rows, ranks])
    return tokens


@torch.no_grad()
def heads_calibration_scores(model, ids: torch.Tensor, start: int, states: torch.Tensor | None = None):
    """``(k, logits (n, heads' vocab), target indices (n,))`` per head ``k`` along ``ids`` (1, len): head k's scores
    at positions ``start ..`` (the hidden state at t guesses the token at t + k + 2, reading the text's own next
    tokens) and the index of that token among its outputs (-1: one it never guesses); ``states``: the final hidden
    states of ``ids`` as captured (1, len, H), instead of running the backbone."""
    hidden = (model(ids).hidden_states if states is None else states.to(model.lm_head.weight.device))[0]
    inputs = model.head_features(hidden[:-1], ids[0, 1:])  # the next token is the text's own
    length = ids.shape[1]
    for k in range(model.config.num_heads):
        stop = length - k - 2
        if stop <= start:
            continue
        logits = model.head_logits(inputs[start:stop], k).float()
        yield k, logits, model.head_indices(ids[0, start + k + 2: stop + k + 2].to(logits.device))
