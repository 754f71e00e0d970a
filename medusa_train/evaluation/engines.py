"""The accepted length each serving engine would get from these heads, on the evaluation's own prompts.

Read from the engines' code (FACTS.md): vLLM's V1 engine proposes a top-1 chain of plain Medusa heads
(``num_speculative_tokens`` <= heads, no tree); TGI speculates chains the same way; TensorRT-LLM
verifies a static tree passed as ``medusa_choices`` (plain heads). Heads that read the next token,
their path or through prefix attention load only in our own decoder (``native``); heads with a draft
vocabulary (``token_map``) load in ours only as they are: the original Medusa layout TGI and TensorRT-LLM
read has no token map, and vLLM 0.32 refuses one at load (tested against the engine). Draft heads that
share the LM head are exported to vLLM with the whole LM head, so they guess from every token there:
the ``vllm`` row decodes with exactly that export. Draft heads with their own output layers have no
vLLM form. The row's ``served`` entry (``evaluation.served``) is what a running vLLM measured.

Greedy output is the backbone's whatever the tree, so an engine's accepted length is what our
decoder accepts with that engine's tree: a K-long rank-0 chain for ``vllm`` and ``tgi``, the
evaluated tree itself for ``native`` and its heads' nodes for ``trtllm`` (no engine runs a lookup chain).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_train.decoding import TokenTree, tree_generate

ENGINES = {"vllm": "top-1 chain over the heads (vLLM's Medusa proposer, V1 engine)",
           "tgi": "top-1 chain over the heads (TGI's Medusa speculation)",
           "trtllm": "the evaluated tree's heads' nodes as medusa_choices (TensorRT-LLM; no lookup chain)",
           "native": "the evaluated tree, every head feature (medusa-train's decoder)"}
#: the layout each engine loads (TGI and TensorRT-LLM: the original Medusa layout)
ENGINE_LAYOUTS = {"vllm": "vllm", "tgi": "medusa_v1", "trtllm": "medusa_v1", "native": "native"}


def native_only_reason(config) -> str | None:
    """Why engines other than ours cannot load heads of ``config`` (``None`` if they can)."""
    features = [f"{what} (heads.{key})" for key, what in config.native_only_features().items()]
    return ("the heads " + " and ".join(features) + ": only the native layout holds that") if features else None


def layout_reason(config, layout: str) -> str | None:
    """Why ``layout`` cannot hold the draft of ``config`` (``None``: it can), for an engine's row."""
    from medusa_train.model.family import family_of_config, layout_problem

    problem = layout_problem(family_of_config(config), config, layout)
    return None if problem is None else native_only_reason(config) or f"{config.draft_name} {problem}"


def vllm_reason(config) -> str | None:
    """Why vLLM cannot serve the draft of ``config`` (``None``: it can, from its family's served layout)."""
    from medusa_train.model.family import family_of_config

    return layout_reason(config, family_of_config(config).served_layout)


def vllm_form(model):
    """The draft as its served layout serves it: ``model`` itself, or, with a draft vocabulary shared through the LM
    head, the export written and read back (whole LM head, no token map)."""
    if not model.config.vllm_export_differs:
        return model
    import tempfile

    from medusa_train.model.family import family_of_model
    from medusa_train.model.load import load_draft

    with tempfile.TemporaryDirectory() as tmp:
        model.save_as(tmp, family_of_model(model).served_layout)
        served = load_draft(tmp, model.backbone)
    for part in served.draft_modules():
        part.to(model.lm_head.weight.dtype)
    return served.eval()


@torch.no_grad()
def chain_accepted_length(model, inputs: Sequence[torch.Tensor], max_new_tokens: int, eos: list[int]) -> float:
    """Tokens per forward (after each reply's first, see ``evaluation.summary``) of a ``num_heads``-long
    rank-0 chain over ``inputs`` (greedy)."""
    chain = TokenTree.chain(model.config.depth)
    tokens = steps = 0
    for input_ids in inputs:
        out = tree_generate(model, input_ids, chain, max_new_tokens=max_new_tokens, eos_token_id=eos)
        tokens, steps = tokens + out.new_tokens - 1, steps + out.steps
    return tokens / max(steps, 1)


def engine_rows(model, inputs: Sequence[torch.Tensor], tree: TokenTree, native_accepted_length: float,
                max_new_tokens: int, eos: list[int], heads_accepted_length: float | None = None) -> dict[str, dict]:
    """``{engine: {"mean_accepted_length": float | None, "verifies": ..., "reason": str | None}}``;
    ``heads_accepted_length``: the evaluated tree's heads' nodes alone, when it has a lookup chain (no engine
    runs one)."""
    reasons = {name: layout_reason(model.config, layout) for name, layout in ENGINE_LAYOUTS.items()}
    chain = None if reasons["vllm"] else chain_accepted_length(vllm_form(model), inputs, max_new_tokens, eos)
    heads = native_accepted_length if heads_accepted_length is None else heads_accepted_length
    values = {"vllm": chain, "tgi": chain, "trtllm": heads, "native": native_accepted_length}
    return {name: {"mean_accepted_length": None if reasons[name] else values[name], "verifies": ENGINES[name],
                   "reason": reasons[name]} for name in ENGINES}
