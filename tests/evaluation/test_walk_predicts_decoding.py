"""Figures that hold before decoding (float32, the packaged model): what the training log says of the draft at each
evaluation (tokens per step for K-chains and the fixed tree, walked along the validation continuations) and what
build-tree expects of the tree it chose are what decoding the validation prompts measures, counted the same way
(tokens after each reply's first per forward after its prefill, the last step included): step for step where the
decoded text is the walked one (float32: every reply), so the figures are equal, not near.
"""

from __future__ import annotations

import json

import pytest
from helpers.backbones import PACKAGED_MODEL
from helpers.training import compose_config, read_metrics

pytestmark = [pytest.mark.slow]

PROMPTS = 6
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Heads as the demo trains them (shared LM head, a 4,096-token draft vocabulary, teacher targets), float32,
    with a 6-prompt validation set walked at each evaluation: the run folder."""
    from medusa_train.cli.train import run

    out = tmp_path_factory.mktemp("walked-heads")
    run(compose_config([
        f"model.name_or_path={PACKAGED_MODEL}", "model.dtype=float32", "trainer.mixed_precision=no",
        "heads.num_heads=3", "heads.share_lm_head=true", "heads.draft_vocab_size=4096", "loss.targets=teacher",
        "data.max_samples=160", "data.max_length=128", "data.eval_size=8", "data.batch_size=8",
        f"data.validation.size={PROMPTS}", f"data.validation.max_new_tokens={NEW_TOKENS}",
        "data.validation.chains=[1,2,3]", "data.validation.tree_nodes=16",
        "trainer.max_steps=14", "trainer.eval_every=14", "trainer.save_every=14", "optim.lr=3e-3",
        f"trainer.output_dir={out}"]))
    return out


def decoded(model, tokenizer, prompts, tree) -> list:
    """Per prompt, ``(ids (1, len) of the decoded reply, prompt length, tokens each verify step wrote)`` decoding
    with ``tree`` as evaluate's rows do."""
    from medusa_train.backbone.generation import encode_chat, eos_token_ids
    from medusa_train.decoding import tree_generate

    eos = eos_token_ids(model.backbone, tokenizer)
    rows = []
    for p in prompts:
        ids = encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])
        out = tree_generate(model, ids, tree, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
        rows.append((out.sequences, ids.shape[1], out.written_per_step))
    return rows


def test_the_training_logs_walk_is_what_decoding_the_validation_prompts_accepts(trained):
    from medusa_train.config.model import EvalModelConfig
    from medusa_train.data.validation import continuations, greedy_replies, validation_prompts
    from medusa_train.decoding import TokenTree
    from medusa_train.model.load import load_exported_draft
    from medusa_train.model.walk import heads_depths, measure_ranks, walked_steps
    from medusa_train.training.validation_walk import ValidationWalk
    from medusa_train.tree.calibrate import heads_validation, validation_bench

    record = [r for r in read_metrics(trained) if r.get("split") == "eval"][-1]
    logged = {k: v for k, v in record.items() if k.startswith("validation/")}
    export = trained / "export"
    assert json.loads((export / "validation.json").read_text()) == logged  # the export records the last walk
    assert logged["validation/K1"] > 1.05, logged  # heads that accept: the comparison can fail
    assert 0 < logged["validation/outside_draft_vocab"] < 0.5  # counted as misses, and said
    model, tokenizer = load_exported_draft(export, EvalModelConfig(dtype="float32"), "cpu")
    prompts = validation_bench(export, tokenizer)
    assert len(prompts) >= PROMPTS - 2
    _, walked_texts = greedy_replies(model.backbone, tokenizer, [p.turns[0] for p in prompts], NEW_TOKENS,
                                     progress=False)  # the continuations the training log walked
    # the walk on the first n prompts (what benchmarks compare with what is served) walks the first n served
    source, v, _ = heads_validation(export)
    texts = continuations(model.backbone, tokenizer, validation_prompts(source, v.size, v.seed), v.max_new_tokens,
                          v.max_prompt_tokens, progress=False)
    first = ValidationWalk(texts, None, "", None).first(3)
    assert first.continuations.prompts == [p.turns[0] for p in validation_bench(export, tokenizer, limit=3)]
    assert [ids.tolist() for ids, _ in first.continuations.sequences] == [t.tolist() for t, _ in walked_texts[:3]]
    trees = {f"validation/K{k}": TokenTree.chain(k) for k in (1, 2, 3)}
    trees["validation/tree16"] = TokenTree.from_name("default").truncated(max_nodes=16, max_depth=3)
    ranks = measure_ranks(model, walked_texts, top_k=10)
    for key, tree in trees.items():
        rows = decoded(model, tokenizer, prompts, tree)
        depths = heads_depths(ranks, tree.choices)
        for (ids, prompt_len, written), (text, _), depth in zip(rows, walked_texts, depths, strict=True):
            assert ids.tolist() == text.tolist(), key  # float32: the decoder writes the walked text
            assert walked_steps(depth) == written, (key, prompt_len)  # every step, the last one included
        measured = sum(sum(w) for *_, w in rows) / sum(len(w) for *_, w in rows)
        assert logged[key] == pytest.approx(measured, abs=5e-5), (key, logged, measured)  # logged to 4 places


def test_build_trees_walk_for_the_tree_it_chose_is_what_evaluate_measures(trained, tmp_path):
    """build-tree on the validation set (lookup_depth=auto, its guard decoding 4 prompts), then ``evaluate
    bench.source=validation``: the report's measured tokens per forward beside build-tree's expectation."""
    from medusa_train.cli.build_tree import build_build_tree_config
    from medusa_train.cli.build_tree import run as build_tree
    from medusa_train.cli.evaluate import build_eval_config
    from medusa_train.cli.evaluate import run as evaluate

    export = trained / "export"
    fitted = build_tree(build_build_tree_config({
        "heads": str(export), "nodes": 12, "max_new_tokens": NEW_TOKENS, "guard_prompts": 4,
        "model": {"dtype": "float32"}, "device": "cpu", "output": str(tmp_path / "tree.yaml")}))
    report = evaluate(build_eval_config({
        "heads": str(export), "tree": fitted["path"], "bench": {"source": "validation", "turns": 1},
        "generation": {"max_new_tokens": NEW_TOKENS}, "model": {"dtype": "float32"}, "device": "cpu",
        "warmup": False, "progress": False, "baselines": {"prompt_lookup": False},
        "output_dir": str(tmp_path / "report")}))
    # the guard decoded the hybrid, the draft alone and the lookup chain alone: each as its walk expected (float32, the
    # same text), and it kept what its rule says of the rates it measured, and wrote that tree
    from medusa_train.tree.guard import choose

    guard = fitted["guard"]
    measured = guard["measured"]
    assert set(measured) == {"hybrid", "draft alone", "lookup chain alone"}
    for name, m in measured.items():
        assert m["tokens_per_step"] == pytest.approx(m["expected_tokens_per_step"], abs=1e-4), (name, measured)
    rates = {n: m["tokens_per_s"] for n, m in measured.items()}
    assert guard["kept"] == choose(rates, {n: m["nodes"] for n, m in measured.items()}, guard["margin"])[0], guard
    written = len(fitted["choices"]) + 1 + fitted["lookup_depth"]
    assert written == measured[guard["kept"]]["nodes"], (written, guard)
    assert (fitted["lookup_depth"] == 0) == (guard["kept"] == "draft alone")
    assert (len(fitted["choices"]) == 0) == (guard["kept"] == "lookup chain alone")
    assert report["expected"]["tokens_per_forward"] == pytest.approx(fitted["expected_accept_length"], abs=1e-4)
    assert report["expected"]["gap"] == pytest.approx(0, abs=2e-4), (report["expected"], report["mean_accepted_length"])
    assert report["mismatches"] == 0
