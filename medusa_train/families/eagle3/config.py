"""An EAGLE-3 draft: one decoder layer on three of the backbone's hidden states, what vLLM serves at full strength.

The draft reads, at position ``p``, the embedding of the token after ``p`` and a feature: ``fc`` of the residual
stream entering three of the backbone's layers (``Eagle3Config.aux_layer_ids``, transformers' ``hidden_states[i]``)
at its first step, its own previous *pre-norm* output at every later step. Its one layer attends over
``[input_layernorm(embedding); hidden_norm(feature)]`` (2H wide) with the backbone's rope, adds the feature as the
residual, runs a gated MLP, and ``norm`` + ``lm_head`` score the draft vocabulary (draft id ``i`` is token
``i + d2t[i]``). This is the layout vLLM 0.32 loads (``LlamaForCausalLMEagle3``): the tensor names of
``Eagle3Draft.state_dict()`` are vLLM's, the target's embedding is shared (none stored).

Attention is the caller's: decoding attends over a KV cache (``families/eagle3/model.py``), training over the steps of
training-time test (``families/eagle3/loss.py``). ``Eagle3Draft.qkv`` and ``Eagle3Draft.finish`` are the layer
before and after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import nn

from medusa_train.backbone.attention import head_dim_of
from medusa_train.model.contract import CapturedStates, SharedStart

FORMAT = "eagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"
D2T_KEY = "d2t"


@dataclass
class Eagle3Config:
    """What an EAGLE-3 draft needs to be rebuilt and attached to its backbone (the backbone's sizes, copied).

    Attributes:
        hidden_size: The backbone's hidden size (the draft's too).
        num_attention_heads: Query heads of the draft's attention (the backbone's).
        num_key_value_heads: Key/value heads (the backbone's).
        head_dim: Width of one attention head.
        intermediate_size: Width of the draft's MLP.
        vocab_size: The backbone's vocabulary.
        draft_vocab_size: Tokens the draft scores (the most frequent training targets; ``d2t`` maps them back).
        aux_layer_ids: The three backbone layers whose entering residual stream the draft reads, ascending
            (vLLM's count: transformers' ``hidden_states[i]``).
        num_target_layers: The backbone's decoder layers.
        rms_norm_eps: The backbone's RMSNorm epsilon.
        rope_parameters: The backbone's rope (``rope_type``, ``rope_theta``, scaling), used by the draft as is.
        max_position_embeddings: The backbone's context length.
        hidden_act: The MLP's activation.
        ttt_steps: Draft steps it was trained to chain (training-time test); decoding may chain more.
        base_model_name_or_path: The backbone the draft was trained on.
        dtype: Dtype the weights were saved in.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    ttt_steps: int = 7
    base_model_name_or_path: str | None = None
    dtype: str = "float32"

    def __post_init__(self):
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        problems = []
        if len(self.aux_layer_ids) != 3 or sorted(set(self.aux_layer_ids)) != self.aux_layer_ids:
            problems.append(f"eagle3.aux_layer_ids={self.aux_layer_ids}: must be three distinct layers, ascending")
        elif not (0 <= self.aux_layer_ids[0] and self.aux_layer_ids[-1] < self.num_target_layers):
            problems.append(f"eagle3.aux_layer_ids={self.aux_layer_ids}: the backbone's layers are 0 to "
                            f"{self.num_target_layers - 1}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"eagle3.draft_vocab_size={self.draft_vocab_size}: must be between 1 and the backbone's "
                            f"{self.vocab_size} tokens")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"{self.num_attention_heads} attention heads do not group over "
                            f"{self.num_key_value_heads} key/value heads")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def depth(self) -> int:
        """The depth it drafts to by default (a chain's length, vLLM's K): the chained steps it was trained on."""
        return self.ttt_steps

    max_depth = depth  #: how deep a tree the decoder asks the draft for (vLLM's K may be more)

    @staticmethod
    def depth_in(config: dict) -> int:
        """The trained chain a draft's ``config.json`` states (ours or another tool's)."""
        return Eagle3Config.from_dict(config).depth

    vllm_method = FORMAT  #: vLLM's ``--speculative-config`` method that serves it
    vllm_options = {}  #: nothing else in its ``--speculative-config`` (a class constant, never changed)
    draft_name = "the EAGLE-3 draft"  #: what proposes the tree's tokens, in reports
    vllm_export_differs = False  #: vLLM serves exactly this draft (its layout is ours)

    def native_only_features(self) -> dict[str, str]:
        """Nothing only our decoder holds: vLLM serves the draft as it is."""
        return {}

    def layout_problem(self, layout: str) -> str | None:
        """None: its one layout is vLLM's, which ``native`` and ``vllm`` both name."""
        return None

    def draft_module(self, token_map: torch.Tensor | None = None) -> nn.Module:
        """The draft's weights and layer for this config (a variant's own module in a subclass)."""
        return Eagle3Draft(self, token_map)

    @property
    def head_vocab_size(self) -> int:
        """How many tokens one draft step scores (the decoder's top-k cannot ask for more)."""
        return self.draft_vocab_size

    def layer_weights(self) -> int:
        """The weights one draft step reads except its output layer's: ``fc``, the layer, the norms."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 4 * h

    @classmethod
    def for_backbone(cls, backbone, draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None,
                     intermediate_size: int | None = None, ttt_steps: int = 7, dtype: str = "float32",
                     base_model_name_or_path: str | None = None) -> Eagle3Config:
        """A draft config copying ``backbone``'s sizes and rope; aux layers default to vLLM's ``(2, L // 2, L - 3)``."""
        text = backbone.config.get_text_config(decoder=True)
        layers = text.num_hidden_layers
        heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                           "rope_theta": getattr(text, "rope_theta", 10000.0)}
        return cls(hidden_size=text.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=head_dim_of(backbone),
                   intermediate_size=intermediate_size or text.intermediate_size,
                   vocab_size=backbone.get_output_embeddings().weight.shape[0],
                   draft_vocab_size=draft_vocab_size or backbone.get_output_embeddings().weight.shape[0],
                   aux_layer_ids=sorted(aux_layer_ids) if aux_layer_ids else default_aux_layers(layers),
                   num_target_layers=layers, rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
                   rope_parameters=dict(rope), max_position_embeddings=text.max_position_embeddings,
                   hidden_act=getattr(text, "hidden_act", "silu"), ttt_steps=ttt_steps, dtype=dtype,
                   base_model_name_or_path=base_model_name_or_path)

    def to_dict(self) -> dict:
        """``config.json``: what vLLM reads (``LlamaForCausalLMEagle3``, one layer), and ours under ``medusa_train``."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "hidden_act": self.hidden_act,
                "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "rope_parameters": self.rope_parameters, "tie_word_embeddings": False, "attention_bias": False,
                "torch_dtype": self.dtype, "base_model_name_or_path": self.base_model_name_or_path,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.aux_layer_ids, "use_aux_hidden_state": True},
                "medusa_train": {"format": FORMAT, "num_target_layers": self.num_target_layers,
                                 "ttt_steps": self.ttt_steps}}

    @classmethod
    def from_dict(cls, data: dict) -> Eagle3Config:
        """From a ``config.json`` (ours, or another tool's EAGLE-3 draft: the backbone's layer count then comes from
        its aux layer ids' default only when it names them).

        Raises:
            ValueError: a size it needs is missing, naming them.
        """
        needed = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in needed if k not in data]
        ours = data.get("medusa_train") or {}
        layers = ours.get("num_target_layers") or data.get("target_layer_count")
        if layers is None and not (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
            missing.append("medusa_train.num_target_layers (or eagle_config.eagle_aux_hidden_state_layer_ids)")
        if missing:
            raise ValueError(f"this EAGLE-3 config.json lacks {', '.join(missing)}: it cannot be rebuilt here")
        data = {"num_key_value_heads": data["num_attention_heads"],
                "head_dim": data["hidden_size"] // data["num_attention_heads"],
                "draft_vocab_size": data["vocab_size"], **data}
        values = {**data, **ours, "dtype": data.get("torch_dtype", "float32"),
                  "aux_layer_ids": (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")}
        if layers is None:  # another tool's draft: the backbone's depth is checked against the backbone at load
            values["num_target_layers"] = max(values["aux_layer_ids"]) + 1
        if values["aux_layer_ids"] is None:
            values["aux_layer_ids"] = default_aux_layers(values["num_target_layers"])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def is_eagle3_config(data: dict) -> bool:
    """Whether a ``config.json`` is an EAGLE-3 draft's (vLLM's ``LlamaForCausalLMEagle3``)."""
    return ARCHITECTURE in (data.get("architectures") or []) or (data.get("medusa_train") or {}).get("format") == FORMAT


def eagle3_layout(config: dict) -> str | None:
    """``vllm`` for an EAGLE-3 draft's ``config.json`` (its one layout, vLLM's, is also ours); None for anything else
    (``model.family.family_of`` asks)."""
    return "vllm" if is_eagle3_config(config) else None


def eagle3_captured(settings) -> CapturedStates:
    """What a capture stores for an EAGLE-3 draft of ``settings`` (the ``eagle3`` section): the three states it reads,
    then the final one, and the token ids; its settings key names them (Medusa's keys stay as they were)."""
    return CapturedStates(lambda backbone: captured_states(backbone, settings.aux_layer_ids), keep_tokens=True,
                          key={"states": "eagle3: aux hidden states, then the final one; token ids",
                               "aux_layer_ids": settings.aux_layer_ids or "default (2, L//2, L-3)"})


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default for Llama: the residual stream entering layers 2, L // 2 and L - 3 (three distinct layers from
    L = 7 on; a shallower backbone needs its layers named)."""
    layers = sorted({2, num_layers // 2, num_layers - 3})
    if len(layers) != 3 or layers[0] < 0:
        raise ValueError(f"a backbone of {num_layers} layers has no three distinct default layers (2, L // 2, L - 3) "
                         "for an EAGLE-3 draft to read: name three with eagle3.aux_layer_ids=[a,b,c]")
    return layers


class RMSNorm(nn.Module):
    """Llama's RMSNorm, in float32 inside (as transformers and vLLM compute it)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class Eagle3Draft(nn.Module):
    """The draft's weights (vLLM's names) and its layer, split around the attention the caller runs."""

    def __init__(self, config: Eagle3Config, token_map: torch.Tensor | None = None):
        """``token_map``: the draft vocabulary's token ids, ascending (``None``: the whole vocabulary)."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        c = self.config = config
        if c.hidden_act != "silu":
            raise ValueError(f"an EAGLE-3 draft with hidden_act={c.hidden_act!r}: only silu is built here")
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if token_map is None:
            token_map = torch.arange(c.draft_vocab_size)
        if token_map.shape != (c.draft_vocab_size,):
            raise ValueError(f"a token map of {tuple(token_map.shape)} for a {c.draft_vocab_size}-token draft vocabulary")
        self.register_buffer(D2T_KEY, token_map.long() - torch.arange(c.draft_vocab_size), persistent=True)
        rope = LlamaRotaryEmbedding(config=LlamaConfig(
            hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(c.rope_parameters)))
        # float32 frequencies kept outside the module's state, so casting the draft to bf16 never rounds them
        self._rope = (rope.inv_freq.detach().float().clone(), float(rope.attention_scaling))

    # ----------------------------------------------------------------------------- vocabulary
    @property
    def token_map(self) -> torch.Tensor:
        """(draft vocab,) the token id of each draft output."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """The tensors vLLM loads (``d2t`` only with a smaller draft vocabulary)."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.draft_vocab_size == self.config.vocab_size and not self.d2t.any():
            state.pop(D2T_KEY)
        return state

    # ----------------------------------------------------------------------------- the layer
    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` of the backbone's three hidden states (..., 3H) -> the first step's feature (..., H)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def qkv(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor):
        """Queries (b, heads, s, d), keys and values (b, kv heads, s, d) with rope at ``positions`` (b, s), and the
        residual (the feature), for ``embeds`` and ``feature`` (b, s, H)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, c = self.midlayer, self.config
        dtype = self.fc.weight.dtype
        embeds, feature = embeds.to(dtype), feature.to(dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], dim=-1)
        b, s, _ = x.shape
        q = layer.self_attn.q_proj(x).view(b, s, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = layer.self_attn.k_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = layer.self_attn.v_proj(x).view(b, s, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope_tables(positions, x.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, feature

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (b, s, head_dim) at ``positions`` (b, s), computed in float32 as the backbone's rope."""
        inv_freq, scaling = self._rope
        if inv_freq.device != positions.device:
            self._rope = inv_freq, scaling = inv_freq.to(positions.device), scaling
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``attended`` (b, heads, s, d) -> ``(normed, prenorm)`` (b, s, H): the output the LM head reads, and the
        pre-norm sum the next draft step reads as its feature."""
        layer = self.midlayer
        b, _, s, _ = attended.shape
        h = layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, s, -1))
        residual = h + residual
        prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(prenorm), prenorm

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary (..., draft vocab)."""
        return self.lm_head(normed.to(self.lm_head.weight.dtype))

    def group(self, kv: torch.Tensor) -> torch.Tensor:
        """Keys or values (b, kv heads, s, d) repeated to one per query head."""
        repeat = self.config.num_attention_heads // self.config.num_key_value_heads
        return kv if repeat == 1 else kv.repeat_interleave(repeat, dim=1)


def captured_states(backbone, aux_layer_ids: list[int] | None = None):
    """``(input_ids, attention_mask, start=None) -> (batch, seq, 4H)``: what a capture stores for an EAGLE-3 draft per
    token, the three states it reads (``aux_layer_ids``, vLLM's default when ``None``) then the final-norm state its
    teacher's logits come from (``Eagle3Model.split_captured`` takes them apart); with a ``SharedStart``, of the
    positions after those it holds."""
    layers = sorted(aux_layer_ids) if aux_layer_ids else default_aux_layers(
        backbone.config.get_text_config(decoder=True).num_hidden_layers)
    decoder = backbone.get_decoder()
    first = backbone.get_input_embeddings().weight.device  # device_map=auto: where the inputs go

    def states(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: SharedStart | None = None) -> torch.Tensor:
        ids, mask = input_ids.to(first), attention_mask.to(first)
        out = decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True) if start is None else \
            start.run(decoder, ids, mask, output_hidden_states=True)
        final = out.last_hidden_state
        return torch.cat([*(out.hidden_states[i].to(final.device) for i in layers), final], dim=-1)

    return states
