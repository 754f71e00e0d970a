"""Medusa tree decoding: prefill -> candidates -> one verify pass over the tree -> accept -> KV compaction.

Works with any Hugging Face causal LM whose decoder takes a 4D additive attention mask, explicit
``position_ids`` and a ``DynamicCache`` (checked: Llama, Qwen2, GPT-NeoX; "sdpa" and "eager").

Limits: batch size 1. The cache is a ``DynamicCache`` of full-attention layers that appends each step in place
(``kv_cache="dynamic"``, ``backbone/appending_cache.py``: the cache HF ``generate`` steps over here too) or a
``StaticCache`` sized once for the whole generation (``kv_cache="static"``: every step reads and writes the same
buffers, what CUDA graphs need; accepted nodes are compacted into place as in the dynamic one, stale slots past
the text are masked), and the tree mask is fully causal, so models with sliding-window layers are refused once
the context could exceed the window; backbones with a running state (linear attention, convolutions, Mamba) are
refused outright (``decoding/cache.py``). Greedy output is token-identical to ``generate`` in float32; in half precision
the tree pass rounds differently from a one-token pass, so a near-tie can (rarely) flip.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from medusa_train.backbone.generation import eos_token_ids
from medusa_train.decoding.acceptance import ACCEPTANCE_METHODS, accept, first_token
from medusa_train.decoding.cache import new_cache
from medusa_train.decoding.graphs import StaticSteps
from medusa_train.decoding.lookup import LookupChain
from medusa_train.decoding.tree import TokenTree, fill_step_mask, tree_from_config

# the verify step's phases, in the order the loop runs them (``tree_generate``'s ``wrap_phase`` sees these names)
PHASES = ("candidates", "tree pass", "LM head", "acceptance", "compaction")


@dataclass
class TreeGenerateOutput:
    """Result of ``tree_generate``.

    Attributes:
        sequences: (1, prompt_len + new_tokens) prompt followed by the generated tokens.
        new_tokens: Number of generated tokens.
        accept_lengths: Tokens gained per verify step (each >= 1; the last one may be cut short by
            eos or ``max_new_tokens``, and also counts the token it chose after its path when that one ends
            the generation: emitting it takes no forward). ``sum(accept_lengths) == new_tokens``.
        accepted_depths: Per verify step, how many head guesses the acceptance rule kept (the depth
            of the accepted node, before any cut by eos or ``max_new_tokens``): head k's guess was kept
            in a step exactly when its accepted depth is > k. 0 in a step that kept the lookup chain.
        lookup_depths: Per verify step, how many lookup tokens were kept (0 in a step that kept head
            guesses, and every step of a tree without a lookup chain).
        steps: Number of verify steps (= tree forward passes after the prefill).
        timings: ``prefill_s`` and ``decode_s`` (seconds, wall clock, device synchronised).
        tree_nodes: Number of nodes in the tree that was used.
    """

    sequences: torch.Tensor
    new_tokens: int
    accept_lengths: list[int]
    accepted_depths: list[int]
    steps: int
    timings: dict[str, float] = field(default_factory=dict)
    tree_nodes: int = 0
    lookup_depths: list[int] = field(default_factory=list)

    @property
    def written_per_step(self) -> list[int]:
        """Per verify step, the tokens its forward pass wrote: its accepted guesses and the token it chose after them,
        as far as the reply goes (``accept_lengths`` credits each step with its root, written by the pass before it,
        the prefill's for the first, and the last step with the root after it). Sums to ``new_tokens - 1``, the
        reply's tokens after its first, which is what evaluate's rows divide by the steps and what the walk along
        the same text counts step by step (``model/walk.py`` ``walked_steps``)."""
        return [*self.accept_lengths[:-1], self.accept_lengths[-1] - 1] if self.accept_lengths else []

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens gained per verify step (0.0 when no step ran)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def head_acceptance_rates(self, num_heads: int | None = None) -> list[float]:
        """Per head, the fraction of verify steps in which that head's guess was accepted.

        Args:
            num_heads: How many heads to report (default: the deepest accepted depth seen).
        """
        if num_heads is None:
            num_heads = max(self.accepted_depths, default=0)
        steps = max(len(self.accepted_depths), 1)
        return [sum(d > k for d in self.accepted_depths) / steps for k in range(num_heads)]


@torch.no_grad()
def tree_generate(model, input_ids: torch.Tensor, tree: TokenTree | str, max_new_tokens: int = 128,
                    temperature: float = 0.0, acceptance: str = "greedy", top_p: float = 1.0,
                    typical_threshold: float = 0.09, typical_alpha: float = 0.3,
                    eos_token_id: int | Iterable[int] | None = None,
                    generator: torch.Generator | None = None,
                    wrap_phase: Callable[[str, Callable], Callable] | None = None,
                    kv_cache: str = "dynamic", cuda_graphs: bool = False,
                    steps: StaticSteps | None = None) -> TreeGenerateOutput:
    """Generate with Medusa heads and tree attention (batch size 1).

    Each step runs the backbone once over every tree node (a 4D additive mask lets each node see
    the cache and its own ancestors only, at position ``cache_len + depth``), keeps the longest
    accepted root-to-leaf path, moves the accepted nodes' keys/values into place in the cache and
    drops the rest (no second forward over accepted tokens).

    Args:
        model: A ``MedusaModel`` in eval mode (dropout would break the greedy parity).
        input_ids: (1, prompt_len) prompt token ids (a 1D tensor is taken as one sequence).
        tree: A ``TokenTree`` or the name of one (see ``TokenTree.from_name``). A tree with a lookup chain
            also guesses from the text so far (prompt and generated tokens; ``decoding.lookup``).
        max_new_tokens: Exactly this many tokens are generated unless eos comes first.
        temperature: 0 for greedy; > 0 samples (``typical``, ``rejection``).
        acceptance: ``greedy`` (lossless), ``typical`` (lossy, Medusa's typical acceptance) or
            ``rejection`` (recursive rejection sampling, keeps the base model's sampling distribution).
            Every rule is greedy at ``temperature == 0``.
        top_p: Nucleus filter of the sampling distribution (``typical`` and ``rejection``).
        typical_threshold: Probability cap of typical acceptance.
        typical_alpha: Entropy factor of typical acceptance.
        eos_token_id: Token id(s) that end generation (kept in the output, nothing after them).
            Default: the backbone's ``generation_config`` (or ``config``) eos; an empty list disables it.
        generator: Random generator on the model's device, for sampling.
        wrap_phase: A measurement's hook (e.g. ``python -m benchmarks loop`` timing each phase): called once
            with each phase's name (``PHASES``) and function, it returns what the loop calls instead. None
            (the default): the phases run as they are, at no cost.
        kv_cache: ``dynamic`` (grows each step, in place) or ``static`` (``KV_CACHES``; the draft's state then keeps
            fixed buffers of the cache's length where its family has them): the same tokens either way.
        cuda_graphs: On CUDA with ``kv_cache="static"``: capture the backbone's pass once per tree size and replay
            it (``decoding/graphs.py``), for this generation only.
        steps: A ``StaticSteps`` kept across generations (its static cache, and its graphs when it has them,
            captured once for all of them): what an evaluation decodes every prompt with; ``kv_cache`` and
            ``cuda_graphs`` are then its own.

    Returns:
        A ``TreeGenerateOutput``.

    Raises:
        ValueError: batch size is not 1, the tree needs more heads than the model has, or an
            argument is out of range.
    """
    tree = tree if isinstance(tree, TokenTree) else tree_from_config(tree, num_heads=model.max_depth)
    input_ids = _check_arguments(model, input_ids, tree, max_new_tokens, temperature, acceptance, top_p)
    eos = set(eos_token_ids(model.backbone, override=eos_token_id))
    device = model.backbone.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    prompt_len = input_ids.shape[1]
    _check_context(model.backbone, prompt_len + max_new_tokens + tree.num_nodes)
    if max_new_tokens == 0:
        return TreeGenerateOutput(input_ids.clone(), 0, [], [], 0, {"prefill_s": 0.0, "decode_s": 0.0},
                                    tree.num_nodes)

    sampling = dict(temperature=temperature, top_p=top_p, generator=generator)
    start = _now(device)
    if steps is None and cuda_graphs:
        if kv_cache != "static":
            raise ValueError("CUDA graphs replay over fixed buffers: decode with kv_cache='static'")
        steps = StaticSteps(model, graphs=True)
    needed = prompt_len + max_new_tokens + tree.num_nodes
    cache = steps.cache_for(needed) if steps is not None else new_cache(kv_cache, model.backbone, needed)
    out = model(input_ids, past_key_values=cache, use_cache=True)
    # what the draft keeps between steps (e.g. its own cache): with a static cache, over fixed buffers of its length
    draft_state = steps.draft_state() if steps is not None else model.new_decode_state(
        room=needed if kv_cache == "static" else None)
    accepted_inputs, accepted_tokens = out.draft_inputs[0], input_ids[0]  # the positions the draft has not read yet
    next_token = first_token(model.base_logits(out.hidden_states[:, -1])[0], acceptance, **sampling)
    # the text so far with the root (the token just decided), indexed for the lookup chain
    context = LookupChain(tree.lookup_ngram[1], tree.lookup_ngram[0], [*input_ids[0].tolist(), next_token]) \
        if tree.lookup_depth else None
    prefill_s = _now(device) - start

    candidates, forward, lm_head, accept_nodes, compact = _phases(
        model, wrap_phase, *((None, None) if steps is None else (steps.backbone_pass, steps.compaction)))
    offsets = tree.position_offsets.to(device)
    tree_mask = tree.attention_mask(out.hidden_states.dtype).to(device)
    generated: list[int] = []
    accept_lengths: list[int] = []
    accepted_depths: list[int] = []
    lookup_depths: list[int] = []
    past_len = prompt_len
    while True:
        if accept_lengths and (len(generated) + 1 >= max_new_tokens or next_token in eos):
            # the last token is the root, the base model's own, known from the last step: emitting it takes no
            # forward (nor does it in generate or an engine), so the last step is credited with it
            generated.append(next_token)
            accept_lengths[-1] += 1
            break
        tokens, valid = candidates(model, tree, accepted_inputs, accepted_tokens, next_token, draft_state, context)
        verified = forward(model, tokens, tree_mask, offsets, cache, past_len)  # = verify_tree, phase by phase
        logits = lm_head(verified.hidden_states[0])
        result = accept_nodes(acceptance, tree, tokens, logits, typical_threshold=typical_threshold,
                              typical_alpha=typical_alpha, valid=valid, **sampling)
        by_lookup = tree.node_lookup[result.path[-1]] >= 0  # the path kept is the lookup chain's
        accepted_depths.append(0 if by_lookup else len(result.path) - 1)
        lookup_depths.append(len(result.path) - 1 if by_lookup else 0)
        new = tokens[result.path].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), None)  # eos is kept, nothing after it
        keep, done = (len(new), False) if cut is None else (cut, True)
        if len(generated) + keep >= max_new_tokens:
            keep, done = max_new_tokens - len(generated), True
        generated += new[:keep]
        accept_lengths.append(keep)
        if done:
            break
        compact(cache, past_len, result.path)
        past_len += len(result.path)
        accepted_inputs, accepted_tokens = verified.draft_inputs[0][result.path], tokens[result.path]
        next_token = result.next_token
        if context is not None:
            context.extend([*new[1:], next_token])
    decode_s = _now(device) - start - prefill_s

    sequences = torch.cat([input_ids, torch.tensor([generated], dtype=input_ids.dtype, device=device)], dim=1)
    return TreeGenerateOutput(sequences, len(generated), accept_lengths, accepted_depths, len(accept_lengths),
                                {"prefill_s": prefill_s, "decode_s": decode_s}, tree.num_nodes, lookup_depths)


def _phases(model, wrap_phase: Callable[[str, Callable], Callable] | None,
            backbone_pass: Callable | None = None, compaction: Callable | None = None) -> tuple[Callable, ...]:
    """The functions of the verify step's ``PHASES``, each through ``wrap_phase`` when one is given
    (``backbone_pass``, ``compaction``: graphed ones in place of ``tree_pass`` and ``compact_cache``)."""
    functions = (candidates, backbone_pass or tree_pass, model.base_logits, accept, compaction or compact_cache)
    return functions if wrap_phase is None else tuple(wrap_phase(n, f) for n, f in zip(PHASES, functions))


def compact_cache(cache: DynamicCache | StaticCache, past_len: int, path: list[int]) -> None:
    """Keep only the accepted tree nodes' keys/values: move node ``path[i]`` to slot ``past_len + i``
    along the sequence dim, then crop the cache to ``past_len + len(path)`` (a static cache: its length set
    there, the slots after it left to be overwritten and masked)."""
    if path != list(range(len(path))):  # a prefix of the node order is already in place
        index = torch.tensor(path, device=cache.layers[0].keys.device) + past_len
        for layer in cache.layers:
            if not hasattr(layer, "keys") or getattr(layer, "is_sliding", False):
                raise NotImplementedError(f"cannot compact a {type(layer).__name__} cache layer")
            # index_select copies first, so the overlapping write is safe
            layer.keys[..., past_len: past_len + len(path), :] = layer.keys.index_select(-2, index.to(layer.keys.device))
            layer.values[..., past_len: past_len + len(path), :] = layer.values.index_select(
                -2, index.to(layer.values.device))
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            layer.cumulative_length.fill_(past_len + len(path))  # in place: a captured graph reads it there
        return
    surplus = cache.get_seq_length() - (past_len + len(path))
    if surplus > 0:
        cache.crop(-surplus)  # transformers 5.x: a negative count is the number of tokens to drop


def verify_tree(model, tokens: torch.Tensor, tree_mask: torch.Tensor, offsets: torch.Tensor, cache: DynamicCache,
                past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of every tree node after ``past_len`` cached tokens.

    Args:
        model: A ``MedusaModel``.
        tokens: (num_nodes,) candidate tokens.
        tree_mask: (num_nodes, num_nodes) additive tree mask (``TokenTree.attention_mask``) in the
            model's activation dtype; every node also sees the whole cache.
        offsets: (num_nodes,) node depths; positions are ``past_len + depth``.
        cache: The cache holding ``past_len`` tokens; the nodes' keys/values are appended to it.
        past_len: Number of cached tokens.

    Returns:
        Hidden states (num_nodes, hidden) and base logits (num_nodes, vocab) at every node.
    """
    hidden = tree_forward(model, tokens, tree_mask, offsets, cache, past_len)
    return hidden, model.base_logits(hidden)


def tree_forward(model, tokens: torch.Tensor, tree_mask: torch.Tensor, offsets: torch.Tensor, cache: DynamicCache,
                 past_len: int) -> torch.Tensor:
    """The backbone's pass of ``verify_tree`` alone: (num_nodes, hidden) final hidden states, no LM head."""
    return tree_pass(model, tokens, tree_mask, offsets, cache, past_len).hidden_states[0]


def tree_pass(model, tokens: torch.Tensor, tree_mask: torch.Tensor, offsets: torch.Tensor, cache: DynamicCache,
              past_len: int):
    """The backbone's pass over the tree: the model's output (``hidden_states``, and ``draft_inputs``: what its
    draft reads at each node), batch of one."""
    static = isinstance(cache, StaticCache)
    if tokens.shape[0] == 1 and not static:  # the root alone: a plain step, whose causal mask the model builds faster
        out = model(tokens[None], position_ids=(past_len + offsets)[None], past_key_values=cache, use_cache=True)
    else:  # (batch, 1, query, keys): a static cache's keys are all its slots
        width = cache.layers[0].max_cache_len if static else past_len + tokens.shape[0]
        mask = torch.empty(tokens.shape[0], width, dtype=tree_mask.dtype, device=tree_mask.device)
        out = model(tokens[None], attention_mask=fill_step_mask(mask, tree_mask, past_len)[None, None],
                    position_ids=(past_len + offsets)[None], past_key_values=cache, use_cache=True)
    return out



def candidates(model, tree: TokenTree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor,
               root_token: int, state, context: LookupChain | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(num_nodes,) candidate tokens for one verify step and which nodes hold a guess (``None``: all).

    The draft fills the heads' nodes (``propose``; a tree with none never asks it); a lookup chain gets what followed
    the text's last tokens earlier in it (``context``), and its nodes past what lookup found carry the root token as
    filler and are marked as holding none, so acceptance never keeps them."""
    tokens = propose(model, tree.heads_tree, accepted_inputs, accepted_tokens, root_token, state)
    if not tree.lookup_depth:
        return tokens, None
    found = context.propose(tree.lookup_depth)
    chain = torch.tensor(found + [root_token] * (tree.lookup_depth - len(found)), dtype=tokens.dtype,
                         device=tokens.device)
    valid = torch.arange(tree.num_nodes) < tree.num_head_nodes + len(found)
    return torch.cat([tokens, chain]), valid


def propose(model, tree: TokenTree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor, root_token: int,
            state) -> torch.Tensor:
    """(num_nodes,) candidate tokens for one verify step: the model's draft fills the tree (``model.propose``:
    Medusa heads, or an EAGLE-3 draft), the decoder never asks which. A tree of the root alone (a plain step, or the
    heads' part of a lookup chain alone) never asks the draft, which then reads nothing either: such a step costs
    what a decoder without a draft pays (the draft's state is read by nothing else in the generation).

    Args:
        model: A ``MedusaModel`` or ``Eagle3Model``.
        tree: The tree.
        accepted_inputs: (n, ...) ``draft_inputs`` of the positions verified since the last step (the prompt's at
            the first step).
        accepted_tokens: (n,) the tokens at those positions.
        root_token: The base model's next token (node 0).
        state: ``model.new_decode_state()`` of this sequence.
    """
    if tree.num_nodes == 1:
        return torch.tensor([root_token], dtype=torch.long, device=accepted_inputs.device)
    return model.propose(tree, accepted_inputs, accepted_tokens, root_token, state)


def _check_arguments(model, input_ids, tree, max_new_tokens, temperature, acceptance, top_p) -> torch.Tensor:
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    problems = []
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        problems.append(f"input_ids has shape {tuple(input_ids.shape)}: tree_generate decodes one "
                        "sequence at a time (batch size 1); loop over the batch")
    elif input_ids.shape[1] == 0:
        problems.append("input_ids is empty: the prompt needs at least one token")
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if temperature < 0:
        problems.append(f"temperature={temperature}: must be >= 0")
    if acceptance not in ACCEPTANCE_METHODS:
        problems.append(f"acceptance={acceptance!r}: must be one of {list(ACCEPTANCE_METHODS)}")
    if not 0 < top_p <= 1:
        problems.append(f"top_p={top_p}: must be in (0, 1]")
    vocab = model.config.head_vocab_size
    if tree.head_top_k and max(tree.head_top_k) > vocab:
        problems.append(f"the tree reads top-{max(tree.head_top_k)} guesses but the heads score {vocab} tokens")
    if problems:
        raise ValueError("; ".join(problems))
    tree.check_num_heads(model.max_depth)
    return input_ids


def _check_context(backbone, length: int) -> None:
    """Sliding-window layers are not masked by the tree mask: refuse contexts that would reach the window."""
    config = backbone.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    if window and "sliding_attention" in (getattr(config, "layer_types", None) or []) and length > window:
        raise NotImplementedError(
            f"this model uses sliding-window attention (window {window}) and prompt + max_new_tokens + tree "
            f"nodes = {length} exceeds it; tree_generate applies full causal attention")


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
