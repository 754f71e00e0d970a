"""Eagle3Model: an unmodified HF causal LM plus an EAGLE-3 draft, and the draft's proposals for one verify step.

It answers the decoder as ``MedusaModel`` does (``forward``, ``base_logits``, ``new_decode_state``, ``propose``,
``max_depth``), so the tree decoder verifies its guesses the same way. What the draft reads from a verify pass
(``draft_inputs``) is the three hidden states it was trained on, not the final one.

A step drafts as vLLM's EAGLE proposer does: first the draft runs over every position verified since the last step,
each with the token after it (the just-sampled root for the last) and ``fc`` of the backbone's states there, at the
position's own rope index; those keys stay in the draft's cache (so its cache at verified positions always comes
from backbone features). Its last row guesses depth 1. Each deeper node is then fed its token and its parent's
pre-norm output at position ``last verified + depth``, attending to the cache and to its own ancestors' entries
(siblings never see each other); those speculative entries are dropped after the step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from medusa_train.backbone.appending_cache import AppendingLayer
from medusa_train.backbone.load import backbone_reference
from medusa_train.config.check import FileProblem
from medusa_train.families.eagle3.config import D2T_KEY, Eagle3Config
from medusa_train.families.eagle3.decode_state import Eagle3DecodeState, Eagle3StaticState
from medusa_train.model.files import WEIGHTS_NAME, check_tensors, read_config_json, resolve_base_model


@dataclass
class Eagle3Output:
    """Result of ``Eagle3Model.forward``.

    Attributes:
        hidden_states: Final-norm hidden states (batch, seq, hidden): what the LM head reads.
        draft_inputs: The draft's input per position: the three auxiliary hidden states, concatenated (batch, seq, 3H).
        past_key_values: The backbone's KV cache when one was used.
    """

    hidden_states: torch.Tensor
    draft_inputs: torch.Tensor
    past_key_values: object | None = None


class Eagle3Model(nn.Module):
    """A causal LM backbone plus an EAGLE-3 draft reading three of its hidden states."""

    config_class = Eagle3Config  #: the config it is built from and saved with (a variant's, in a subclass)

    def __init__(self, backbone: PreTrainedModel, config: Eagle3Config, token_map: torch.Tensor | None = None):
        super().__init__()
        _check_compatible(backbone, config)
        self.backbone = backbone
        self.config = config
        weight = backbone.get_output_embeddings().weight
        self.draft = config.draft_module(token_map).to(device=weight.device, dtype=getattr(torch, config.dtype))

    @classmethod
    def from_backbone(cls, backbone: PreTrainedModel, token_map: torch.Tensor | None = None,
                      aux_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                      ttt_steps: int = 7, dtype: str = "float32") -> Eagle3Model:
        """A fresh draft for ``backbone`` (its sizes and rope copied; random weights, as EAGLE initialises them).

        Args:
            backbone: A loaded HF causal LM.
            token_map: The draft vocabulary's token ids, ascending (``draft_vocab.most_frequent_tokens``); ``None``:
                the whole vocabulary.
            aux_layer_ids: The three layers read (vLLM's default ``(2, L // 2, L - 3)`` when ``None``).
            intermediate_size: The draft MLP's width (the backbone's when ``None``).
            ttt_steps: Draft steps trained in a chain (training-time test).
            dtype: The draft's weight dtype.
        """
        config = cls.config_class.for_backbone(backbone, None if token_map is None else len(token_map), aux_layer_ids,
                                               intermediate_size, ttt_steps, dtype, backbone_reference(backbone))
        return cls(backbone, config, token_map)

    # ----------------------------------------------------------------------------- what the decoder asks
    @property
    def max_depth(self) -> int:
        return self.config.max_depth

    def draft_modules(self) -> list[nn.Module]:
        """What medusa-train adds to the backbone: the draft."""
        return [self.draft]

    @property
    def lm_head(self) -> nn.Module:
        return self.backbone.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **kwargs) -> Eagle3Output:
        """The backbone's decoder, keeping the hidden states the draft reads."""
        out = self.backbone.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, output_hidden_states=True, **kwargs)
        return Eagle3Output(out.last_hidden_state, self.aux_states(out.hidden_states),
                            getattr(out, "past_key_values", None))

    def aux_states(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The three states the draft reads, from transformers' ``hidden_states`` (input to each layer), ascending."""
        last = hidden_states[-1].device  # with device_map=auto the layers sit on several devices
        return torch.cat([hidden_states[i].to(last) for i in self.config.aux_layer_ids], dim=-1)

    def split_captured(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft_inputs (..., 3H), final hidden states (..., H))`` of what ``eagle3.captured_states`` stored."""
        width = 3 * self.config.hidden_size
        return states[..., :width], states[..., width:]

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def draft_base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's logits over the draft vocabulary (its softmax: the backbone's distribution given that the
        token is one the draft can guess)."""
        weight = self.draft_lm_head_rows()
        return hidden.to(weight.dtype) @ weight.T

    def draft_lm_head_rows(self) -> torch.Tensor:
        """The backbone's LM-head rows of the draft vocabulary (the whole weight, uncopied, for the whole vocabulary)."""
        weight = self.lm_head.weight
        if self.config.draft_vocab_size == self.config.vocab_size and not self.draft.d2t.any():
            return weight
        return weight[self.draft.token_map.to(weight.device)]

    def new_decode_state(self, room: int | None = None, graphs: bool = False) -> Eagle3DecodeState | Eagle3StaticState:
        """Fresh decode-time state for one sequence; ``room``: the most positions it will hold (a static cache's
        length): then its buffers are fixed, sized once (``Eagle3StaticState``), and with ``graphs`` (CUDA) each
        step's passes are replayed from CUDA graphs."""
        if room is None:
            if graphs:
                raise ValueError("a graphed draft replays over fixed buffers: give the room it reads into")
            return Eagle3DecodeState()
        return Eagle3StaticState(self, room, graphs=graphs)

    def guessed_tokens(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of draft outputs ``indices``."""
        return indices + self.draft.d2t[indices]

    @torch.no_grad()
    def propose(self, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor, root_token: int,
                state: Eagle3DecodeState | Eagle3StaticState) -> torch.Tensor:
        """(num_nodes,) tokens: the root, then, depth by depth, the draft's top-k at each node with children, through
        ``state`` (eagerly, ``eager_proposal``, or over fixed buffers: ``decode_state.py``)."""
        return state.propose(self, tree, accepted_inputs, accepted_tokens, root_token)

    def eager_proposal(self, tree, accepted_inputs: torch.Tensor, accepted_tokens: torch.Tensor, root_token: int,
                       state: Eagle3DecodeState) -> torch.Tensor:
        """(num_nodes,) tokens: the root, then, depth by depth, the draft's top-k at each node with children.

        Args:
            tree: The ``TokenTree`` to fill.
            accepted_inputs: (n, 3H) ``draft_inputs`` of the positions verified since the last call (the prompt's
                at the first).
            accepted_tokens: (n,) the tokens at those positions.
            root_token: The backbone's next token (node 0), the token after the last verified position.
            state: ``new_decode_state()`` of this sequence.
        """
        draft = self.draft
        device = accepted_inputs.device
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)
        tokens[0] = root_token
        after = torch.cat([accepted_tokens.to(device).long().reshape(-1)[1:], tokens[:1]])  # the token after each
        start = state.length
        positions = torch.arange(start, start + len(after), device=device)[None]
        q, k, v, residual = draft.qkv(self._embed(after)[None], draft.features(accepted_inputs)[None], positions)
        keys, values = state.cache.update(k, v)
        verified = keys.shape[-2]
        causal = torch.ones(len(after), verified, dtype=torch.bool, device=device).tril(start)
        normed, prenorm = draft.finish(self._attend(q, keys, values, causal), residual)
        if tree.depth == 0:
            return tokens
        try:
            return self._draft_tree(tree, tokens, normed, prenorm, state.cache, start + len(after) - 1)
        finally:
            state.cache.keep(verified)  # the drafted nodes' slots: written again by the next step

    def _draft_tree(self, tree, tokens: torch.Tensor, normed: torch.Tensor, prenorm: torch.Tensor,
                    cache: AppendingLayer, root_position: int) -> torch.Tensor:
        """``propose``'s tree below the root, depth by depth: each depth's nodes with children drafted at once, their
        keys and values written after those in ``cache`` (the verified positions', then the shallower nodes'), each
        node seeing the verified positions and its own drafted ancestors."""
        draft, device = self.draft, tokens.device
        verified = cache.get_seq_length()
        _, levels = tree.path_buffers(device)
        logits = {0: draft.logits(normed[0, -1:])}  # node -> its draft scores (1, draft vocab)
        feature = {0: prenorm[0, -1:]}  # node -> the pre-norm output its children read
        spec_nodes: list[int] = []
        visibility = tree.visibility.to(device)
        for d, (parents, children, rows, ranks) in enumerate(levels):
            if d > 0:  # run the draft on the depth-d nodes that have children
                nodes = parents.tolist()
                q, k, v, residual = draft.qkv(
                    self._embed(tokens[parents])[None],
                    torch.cat([feature[int(tree.parents[n])] for n in nodes])[None],
                    torch.full((1, len(nodes)), root_position + d, device=device))
                spec_nodes += nodes
                keys, values = cache.update(k, v)  # the verified positions, then every node drafted so far
                sees = visibility[parents][:, spec_nodes]  # ancestors-or-self among the drafted
                mask = torch.cat([torch.ones(len(nodes), verified, dtype=torch.bool, device=device), sees], 1)
                normed, prenorm = draft.finish(self._attend(q, keys, values, mask), residual)
                scores = draft.logits(normed[0])
                for i, n in enumerate(nodes):
                    logits[n], feature[n] = scores[i:i + 1], prenorm[0, i:i + 1]
            parent_scores = torch.cat([logits[int(n)] for n in parents.tolist()])
            top = parent_scores.topk(tree.head_top_k[d], dim=-1).indices
            tokens[children] = self.guessed_tokens(top[rows, ranks])
        return tokens

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.backbone.get_input_embeddings()
        return table(tokens.to(table.weight.device)).to(self.draft.fc.weight.device)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention of ``q`` over ``keys``/``values`` where ``allowed`` (queries, keys) is true."""
        draft = self.draft
        return nn.functional.scaled_dot_product_attention(q, draft.group(keys), draft.group(values),
                                                          attn_mask=allowed[None, None])

    # ----------------------------------------------------------------------------- along a text
    def chained_steps(self, aux: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int):
        """Training-time test: the draft chained ``steps`` times along a text, every row at once; yields each step's
        normed output (batch, seq, H), whose row ``p`` at step ``s`` guesses the token at ``p + s + 2``.

        Step 0 at row ``p`` reads ``x[p + 1]`` and ``fc`` of the backbone's states at ``p`` (``aux``), at rope
        position ``p``; step ``s`` reads the text's ``x[p + s + 1]`` (teacher-forced) and step ``s - 1``'s pre-norm
        output at row ``p``, at position ``p + s``, attending causally to step 0's keys and to row ``p``'s keys of
        steps 1 .. s: what a chain drafting after position ``p`` sees when its earlier guesses were the text's."""
        draft, seq = self.draft, input_ids.shape[1]
        feature, keys, values = draft.features(aux.detach()), [], []
        for s in range(steps):
            tokens, feature = self.step_inputs(s, input_ids, feature)
            positions = (torch.arange(seq, device=input_ids.device) + s)[None].expand(input_ids.shape[0], -1)
            with torch.no_grad():
                embeds = self.backbone.get_input_embeddings()(tokens)
            q, k, v, residual = draft.qkv(embeds, feature, positions)
            keys.append(k)
            values.append(v)
            if q.requires_grad:  # its (batch, heads, seq, seq) scores are recomputed in the backward pass, not kept
                attended = checkpoint(chained_attention, draft, q, list(keys), list(values), attention_mask,
                                      use_reentrant=False)
            else:
                attended = chained_attention(draft, q, keys, values, attention_mask)
            normed, feature = draft.finish(attended, residual)
            yield normed

    def step_inputs(self, s: int, input_ids: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chained step ``s``'s tokens and features at every row: the text's ``x[p + s + 1]`` and ``feature`` (the
        backbone's at step 0, the step before's pre-norm output after it)."""
        return nn.functional.pad(input_ids[:, s + 1:], (0, s + 1), value=0), feature

    def draft_indices(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's index among the draft's outputs, -1 for one it never guesses."""
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=tokens.device)
        index[self.draft.token_map.to(tokens.device)] = torch.arange(self.config.draft_vocab_size, device=tokens.device)
        return index[tokens.clamp(min=0)].masked_fill(tokens < 0, -1)

    @torch.no_grad()
    def calibration_scores(self, ids: torch.Tensor, start: int, states: torch.Tensor | None = None):
        """``(depth k, logits (n, draft vocab), target indices (n,))`` along ``ids`` (1, len): the draft's step ``k``
        from positions ``start ..``, its earlier steps given the text's tokens (so its accuracy at depth k is
        conditional on the path so far being right, as a tree's path is walked), and the true token's index;
        ``states``: what the capture stored for ``ids`` (``split_captured``), instead of running the backbone."""
        inputs = self(ids).draft_inputs if states is None else self.split_captured(states)[0].to(ids.device)
        length = ids.shape[1]
        for k, normed in enumerate(self.chained_steps(inputs, ids, torch.ones_like(ids), self.config.ttt_steps)):
            stop = length - k - 2
            if stop <= start:
                continue
            yield k, self.draft.logits(normed[0, start:stop]).float(), self.draft_indices(ids[0, start + k + 2:stop + k + 2])

    # ----------------------------------------------------------------------------- persistence
    def native_files(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """``({file name: tensors}, config.json)``: vLLM's layout, which is also ours."""
        tensors = self.draft.state_dict_for_export()
        config = self.config.to_dict()
        config["torch_dtype"] = str(self.draft.fc.weight.dtype).removeprefix("torch.")
        return {WEIGHTS_NAME: tensors}, config

    def save_pretrained(self, directory: str | os.PathLike, chat_template: str | None = None) -> Path:
        from medusa_train.model.folder import write_heads_folder

        return write_heads_folder(directory, *self.native_files(), chat_template=chat_template)

    def save_as(self, directory: str | os.PathLike, layout: str, chat_template: str | None = None,
                option: str | None = None, **_) -> Path:
        """Its one layout (vLLM's), whichever of ``native`` or ``vllm`` ``layout`` names."""
        from medusa_train.model.folder import write_heads_folder

        return write_heads_folder(directory, *self.native_files(), chat_template=chat_template, option=option)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, backbone: PreTrainedModel | None = None,
                        stored_config: dict | None = None, **backbone_kwargs) -> Eagle3Model:
        """Load a draft written by ``save_pretrained`` (vLLM's EAGLE-3 layout); the backbone its config names unless
        one is given; ``stored_config``: its ``config.json`` when already read. Every tensor must be there with its
        shape (``d2t`` only with a smaller draft vocabulary)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        raw = read_config_json(directory) if stored_config is None else stored_config
        config = cls.config_class.from_dict(raw)
        tensors = load_file(str(directory / WEIGHTS_NAME))
        if backbone is None:
            if not config.base_model_name_or_path:
                raise ValueError(f"{directory}/config.json names no base model; pass backbone=")
            from medusa_train.backbone.load import load_backbone

            backbone, _ = load_backbone(resolve_base_model(directory, config.base_model_name_or_path),
                                        **backbone_kwargs)
        if "medusa_train" not in raw:  # another tool's draft: the backbone's depth is the backbone's
            config.num_target_layers = backbone.config.get_text_config(decoder=True).num_hidden_layers
        d2t = tensors.get("d2t")
        required_tensors(config, tensors, directory)  # before the model is built: a missing d2t would map to 0..N
        token_map = None if d2t is None else d2t.long() + torch.arange(len(d2t))
        model = cls(backbone, config, token_map)
        check_tensors(tensors, required_tensors(config, tensors, directory), str(directory / WEIGHTS_NAME))
        model.draft.load_state_dict(tensors, strict=False)
        return model


def required_tensors(config: Eagle3Config, tensors: dict, directory) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft of ``config`` must hold, with its shape: ``d2t`` may be left out only when the draft scores
    the whole vocabulary (a smaller draft vocabulary without it would propose token ids 0..N-1: refused here, naming
    the file and key)."""
    with torch.device("meta"):  # the shapes its config implies, without allocating them
        expected = {k: tuple(v.shape) for k, v in config.draft_module().state_dict().items()}
    if D2T_KEY not in tensors:
        if config.draft_vocab_size != config.vocab_size:
            raise FileProblem(f"{Path(directory) / WEIGHTS_NAME}: no {D2T_KEY}, the map of its {config.draft_vocab_size:,}"
                              f"-token draft vocabulary to the backbone's {config.vocab_size:,} tokens; export the "
                              "draft again")
        expected.pop(D2T_KEY)
    return expected


def _check_compatible(backbone: PreTrainedModel, config: Eagle3Config) -> None:
    text = backbone.config.get_text_config(decoder=True)
    vocab, hidden = backbone.get_output_embeddings().weight.shape
    problems = [f"{what}: draft {mine}, backbone {theirs}" for what, mine, theirs in (
        ("hidden size", config.hidden_size, hidden), ("vocab size", config.vocab_size, vocab),
        ("layers", config.num_target_layers, text.num_hidden_layers)) if mine != theirs]
    if problems:
        raise ValueError(f"this EAGLE-3 draft does not fit this backbone ({'; '.join(problems)}); it was trained on "
                         f"{config.base_model_name_or_path!r}")


def chained_attention(draft, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                   attention_mask: torch.Tensor) -> torch.Tensor:
    """Training-time test's attention at step ``len(keys) - 1``: causal over step 0's keys (padding masked), and each earlier step's key
    of the same row. Shapes (batch, heads, seq, head_dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = draft.group(keys[0]), draft.group(values[0])
    seq = q.shape[2]
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()[None, None] \
        & attention_mask.bool()[:, None, None, :]
    scores = [(q @ k0.transpose(-1, -2) * scale).float().masked_fill(~allowed, float("-inf"))]
    scores += [((q * draft.group(k)).sum(-1, keepdim=True) * scale).float() for k in keys[1:]]
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(q.dtype)
    out = probs[..., :seq] @ v0
    for j, v in enumerate(values[1:]):
        out = out + probs[..., seq + j:seq + j + 1] * draft.group(v)
    return out


def export_eagle3_folder(draft: str | os.PathLike, output: str | os.PathLike, format: str,
                         config_class: type = Eagle3Config, **_) -> Path:
    """Convert a draft folder to ``format`` (``native`` or ``vllm``: one layout, vLLM's): its files, checked against
    its config and written anew, with the chat template it carries (``export.write.export_folder`` asks the family)."""
    from safetensors.torch import load_file

    from medusa_train.model.folder import read_chat_template, write_heads_folder

    config = read_config_json(draft)
    tensors = load_file(str(Path(draft) / WEIGHTS_NAME))
    check_tensors(tensors, required_tensors(config_class.from_dict(config), tensors, draft),
                  str(Path(draft) / WEIGHTS_NAME))
    return write_heads_folder(output, {WEIGHTS_NAME: tensors}, config, chat_template=read_chat_template(draft),
                              option="output")

