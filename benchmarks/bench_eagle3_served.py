"""An EAGLE-3 draft in vLLM: what a step costs the engine, and whether it accepts what our decoder's chain accepts.

    python -m benchmarks eagle3_served                     # 6 MT-Bench first turns, 48 tokens, K=3, float32
    python -m benchmarks eagle3_served prompts=12 k=3 dtype=bfloat16 fit_steps=40

Three servers of the packaged model, one after another, on the same prompts (concurrency 1, greedy):

- without speculation (the speed every row divides by);
- with a draft at random weights (the draft vocabulary and shapes of the fitted one): it accepts nothing, so its
  tokens/s against the plain server's is what drafting K tokens a step costs; a trained draft pays off when its
  tokens per step exceed that cost ratio;
- with a draft fitted (training-time test, ``fit_steps`` steps) to the backbone's own greedy replies to these
  prompts: an upper bound on acceptance, used to check that the engine accepts what ``tree=chain`` simulates, per
  step and per position, and replies with the plain server's tokens.

Tokens per step: (completion tokens - replies) / decode steps (``vllm:inter_token_latency_seconds_count``), as every
row of the evaluation counts it; vLLM's own ``1 + accepted / drafts`` is per drafted step.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch


def fit_draft(backbone, tokenizer, conversations: list[list[dict]], max_tokens: int, depth: int, steps: int,
              vocab: int = 4096, seed: int = 0, model_class=None):
    """An EAGLE-3 draft (a ``vocab``-token draft vocabulary, ``depth`` chained steps) fitted with training-time test,
    ``steps`` AdamW steps on the backbone's own greedy replies to ``conversations`` (``max_tokens + depth`` tokens),
    in eval mode: an upper bound on acceptance on those prompts, not a trained draft. ``model_class``: EAGLE-3's
    (None) or a variant's trained the same way (``PEagleModel``: each chained step a masked slot)."""
    from medusa_train.backbone.generation import encode_chat
    from medusa_train.families.eagle3.loss import ttt_loss
    from medusa_train.families.eagle3.model import Eagle3Model
    from medusa_train.model.draft_vocab import most_frequent_tokens

    texts = []
    for messages in conversations:
        ids = encode_chat(tokenizer, messages)
        reply = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_tokens + depth)[0]
        texts.append((ids.shape[1], reply))
    width = max(len(t) for _, t in texts)
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (start, text) in enumerate(texts):
        ids[i, :len(text)], mask[i, :len(text)], labels[i, start:len(text)] = text, 1, text[start:]
    torch.manual_seed(seed)
    model = (model_class or Eagle3Model).from_backbone(
        backbone, token_map=most_frequent_tokens(labels, vocab, backbone.config.vocab_size), ttt_steps=depth)
    with torch.no_grad():
        states = model(ids, attention_mask=mask)
    optimizer = torch.optim.AdamW(model.draft.parameters(), lr=1e-2)
    for _ in range(steps):
        ttt_loss(model, states.draft_inputs, states.hidden_states, ids, mask, labels, depth, 0.8,
                 backward=torch.Tensor.backward)
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def chain_figures(model, tokenizer, conversations: list[list[dict]], max_tokens: int, eos: list[int]):
    """Our decoder's ``tree=chain`` (the draft's default depth) over ``conversations``: ``(replies, {"tokens_per_step",
    "per_position"})``, tokens after each reply's first per verify step, as the engine counts them."""
    from medusa_train.backbone.generation import encode_chat
    from medusa_train.decoding import TokenTree, tree_generate

    depth = model.max_depth
    replies, depths, gained, steps = [], [], 0, 0
    for messages in conversations:
        ids = encode_chat(tokenizer, messages)
        out = tree_generate(model, ids, TokenTree.chain(depth), max_new_tokens=max_tokens, eos_token_id=eos)
        replies.append(out.sequences[0, ids.shape[1]:].tolist())
        depths += out.accepted_depths
        gained, steps = gained + out.new_tokens - 1, steps + out.steps
    return replies, {"tokens_per_step": gained / steps, "steps": steps,
                     "per_position": [sum(d > k for d in depths) / len(depths) for k in range(depth)]}


def main(prompts: str = "6", max_tokens: str = "48", k: str = "3", dtype: str = "float32", fit_steps: str = "40",
         vocab: str = "4096", out: str | None = None) -> int:
    from medusa_train.backbone.generation import eos_token_ids
    from medusa_train.backbone.load import load_backbone, resolve_model_path
    from medusa_train.data.benchmarks import load_benchmark
    from medusa_train.engine import VllmServer
    from medusa_train.evaluation.served import measure_phase
    from medusa_train.families.eagle3.model import Eagle3Model

    n, new, depth, steps = int(prompts), int(max_tokens), int(k), int(fit_steps)
    folder = resolve_model_path("packaged:smollm2-135m-instruct")[0]
    backbone, tokenizer = load_backbone(folder, dtype="float32")
    eos = eos_token_ids(backbone, tokenizer)
    conversations = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark(limit=n, pick="spread")]
    root = Path(out or tempfile.mkdtemp(prefix="eagle3-served-"))
    started = time.perf_counter()
    model = fit_draft(backbone, tokenizer, conversations, new, depth, steps, int(vocab))
    fit_s = time.perf_counter() - started
    fitted_folder = model.save_pretrained(root / "fitted")
    torch.manual_seed(0)
    random_draft = Eagle3Model.from_backbone(backbone, token_map=model.draft.token_map, ttt_steps=depth)
    random_folder = random_draft.save_pretrained(root / "random")
    _, ours = chain_figures(model, tokenizer, conversations, new, eos)

    rows = {}
    for name, draft in (("plain", None), ("random draft", random_folder), ("fitted draft", fitted_folder)):
        spec = None if draft is None else {"method": "eagle3", "model": str(draft), "num_speculative_tokens": depth}
        with VllmServer(folder, dtype=dtype, speculative_config=spec, log_path=root / f"vllm-{name}.log") as client:
            client.chat(conversations[0], max_tokens=8, stop_token_ids=eos)  # untimed warm-up
            time.sleep(1.0)
            rows[name] = measure_phase(client, conversations, new, eos)
    plain = rows["plain"]
    print(f"packaged model, {n} MT-Bench first turns, {new} tokens, K={depth}, vLLM {dtype}, greedy, concurrency 1; "
          f"draft fitted {steps} steps in {fit_s:.0f} s")
    print("| server | tokens/s | speedup | tokens per step | vLLM per drafted step | per position | outputs = plain |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
        per_position = "/".join(f"{p:.3f}" for p in r["per_position_acceptance"]) or "n/a"
        drafted = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "n/a"
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x | "
              f"{r['tokens_per_step']:.3f} | {drafted} | {per_position} | {same}/{n} |")
    print(f"our decoder's chain (tree=chain, K={depth}, same export): {ours['tokens_per_step']:.3f} tokens per step, "
          f"per position {'/'.join(f'{p:.3f}' for p in ours['per_position'])}")
    cost = rows["plain"]["tokens_per_s"] / rows["random draft"]["tokens_per_s"]
    print(f"a drafting step costs {cost:.2f}x a plain one here: a draft pays at more than {cost:.2f} tokens per step, "
          f"and 1.3x needs {1.3 * cost:.2f}")
    (root / "result.json").write_text(json.dumps({"rows": rows, "ours": ours, "fit_s": fit_s}, indent=2, default=str))
    print(f"written: {root / 'result.json'}")
    return 0
