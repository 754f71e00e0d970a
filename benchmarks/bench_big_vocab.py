"""What a draft costs on a big vocabulary: a decode step with each draft against a plain step, in our decoder.

    python -m benchmarks big_vocab                               # Gemma 3 270M's sizes: hidden 640, 18 layers, 262,144 tokens
    python -m benchmarks big_vocab vocab=128256 hidden=2048 layers=16 heads=32 kv_heads=8 head_dim=64 intermediate=8192

A step's cost does not depend on the weights' values, so the backbone is a random Llama-shaped model of a real
big-vocabulary config (tied embeddings, as Gemma's). Timed at ``context`` cached tokens (``tree.cost.DecodeSteps``:
the draft's own passes, the verify pass, the LM head at every node, acceptance and cache compaction), each beside the
plain step (one token through the backbone, LM head and argmax):

- the EAGLE-3 draft at K=1 (a 2-node chain) with each draft vocabulary in ``sizes`` (0: the whole vocabulary), and
  beside each the share of a plain step's weights its draft step reads (``draft_vocab.choose_draft_vocab``'s cost);
- Medusa heads (``medusa_heads``) at K=1 and on a ``tree_nodes``-node tree: their own full-vocabulary output layers
  (what vLLM, TGI and TensorRT-LLM load) against the shared LM head read through a ``medusa_vocab``-token draft
  vocabulary (our decoder only).

Writes ``outputs/bench/big_vocab.json`` (``output=``).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from benchmarks.bench_options import bench_options

DEFAULTS = dict(vocab=262144, hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256, intermediate=2048,
                dtype="bfloat16", context=256, repeats=10, sizes="0,65536,32768,16384,8192,4096", medusa_heads=4,
                medusa_vocab=32768, tree_nodes=16, threads=None, output="outputs/bench/big_vocab.json")


def backbone_of(opts: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=int(opts["vocab"]), hidden_size=int(opts["hidden"]),
                         num_hidden_layers=int(opts["layers"]), num_attention_heads=int(opts["heads"]),
                         num_key_value_heads=int(opts["kv_heads"]), head_dim=int(opts["head_dim"]),
                         intermediate_size=int(opts["intermediate"]), tie_word_embeddings=True,
                         max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, opts["dtype"])).eval().requires_grad_(False)
    model.config._attn_implementation = "sdpa"
    return model


def ratio(model, trees: dict, opts: dict) -> dict:
    """Each tree's whole decode step over the plain step, timed in turn (``tree.cost.measure_cost_curve``)."""
    from medusa_train.tree.cost import measure_cost_curve

    curve = measure_cost_curve(model.eval(), trees, context=int(opts["context"]), repeats=int(opts["repeats"]),
                               generate_tokens=8)
    return {"plain_ms": round(curve.plain_ms, 2),
            **{f"{n}_nodes": {"ms": round(ms, 2), "x_plain": round(ms / curve.plain_ms, 3)}
               for n, ms in curve.verify_ms.items()}}


def main(**overrides) -> int:
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    from medusa_train.decoding import TokenTree
    from medusa_train.families.eagle3.config import Eagle3Config
    from medusa_train.families.eagle3.model import Eagle3Model
    from medusa_train.families.medusa.model import MedusaModel
    from medusa_train.model.draft_vocab import step_weights

    backbone = backbone_of(opts)
    vocab, hidden = int(opts["vocab"]), int(opts["hidden"])
    plain_weights = step_weights(backbone.config)
    layers = int(opts["layers"])
    aux = [2, layers // 2, layers - 3]
    result = {"config": {k: opts[k] for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim",
                                               "intermediate", "dtype", "context")},
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "plain_step_weights": plain_weights, "eagle3": {}, "medusa": {}}
    layer = Eagle3Config.for_backbone(backbone, aux_layer_ids=aux).layer_weights()
    chain = {2: TokenTree.chain(1)}
    for size in [int(s) for s in str(opts["sizes"]).split(",")]:
        size = size or vocab
        token_map = None if size == vocab else torch.arange(size)
        draft = Eagle3Model.from_backbone(backbone, token_map=token_map, aux_layer_ids=aux, dtype=opts["dtype"])
        row = ratio(draft, chain, opts)
        row["draft_step_share_of_plain_weights"] = round((layer + size * hidden) / plain_weights, 4)
        result["eagle3"][str(size)] = row
        print(f"EAGLE-3, {size:,}-token draft vocabulary, K=1: {row['2_nodes']['x_plain']:.3f}x a plain step "
              f"({row['2_nodes']['ms']} ms against {row['plain_ms']} ms; its draft step reads "
              f"{row['draft_step_share_of_plain_weights']:.1%} of a plain step's weights)", flush=True)
        del draft
    nodes = int(opts["tree_nodes"])
    heads = int(opts["medusa_heads"])
    trees = {2: TokenTree.chain(1), nodes: TokenTree.from_name("default").truncated(max_nodes=nodes,
                                                                                      max_depth=heads)}
    for name, share, token_map in (("own full-vocabulary LM heads (exportable)", False, None),
                                   (f"shared LM head, {int(opts['medusa_vocab']):,}-token draft vocabulary (ours only)",
                                    True, torch.arange(int(opts["medusa_vocab"])))):
        model = MedusaModel.from_backbone(backbone, num_heads=heads, share_lm_head=share, dtype=opts["dtype"],
                                          token_map=token_map)
        row = ratio(model, trees, opts)
        result["medusa"][name] = row
        print(f"Medusa, {heads} heads, {name}: K=1 {row['2_nodes']['x_plain']:.3f}x, {nodes} nodes "
              f"{row[f'{nodes}_nodes']['x_plain']:.3f}x a plain step", flush=True)
        del model
    out = Path(opts["output"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out}")
    return 0
