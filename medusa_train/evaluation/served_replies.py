"""``medusa-train choose-k``'s check of each server's greedy replies against the server without speculation's.

Every row of a sweep is measured on the same prompts; its replies (token ids, concurrency 1, without their stop
token) are kept in the row under ``REPLIES`` until ``compare_replies`` has compared them with K=0's and put the
verdict in ``row["outputs"]``: identical, parting at a near-tie rounding explains, or beyond it
(``evaluation.compare``). ``choose_k.checked`` reads that verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from medusa_train.model.folder import CHAT_TEMPLATE_NAME, DRAFT_SERVER, PLAIN_SERVER

#: a measured row's greedy replies (token ids, concurrency 1) until ``compare_replies`` has checked them
REPLIES = "replies"


def server_of(row: dict) -> str:
    """Which server a row measured (rows written before free baselines were served carry only ``k``)."""
    return row.get("server") or (DRAFT_SERVER if row["k"] else PLAIN_SERVER)


def compare_replies(rows: list[dict], base_model: str, export: Path, conversations: Sequence[list[dict]],
                    dtype: str, stop_ids: Sequence[int] = ()) -> None:
    """Check each row's greedy replies against the server without speculation's (K=0, on the same prompts), in
    place: ``row["outputs"]`` says how many are identical and, where one parts, whether rounding explains it (the
    base model's logits there, computed here in the served ``dtype``: both tokens within rounding of the best,
    ``evaluation.compare.classify_at``; a reply that ended where the other goes on chose one of ``stop_ids``, the
    replies being given without their stop token). The base model is loaded only when a reply differs. Without a K=0 row
    nothing is compared (``outputs`` None). The replies themselves are not kept in the rows."""
    from medusa_train.evaluation.compare import brief, classify_at, compare_outputs

    replies = [row.pop(REPLIES, None) for row in rows]
    counted = [row.pop("prompt_tokens", None) for row in rows]
    plain_index = next((i for i, row in enumerate(rows) if server_of(row) == PLAIN_SERVER), None)
    if plain_index is None:
        for row in rows:
            row["outputs"] = None
        return
    logits_at = _base_logits(base_model, export, conversations, dtype)
    for i, row in enumerate(rows):
        if i == plain_index:
            continue

        def classify(j, plain, drafted, position, i=i):
            raw = logits_at(j, plain[:position], counted[i][j] if counted[i] else None)
            if raw is None:  # the server's prompt is not the one rendered here: no view of the difference
                return {"kind": "prompt_differs"}
            return brief(classify_at(raw, plain, drafted, position, stop_ids))  # a reply that ended chose a stop token

        row["outputs"] = compare_outputs(replies[plain_index], replies[i], classify)


def _base_logits(base_model: str, export: Path, conversations: Sequence[list[dict]], dtype: str):
    """``logits_at(prompt index, reply tokens so far, the server's prompt token count)``: the base model's
    next-token logits after the prompt (rendered with the export's chat template, as the servers were) and those
    tokens, or None where the server counted another prompt length. Loads the model at its first call."""
    import torch

    from medusa_train.backbone.generation import encode_chat

    loaded = {}

    def logits_at(index: int, tokens: list[int], server_prompt_tokens: int | None):
        if not loaded:
            from medusa_train.backbone.load import load_backbone

            model, tokenizer = load_backbone(base_model, dtype=dtype)
            template = export / CHAT_TEMPLATE_NAME
            if template.is_file():
                tokenizer.chat_template = template.read_text()
            loaded.update(model=model.to("cuda") if torch.cuda.is_available() else model, tokenizer=tokenizer)
        model = loaded["model"]
        prompt = encode_chat(loaded["tokenizer"], conversations[index])
        if server_prompt_tokens is not None and prompt.shape[1] != server_prompt_tokens:
            return None
        ids = torch.cat([prompt[0], torch.tensor(tokens, dtype=prompt.dtype)])[None].to(model.device)
        with torch.no_grad():
            return model(ids, logits_to_keep=1).logits[0, -1]

    return logits_at


def replies_line(row: dict) -> str | None:
    """How a row's greedy replies compare with the server without speculation's (None: not compared)."""
    outputs = row.get("outputs")
    if not outputs:
        return None
    name = f"K={row['k']}" if server_of(row) in (PLAIN_SERVER, DRAFT_SERVER) else server_of(row)
    parts = [f"{outputs['identical']} of {outputs['compared']} replies identical to K=0's"]
    if outputs["at_rounding"]:
        parts.append(f"{outputs['at_rounding']} part at a near-tie rounding explains")
    if outputs["unexplained"]:
        parts.append(f"{outputs['unexplained']} part beyond rounding (not chosen)")
    if prompt_differs := sum(d.get("kind") == "prompt_differs" for d in outputs["details"]):
        parts.append(f"{prompt_differs} not checked (the server rendered another prompt)")
    return f"  {name}: " + "; ".join(parts)
