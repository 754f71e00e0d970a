"""Fit a Medusa tree to measured head accuracies.

    medusa-train build-tree heads=outputs/medusa1/export nodes=64 calibration=packaged:sharegpt-v3

Rank accuracies are measured where the heads will be used: on the backbone's own greedy
continuations of calibration prompts (user turns through the chat template). For head k (0-based)
and rank i, ``rank_accuracies[k][i]`` is the fraction of continuation positions t at which head k's
i-th most likely token (from the hidden state at t) equals the token at t + k + 2. ``build_tree``
then keeps the ``nodes`` most likely paths, and the tree is written as a YAML that
``medusa-train evaluate tree=<file>`` and ``MedusaTree.from_name(<file>)`` read.

MT-Bench is the evaluation set: it cannot be the calibration source, and calibration prompts that
appear in it are dropped (``exclude``). Prompts the heads were trained on (the ``data.source`` of
the heads' ``training_config.json``) are dropped too: heads guess their own training text far
better than new text, so accuracies measured there would make the tree (and its expected
accepted length) fit a memory rather than the heads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from medusa_train.backbone.generation import encode_chat, eos_token_ids, plain_generate
from medusa_train.data.benchmarks import benchmark_prompt_texts, load_benchmark, normalise_prompt
from medusa_train.data.validation import VALIDATION
from medusa_train.tree.fit import build_tree

CONVERSATION_SOURCES = (VALIDATION, "packaged:sharegpt-v3")


# ------------------------------------------------------------------------------------------- measuring
def training_prompts(heads_dir: str | os.PathLike) -> set[str]:
    """Normalised user turns of the data the heads were trained on (empty when the heads carry no
    ``training_config.json``, e.g. heads converted from another format)."""
    from medusa_train.training.run_folder import read_training_config

    data = (read_training_config(heads_dir) or {}).get("data", {})
    if not data.get("source"):
        return set()
    from medusa_train.data.sources import load_conversations

    conversations, _ = load_conversations(data["source"], max_samples=data.get("max_samples"))
    return {normalise_prompt(m["content"]) for c in conversations for m in c if m["role"] == "user"}


def calibration_prompts(source: str, tokenizer, num_prompts: int, max_prompt_tokens: int,
                        exclude: str | None = "packaged:mt-bench", seen: set[str] | frozenset = frozenset()) -> list[str]:
    """The first ``num_prompts`` first user turns of ``source`` that fit ``max_prompt_tokens`` (after the chat
    template), are not prompts of the ``exclude`` benchmark, and are not in ``seen`` (normalised texts, e.g.
    ``training_prompts``).

    Args:
        source: ``packaged:sharegpt-v3`` (or another conversation source of ``load_conversations``), or a
            prompt file ``load_benchmark`` reads.
        tokenizer: Tokenizer with a chat template.
        num_prompts: How many prompts to return (fewer when the source runs out).
        max_prompt_tokens: Longest prompt kept, in tokens.
        exclude: Benchmark whose prompts are dropped (``None``: none).
        seen: Normalised prompts to pass over as well.
    """
    if source in CONVERSATION_SOURCES:
        from medusa_train.data.sources import load_conversations

        conversations, _ = load_conversations(source, max_samples=max(num_prompts * 8, 64) + len(seen))
        candidates = [next((m["content"] for m in c if m["role"] == "user"), "") for c in conversations]
    else:
        candidates = [p.turns[0] for p in load_benchmark(source)]
    banned = (benchmark_prompt_texts(exclude) if exclude else set()) | set(seen)
    prompts = []
    for text in candidates:
        if len(prompts) == num_prompts:
            break
        if not text.strip() or normalise_prompt(text) in banned:
            continue
        if encode_chat(tokenizer, [{"role": "user", "content": text}]).shape[1] <= max_prompt_tokens:
            prompts.append(text)
    return prompts


@torch.no_grad()
def greedy_continuations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                         progress: bool = False) -> list[tuple[torch.Tensor, int]]:
    """``(ids (1, len), prompt length)`` of the backbone's greedy answer to each prompt."""
    from tqdm.auto import tqdm

    device = model.lm_head.weight.device
    eos = eos_token_ids(model.backbone)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    sequences = []
    for text in tqdm(prompts, desc="greedy continuations", unit="prompt", disable=not progress):
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}]).to(device)
        new, _ = plain_generate(model.backbone, ids, max_new_tokens, eos, pad)
        sequences.append((torch.cat([ids[0], torch.tensor(new, dtype=ids.dtype, device=device)])[None], ids.shape[1]))
    return sequences


@torch.no_grad()
def measure_ranks(model, sequences: Sequence[tuple[torch.Tensor, int]], top_k: int = 10,
                  states: Sequence[torch.Tensor] | None = None) -> list[list[list[int]]]:
    """Per sequence, per head (draft depth), the rank of the true token among the head's guesses at each position
    from the last prompt token on (``top_k``: not among its first ``top_k``; ``top_k + 1``: a token outside the
    draft's vocabulary, never guessed): position j of every head is the same place in the text (head k's list is k
    tokens shorter: the text ends). ``states``: per sequence, what the draft's capture stores (no backbone run)."""
    ranks = []
    for i, (ids, prompt_len) in enumerate(sequences):
        by_head = [[] for _ in range(model.config.depth)]
        # the model says what its draft scores at each depth along the text, and which output is the true token
        for k, logits, targets in model.calibration_scores(ids, prompt_len - 1, None if states is None else states[i]):
            target_logits = logits.gather(-1, targets.clamp(min=0)[:, None])
            rank = (logits > target_logits).sum(-1).clamp_(max=top_k)
            by_head[k] = rank.masked_fill_(targets < 0, outside_draft_vocab_rank(top_k)).tolist()
        ranks.append(by_head)
    return ranks


def outside_draft_vocab_rank(top_k: int) -> int:
    """The rank ``measure_ranks`` gives a true token the draft cannot guess (outside its draft vocabulary)."""
    return top_k + 1


def rank_accuracies_from(ranks: Sequence[Sequence[Sequence[int]]], num_heads: int,
                         top_k: int) -> tuple[list[list[float]], list[int]]:
    """``(rank_accuracies [num_heads][top_k], positions per head)`` from ``measure_ranks``' ranks."""
    hits = [[0] * top_k for _ in range(num_heads)]
    counts = [0] * num_heads
    for by_head in ranks:
        for k, row in enumerate(by_head):
            counts[k] += len(row)
            for r in row:
                if r < top_k:
                    hits[k][r] += 1
    return [[hits[k][i] / counts[k] if counts[k] else 0.0 for i in range(top_k)] for k in range(num_heads)], counts


def lookup_runs(sequences: Sequence[tuple[torch.Tensor, int]], max_depth: int,
                ngram: Sequence[int]) -> list[list[int]]:
    """Per sequence and position (as ``measure_ranks``' positions), how many of the lookup chain's first
    ``max_depth`` tokens would be right: at position t the root is the token at t + 1, the chain guesses from
    the text up to it (``decoding.lookup``, suffixes of ``ngram = (min, max)`` tokens), and its i-th token is
    right when it and the ones before it equal the text's."""
    from medusa_train.decoding.lookup import ContextLookup

    runs = []
    for ids, prompt_len in sequences:
        tokens = ids[0].tolist()
        lookup = ContextLookup(ngram[1], ngram[0], tokens[:prompt_len + 1])
        row = []
        for t in range(prompt_len - 1, len(tokens) - 2):  # as head 0's positions
            guess = lookup.propose(max_depth)
            truth = tokens[t + 2:t + 2 + max_depth]
            row.append(next((i for i, (a, b) in enumerate(zip(guess, truth)) if a != b), min(len(guess), len(truth))))
            lookup.extend(tokens[t + 2:t + 3])
        runs.append(row)
    return runs


def heads_depths(ranks: Sequence[Sequence[Sequence[int]]], choices: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per sequence and position, how deep the heads' guesses in ``choices`` are accepted (greedy, the text's
    own continuation): the longest prefix of the true tokens' ranks that is a path of the tree."""
    paths = {tuple(c) for c in choices}
    depths = []
    for by_head in ranks:
        row = []
        for j in range(len(by_head[0]) if by_head else 0):
            d = 0
            while d < len(by_head) and j < len(by_head[d]) and tuple(by_head[k][j] for k in range(d + 1)) in paths:
                d += 1
            row.append(d)
        depths.append(row)
    return depths


def lookup_gains(runs: Sequence[Sequence[int]], depths: Sequence[Sequence[int]], max_depth: int) -> list[float]:
    """Per lookup chain index i (1-based, to ``max_depth``), the fraction of positions where the chain's first i
    tokens are right and the heads' tree does not reach depth i: what the i-th lookup node adds to the tokens per
    step (the decoder keeps the longer of the two paths), measured, not assumed independent."""
    positions = sum(len(r) for r in runs)
    return [sum(run >= i > depth for row_r, row_d in zip(runs, depths) for run, depth in zip(row_r, row_d))
            / positions if positions else 0.0 for i in range(1, max_depth + 1)]


def walked_steps(depths: Sequence[int], runs: Sequence[int] = (), lookup_depth: int = 0) -> list[int]:
    """The tokens each greedy decode step accepts when it writes one calibration text again: the first step sits
    at the first position (the last prompt token's), each takes 1 + the longer of the heads' depth there
    (``heads_depths``) and the lookup chain's run there capped at ``lookup_depth`` (``lookup_runs``), and the next
    starts after the tokens it accepted."""
    steps, j = [], 0
    while j < len(depths):
        steps.append(1 + max(depths[j], min(runs[j], lookup_depth) if j < len(runs) else 0))
        j += steps[-1]
    return steps


def tokens_per_step(depths: Sequence[Sequence[int]], runs: Sequence[Sequence[int]] | None = None,
                    lookup_depth: int = 0) -> float:
    """Tokens per decode step over every calibration text, walked step by step (``walked_steps``).

    A loop's positions count as the decoder meets them: a step that copies 8 tokens passes over 8 positions, which
    an average over positions (``lookup_gains``) counts as 8 steps that long, promising several times what comes
    when the text loops only in parts."""
    steps = [n for k, row in enumerate(depths) for n in walked_steps(row, runs[k] if runs else (), lookup_depth)]
    return sum(steps) / len(steps) if steps else 1.0


@torch.no_grad()
def measure_rank_accuracies(model, sequences: Sequence[tuple[torch.Tensor, int]],
                            top_k: int = 10) -> tuple[list[list[float]], list[int]]:
    """Per head (draft depth) and rank, how often the rank-i guess is the token k + 2 ahead.

    Only positions from the last prompt token on are counted (where decoding asks the heads). Medusa heads each
    read the text; an EAGLE-3 draft's depth k is its k-th chained step given the text's tokens before it, so its
    accuracy is conditional on the path so far (``calibration_scores`` of either model).

    Args:
        model: A ``MedusaModel`` or ``Eagle3Model``.
        sequences: ``(ids (1, len), prompt length)`` pairs, e.g. from ``greedy_continuations``.
        top_k: Ranks measured.

    Returns:
        ``(rank_accuracies [num_heads][top_k], positions per head)``.
    """
    return rank_accuracies_from(measure_ranks(model, sequences, top_k), model.config.depth, top_k)


# ------------------------------------------------------------------------------------------- writing
def tree_yaml(choices: Sequence[Sequence[int]], rank_accuracies: Sequence[Sequence[float]], expected: float,
              comments: Sequence[str] = (), extra: dict | None = None) -> str:
    """A tree YAML (``choices:``, ``expected_accept_length:``, ``rank_accuracies:``, then ``extra``'s keys)
    opening with ``comments``."""
    lines = [f"# {c}" for c in comments]
    rows = [", ".join(str(list(c)) for c in choices[i: i + 8])
            for i in range(0, len(choices), 8)]
    lines += ["choices: [", *(f"  {row}," for row in rows), "]"] if choices else ["choices: []"]
    lines.append(f"expected_accept_length: {expected:.4f}  # tokens per step (after each reply's first, per forward), "
                 "greedy decoding walked step by step over the calibration text")
    lines.append("rank_accuracies:  # [head][rank]: fraction of positions where the head's rank-i guess was right")
    lines += [f"  - [{', '.join(f'{a:.4f}' for a in row)}]" for row in rank_accuracies]
    text = "\n".join(lines) + "\n"
    if extra:
        import yaml  # a hydra-core dependency

        text += yaml.safe_dump(extra, sort_keys=False, width=120)
    return text


def write_tree(path: str | os.PathLike, rank_accuracies: Sequence[Sequence[float]], nodes: int, expected: float,
               comments: Sequence[str] = (), extra: dict | None = None) -> tuple[Path, list[list[int]]]:
    """Build the ``nodes``-node tree for ``rank_accuracies`` and write it as YAML (temp file, then rename), with
    ``expected`` (the walk's tokens per step) as its expected accepted length.

    Returns:
        ``(path, choices)``.
    """
    choices = build_tree(rank_accuracies, nodes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(tree_yaml(choices, rank_accuracies, expected, comments, extra))
    os.replace(tmp, path)
    return path, choices
