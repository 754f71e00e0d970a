"""Fit a Medusa tree to measured head accuracies.

    medusa-train build-tree draft=outputs/medusa1/export nodes=64 calibration=packaged:sharegpt-v3

Rank accuracies are measured where the heads will be used: on the backbone's own greedy
continuations of calibration prompts (user turns through the chat template). For head k (0-based)
and rank i, ``rank_accuracies[k][i]`` is the fraction of continuation positions t at which head k's
i-th most likely token (from the hidden state at t) equals the token at t + k + 2. ``build_tree``
then keeps the ``nodes`` most likely paths, and the tree is written as a YAML that
``medusa-train evaluate tree=<file>`` and ``TokenTree.from_name(<file>)`` read.

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

from medusa_train.config.check import FileProblem
from medusa_train.config.paths import unwritable
from medusa_train.data.benchmarks import benchmark_prompt_texts, load_benchmark, normalise_prompt
from medusa_train.data.validation import VALIDATION, greedy_replies, prompt_fits, validation_prompts
from medusa_train.model.walk import (  # noqa: F401 - the walk, for build-tree's callers
    heads_depths,
    measure_ranks,
    outside_draft_vocab_rank,
    rank_accuracies_from,
    tokens_per_step,
    walked_steps,
)
from medusa_train.tree.fit import build_tree

CONVERSATION_SOURCES = (VALIDATION, "packaged:sharegpt-v3")


# ------------------------------------------------------------------------------------------- measuring
def heads_validation(heads_dir) -> tuple[str, object, bool]:
    """``(prompt source, validation settings, predates)`` of the heads' training data (``training_config.json``'s
    ``data.source`` and ``data.validation``); ``predates``: the heads trained before validation sets were held out
    (their training data may hold those prompts)."""
    import dataclasses

    from medusa_train.config.validation import ValidationConfig
    from medusa_train.data.validation import DEFAULT_PROMPT_SOURCE, prompt_source
    from medusa_train.training.run_folder import read_training_config

    data = (read_training_config(heads_dir) or {}).get("data", {})
    stored = data.get("validation")
    names = {f.name for f in dataclasses.fields(ValidationConfig)}
    v = ValidationConfig(**{k: x for k, x in (stored or {}).items() if k in names})
    source = v.source or (prompt_source(data["source"]) if data.get("source") else DEFAULT_PROMPT_SOURCE)
    return source, v, stored is None or not v.size


def validation_bench(heads_dir, tokenizer, limit: int | None = None, max_prompt_tokens: int | None = None) -> list:
    """The draft's validation prompts as benchmark prompts (``evaluate bench.source=validation``): those whose
    rendered prompt fits the validation's ``max_prompt_tokens`` (as its continuations), the first ``limit``."""
    from medusa_train.data.benchmarks import BenchPrompt

    source, v, _ = heads_validation(heads_dir)
    longest = max_prompt_tokens or v.max_prompt_tokens
    texts = [t for t in validation_prompts(source, v.size or 64, v.seed) if prompt_fits(tokenizer, t, longest)]
    return [BenchPrompt(id=f"validation-{i}", category="validation", turns=[t]) for i, t in enumerate(texts[:limit])]


def bench_prompts(source: str, heads_dir, tokenizer, limit: int | None = None, pick: str | None = None) -> list:
    """The prompts a benchmark ``source`` names: the draft's validation prompts (``validation``) or a benchmark
    (``data.benchmarks.load_benchmark``), the first ``limit`` (``pick``: how a benchmark chooses them)."""
    if source == VALIDATION:
        return validation_bench(heads_dir, tokenizer, limit)
    return load_benchmark(source, limit, **({"pick": pick} if pick else {}))


def bench_source_problem(source: str) -> str | None:
    """Why ``source`` names no prompts to decode (``None``: it does)."""
    from medusa_train.data.benchmarks import BENCHMARK_PACKAGES

    if source in (*BENCHMARK_PACKAGES, VALIDATION) or (
            not source.startswith("packaged:") and Path(source).expanduser().is_file()):
        return None
    return (f"must be one of {', '.join(BENCHMARK_PACKAGES)}, {VALIDATION} (the draft's validation prompts, held out "
            "of its training) or an existing .jsonl file")


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
        if prompt_fits(tokenizer, text, max_prompt_tokens):
            prompts.append(text)
    return prompts


def greedy_continuations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                         progress: bool = False) -> list[tuple[torch.Tensor, int]]:
    """``(ids (1, len), prompt length)`` of the backbone's greedy answer to each prompt (``data.validation``'s
    ``greedy_replies``, uncached)."""
    return greedy_replies(model.backbone, tokenizer, prompts, max_new_tokens, progress=progress)[1]


def lookup_runs(sequences: Sequence[tuple[torch.Tensor, int]], max_depth: int,
                ngram: Sequence[int]) -> list[list[int]]:
    """Per sequence and position (as ``measure_ranks``' positions), how many of the lookup chain's first
    ``max_depth`` tokens would be right: at position t the root is the token at t + 1, the chain guesses from
    the text up to it (``decoding.lookup``, suffixes of ``ngram = (min, max)`` tokens), and its i-th token is
    right when it and the ones before it equal the text's."""
    from medusa_train.decoding.lookup import LookupChain

    runs = []
    for ids, prompt_len in sequences:
        tokens = ids[0].tolist()
        lookup = LookupChain(ngram[1], ngram[0], tokens[:prompt_len + 1])
        row = []
        for t in range(prompt_len - 1, len(tokens) - 2):  # as head 0's positions
            guess = lookup.propose(max_depth)
            truth = tokens[t + 2:t + 2 + max_depth]
            row.append(next((i for i, (a, b) in enumerate(zip(guess, truth)) if a != b), min(len(guess), len(truth))))
            lookup.extend(tokens[t + 2:t + 3])
        runs.append(row)
    return runs


def lookup_gains(runs: Sequence[Sequence[int]], depths: Sequence[Sequence[int]], max_depth: int) -> list[float]:
    """Per lookup chain index i (1-based, to ``max_depth``), the fraction of positions where the chain's first i
    tokens are right and the heads' tree does not reach depth i: what the i-th lookup node adds to the tokens per
    step (the decoder keeps the longer of the two paths), measured, not assumed independent."""
    positions = sum(len(r) for r in runs)
    return [sum(run >= i > depth for row_r, row_d in zip(runs, depths) for run, depth in zip(row_r, row_d))
            / positions if positions else 0.0 for i in range(1, max_depth + 1)]


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
    marked = bool(comments) and f"# {comments[0]}".startswith(TREE_MARK)  # build-tree's command line marks it
    lines = ([] if marked else [TREE_MARK]) + [f"# {c}" for c in comments]
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


TREE_MARK = "# medusa-train build-tree"  #: how every tree it writes begins (its command line): the file is ours


def tree_output_problem(path: str | os.PathLike, option: str = "output") -> str | None:
    """Why a tree must not be written to ``path`` (``None``: it may): a file there that build-tree did not write (it
    does not begin with ``TREE_MARK``), a folder, or a place that cannot be written. Checked before any work."""
    path = Path(path).expanduser()
    change = f"choose another {option}= (or move the file away)"
    if path.is_dir():
        return f"{option}={path}: is a folder; name a .yaml file"
    if path.exists():
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = f.readline().rstrip("\n")
        except OSError as err:
            return f"{option}={path}: cannot be read ({err.strerror or err}); {change}"
        if not first.startswith(TREE_MARK):
            return f"{option}={path}: exists and build-tree did not write it; nothing was changed: {change}"
    blocked = unwritable(path.parent)
    return f"{option}={path}: {blocked} cannot be written; choose another {option}=" if blocked else None


def write_tree(path: str | os.PathLike, rank_accuracies: Sequence[Sequence[float]], nodes: int, expected: float,
               comments: Sequence[str] = (), extra: dict | None = None) -> tuple[Path, list[list[int]]]:
    """Build the ``nodes``-node tree for ``rank_accuracies`` and write it as YAML (temp file, then rename), with
    ``expected`` (the walk's tokens per step) as its expected accepted length.

    Returns:
        ``(path, choices)``.

    Raises:
        FileProblem: ``path`` is a file build-tree did not write, or cannot be written (``tree_output_problem``).
    """
    path = Path(path)
    if problem := tree_output_problem(path):
        raise FileProblem(problem)
    choices = build_tree(rank_accuracies, nodes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(tree_yaml(choices, rank_accuracies, expected, comments, extra))
    os.replace(tmp, path)
    return path, choices
