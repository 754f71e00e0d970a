"""Heads with a draft vocabulary (``heads.draft_vocab_size=K``): the K most frequent training targets, a
``token_map`` back to token ids, exact greedy output, the layouts that hold it and those that refuse it."""

import json

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, train_overrides
from safetensors.torch import load_file

from medusa_train import MedusaModel
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.evaluation.engines import engine_rows
from medusa_train.families.medusa.export import export_heads
from medusa_train.families.medusa.propose import heads_candidates
from medusa_train.model.draft_vocab import most_frequent_tokens
from medusa_train.training.targets import Teacher, inputs_and_targets
from medusa_train.tree.calibrate import measure_rank_accuracies

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN = 256, 64
TOKEN_MAP = torch.tensor(sorted({1, 2, *range(3, 256, 5)}))  # 53 tokens, EOS (1) among them


def _heads(backbone, share_lm_head, token_map=TOKEN_MAP, seed=0, **features):
    model = MedusaModel.from_backbone(backbone, 4, 1, share_lm_head=share_lm_head, token_map=token_map, **features)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _full_twin(draft: MedusaModel) -> MedusaModel:
    """The same head weights scoring the whole vocabulary (own output layers: rows outside the map at -1e4
    below everything, so the full heads' ranking over the map's tokens is the draft heads')."""
    full = MedusaModel.from_backbone(draft.backbone, draft.num_heads, draft.config.num_layers,
                                     share_lm_head=draft.config.share_lm_head)
    state = {k: v for k, v in draft.heads_state_dict().items() if k != "token_map"}
    for k in range(draft.num_heads):
        key = f"heads.{k}.lm_head.weight"
        if key in state:
            weight = torch.zeros(VOCAB, HIDDEN)
            weight[draft.token_map] = state[key]
            state[key] = weight
    full.heads.load_state_dict({k.removeprefix("heads."): v for k, v in state.items()})
    return full


def _masked(logits: torch.Tensor, token_map: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    out[..., token_map] = logits[..., token_map]
    return out


# ------------------------------------------------------------------------------------ the map
def test_most_frequent_tokens_counts_trained_labels_ties_to_the_lower_id():
    labels = [[5, 5, 5, IGNORE_INDEX, 9, 9, 7], [7, 9, IGNORE_INDEX, 3, 3, 3, 3]]
    # counts: 3 -> 4, 5 -> 3, 9 -> 3, 7 -> 2; ignored labels do not count
    assert most_frequent_tokens(labels, 2, 16).tolist() == [3, 5]
    assert most_frequent_tokens(labels, 3, 16).tolist() == [3, 5, 9]  # 5 and 9 tie: both kept at 3
    assert most_frequent_tokens(labels, 5, 16).tolist() == [0, 3, 5, 7, 9]  # filled with unseen token 0
    with pytest.raises(ValueError, match="heads.draft_vocab_size=16"):
        most_frequent_tokens(labels, 16, 16)
    with pytest.raises(ValueError, match="outside the backbone's 8-token vocabulary"):
        most_frequent_tokens(labels, 2, 8)


def test_a_bad_token_map_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="distinct token ids below 256"):
        MedusaModel.from_backbone(tiny_llama, 2, token_map=torch.tensor([3, 3, 4]))
    with pytest.raises(ValueError, match="distinct token ids below 256"):
        MedusaModel.from_backbone(tiny_llama, 2, token_map=torch.tensor([3, 300]))


# ------------------------------------------------------------------------------------ what the heads compute
@pytest.mark.parametrize("share_lm_head", [False, True])
def test_fresh_draft_heads_score_the_lm_heads_rows_of_their_tokens(tiny_llama, share_lm_head):
    draft = MedusaModel.from_backbone(tiny_llama, 2, share_lm_head=share_lm_head, token_map=TOKEN_MAP)
    full = MedusaModel.from_backbone(tiny_llama, 2, share_lm_head=share_lm_head)
    hidden = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for k in range(2):
        torch.testing.assert_close(draft.head_logits(hidden, k), full.head_logits(hidden, k)[..., TOKEN_MAP],
                                   rtol=0, atol=1e-5)
    torch.testing.assert_close(draft.all_head_logits(hidden), full.all_head_logits(hidden)[..., TOKEN_MAP],
                               rtol=0, atol=1e-5)
    assert draft.guessed_tokens(torch.tensor([0, 2])).tolist() == TOKEN_MAP[[0, 2]].tolist()
    assert draft.head_indices(torch.tensor([TOKEN_MAP[4], 4, IGNORE_INDEX])).tolist() == [4, -1, -1]


@pytest.mark.parametrize("share_lm_head", [False, True])
@pytest.mark.parametrize("tree_name", ["default", "chain"])
def test_candidates_are_the_full_heads_top_k_within_the_draft_vocabulary(share_lm_head, tree_name):
    backbone = make_tiny_backbone("llama", seed=3)
    draft = _heads(backbone, share_lm_head)
    full = _full_twin(draft)
    full_logits = full.head_logits
    full.head_logits = lambda inputs, k: _masked(full_logits(inputs, k), TOKEN_MAP)  # what vLLM does with a map
    if share_lm_head:
        full.all_head_logits = lambda inputs, n=None: torch.stack(
            [full.head_logits(inputs, k) for k in range(n or full.num_heads)])
    tree = TokenTree.from_name(tree_name, num_heads=4)
    hidden = draft(torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))).hidden_states[0]
    got = heads_candidates(draft, tree, hidden, 7, draft.new_decode_state())
    want = heads_candidates(full, tree, hidden, 7, full.new_decode_state())
    assert got.tolist() == want.tolist()
    assert set(got[1:].tolist()) <= set(TOKEN_MAP.tolist())


@pytest.mark.parametrize("features", [{}, {"next_token_input": True, "path_input": True, "prefix_attention": True}])
def test_greedy_output_is_the_backbones_with_a_draft_vocabulary(features):
    backbone = make_tiny_backbone("qwen2", seed=5)
    model = _heads(backbone, share_lm_head=True, **features)
    tree = TokenTree.from_name("default", num_heads=4)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (1, int(torch.randint(2, 20, (), generator=g))), generator=g)
        ref = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
                                eos_token_id=1, pad_token_id=0)
        out = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=1)
        assert out.sequences.tolist() == ref.tolist()


def test_calibration_counts_a_token_outside_the_map_as_never_guessed():
    backbone = make_tiny_backbone("llama", seed=6)
    draft = _heads(backbone, share_lm_head=False)
    full = _full_twin(draft)
    full_logits = full.head_logits
    full.head_logits = lambda inputs, k: _masked(full_logits(inputs, k), TOKEN_MAP)
    g = torch.Generator().manual_seed(2)
    sequences = [(torch.randint(3, VOCAB, (1, 40), generator=g), 5) for _ in range(3)]
    got, counts = measure_rank_accuracies(draft, sequences, top_k=4)
    want, want_counts = measure_rank_accuracies(full, sequences, top_k=4)
    assert counts == want_counts
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0)
    # random text: most targets lie outside the 53 tokens, so ranks 0-3 cover few of them
    assert sum(got[0]) < 0.5


# ------------------------------------------------------------------------------------ training targets
@pytest.mark.parametrize("kind", ["text", "greedy", "teacher"])
def test_targets_are_indices_in_the_draft_vocabulary(tiny_llama, kind):
    draft = MedusaModel.from_backbone(tiny_llama, 2, share_lm_head=True, token_map=TOKEN_MAP)
    full = MedusaModel.from_backbone(tiny_llama, 2, share_lm_head=True)
    prompt = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    text = tiny_llama.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                               min_new_tokens=12, pad_token_id=0)  # the backbone's own greedy text: greedy targets
    labels = text.clone()
    labels[:, :3] = IGNORE_INDEX
    if kind != "greedy":
        labels[:, 5::4] = TOKEN_MAP[7]  # more targets inside the map
    hidden = full(text).hidden_states
    _, want = inputs_and_targets(kind, full, hidden, labels)
    _, got = inputs_and_targets(kind, draft, hidden, labels)
    index = {t: i for i, t in enumerate(TOKEN_MAP.tolist())}
    expected = [[[index.get(t, IGNORE_INDEX) for t in row] for row in head] for head in want.tokens.tolist()]
    assert got.tokens.tolist() == expected
    assert (got.tokens != IGNORE_INDEX).any()
    if kind == "teacher":
        valid = got.tokens != IGNORE_INDEX
        full_window = Teacher(full.base_logits, hidden).window(0, valid)
        full_probs = full_window.probs[full_window.rows(1, valid[1])]
        restricted = full_probs[:, TOKEN_MAP] / full_probs[:, TOKEN_MAP].sum(-1, keepdim=True)
        window = got.teacher.window(0, valid)
        torch.testing.assert_close(window.probs[window.rows(1, valid[1])], restricted, rtol=1e-5, atol=1e-6)
        assert window.probs.shape[-1] == len(TOKEN_MAP)


# ------------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("share_lm_head", [False, True])
def test_native_holds_the_map_and_loads_back_identical(tmp_path, tiny_llama, share_lm_head):
    model = _heads(tiny_llama, share_lm_head)
    export_heads(model, tmp_path, "native")
    loaded = MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)
    assert loaded.config.draft_vocab_size == len(TOKEN_MAP)
    assert torch.equal(loaded.token_map, TOKEN_MAP)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    for k in range(4):
        assert torch.equal(loaded.head_logits(hidden, k), model.head_logits(hidden, k))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["token_map"], TOKEN_MAP) and tensors["token_map"].dtype == torch.int64


def test_vllm_gets_shared_draft_heads_with_the_whole_lm_head_and_no_token_map(tmp_path, tiny_llama):
    """vLLM 0.32 refuses every token_map at load (tests/engine shows it loads this form): the export keeps
    the ResBlocks bit-exact and the whole LM head, so the heads there score every token."""
    model = _heads(tiny_llama, share_lm_head=True)
    export_heads(model, tmp_path, "vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert "token_map" not in tensors
    assert (config["truncated_vocab_size"], config["vocab_size"], config["original_lm_head"]) == (VOCAB, VOCAB, True)
    assert torch.equal(tensors["lm_head.weight"], tiny_llama.lm_head.weight)
    loaded = MedusaModel.from_pretrained(tmp_path, backbone=tiny_llama)
    assert loaded.config.draft_vocab_size is None and loaded.config.share_lm_head
    full = _full_twin(model)  # the draft heads' blocks with every LM head row
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    for k in range(4):
        assert torch.equal(loaded.head_logits(hidden, k), full.head_logits(hidden, k))
        torch.testing.assert_close(loaded.head_logits(hidden, k)[..., TOKEN_MAP], model.head_logits(hidden, k))


def test_vllm_refuses_draft_heads_with_their_own_output_layers_saying_why(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match=r"format=vllm: .*own output layers.*refuses any token_map.*no bias"):
        export_heads(_heads(tiny_llama, share_lm_head=False), tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists()


def test_medusa_v1_refuses_a_draft_vocabulary_naming_the_key(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match=r"format=medusa_v1: .*heads.draft_vocab_size.*format=vllm"):
        export_heads(_heads(tiny_llama, False), tmp_path, "medusa_v1")


def test_engine_rows_say_why_tgi_and_trtllm_cannot_load_a_draft_vocabulary(tiny_llama):
    model = _heads(tiny_llama, True)
    rows = engine_rows(model, [torch.tensor([[5, 6, 7]])], TokenTree.from_name("default", num_heads=4), 1.5,
                       max_new_tokens=8, eos=[1])
    assert rows["vllm"]["mean_accepted_length"] is not None and rows["vllm"]["reason"] is None
    own = engine_rows(_heads(tiny_llama, False), [torch.tensor([[5, 6, 7]])], TokenTree.chain(4), 1.5,
                      max_new_tokens=8, eos=[1])
    assert own["vllm"]["mean_accepted_length"] is None and "no faithful form" in own["vllm"]["reason"]
    assert rows["native"]["mean_accepted_length"] == 1.5
    for engine in ("tgi", "trtllm"):
        assert rows[engine]["mean_accepted_length"] is None and "token_map" in rows[engine]["reason"]


# ------------------------------------------------------------------------------------ training
def test_training_with_heads_vocab_size_exports_the_data_s_most_frequent_tokens(tmp_path):
    from transformers import AutoTokenizer

    from medusa_train.cli.train import run
    from medusa_train.data import build_datasets

    model_dir, data = make_model_dir(tmp_path / "model"), make_chat_jsonl(tmp_path / "chat.jsonl")
    cfg = compose_config(train_overrides(model_dir, data, tmp_path / "run", **{
        "trainer.max_steps": 30, "trainer.eval_every": 30, "heads.draft_vocab_size": 24, "heads.share_lm_head": True}))
    run(cfg)
    model = MedusaModel.from_pretrained(tmp_path / "run" / "export", dtype="float32")
    train, _, _ = build_datasets(AutoTokenizer.from_pretrained(model_dir), str(data), 96, None, 8, cfg.data.seed)
    want = most_frequent_tokens((e["labels"] for e in train), 24, model.config.vocab_size)
    assert model.config.draft_vocab_size == 24 and torch.equal(model.token_map, want)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if m["split"] == "eval"]
    assert evals[-1]["head1/top1"] > evals[0]["head1/top1"] + 0.2  # counting is learnt within the 24 tokens


def test_init_from_heads_of_another_vocabulary_size_is_refused_naming_the_key(tmp_path):
    from transformers import AutoModelForCausalLM

    from medusa_train.families.medusa.recipe import build_heads

    model_dir, data = make_model_dir(tmp_path / "model"), make_chat_jsonl(tmp_path / "chat.jsonl")
    backbone = AutoModelForCausalLM.from_pretrained(model_dir)
    MedusaModel.from_backbone(backbone, 3, share_lm_head=True).save_pretrained(tmp_path / "heads")
    overrides = {"heads.init_from": tmp_path / "heads", "heads.share_lm_head": True}
    cfg = compose_config(train_overrides(model_dir, data, tmp_path / "run", **overrides, **{"heads.draft_vocab_size": 24}))
    with pytest.raises(ValueError, match=r"holds heads with heads.draft_vocab_size=null: set these to match"):
        build_heads(cfg, backbone, torch.device("cpu"), [])
    same = compose_config(train_overrides(model_dir, data, tmp_path / "run", **overrides))
    assert build_heads(same, backbone, torch.device("cpu"), []).token_map is None


def test_choose_draft_vocab_weighs_coverage_against_what_a_step_reads():
    from medusa_train.model.draft_vocab import choose_draft_vocab

    counts = torch.zeros(1024, dtype=torch.long)
    counts[:64] = 10  # 640 of the 1,000 targets among the top 64 tokens, 768 among 128, 896 among 256, all among 360
    counts[64:128] = 2
    counts[128:360] = 1
    assert int(counts.sum()) == 1000
    # hidden 10, a 1,000-weight draft layer, a 30,000-weight plain step: a size costs (1,000 + 10 size) / 30,000
    size, options = choose_draft_vocab(counts, 10, 1_000, 30_000, acceptance=0.5)
    assert [o.size for o in options] == [64, 128, 256, 512, 1024]
    assert [round(o.coverage, 3) for o in options] == [0.64, 0.768, 0.896, 1.0, 1.0]
    by_hand = {k: (1 + 0.5 * c) / (1 + (1_000 + 10 * k) / 30_000)
               for k, c in {64: 0.64, 128: 0.768, 256: 0.896, 512: 1.0, 1024: 1.0}.items()}
    assert {o.size: round(o.score, 6) for o in options} == {k: round(v, 6) for k, v in by_hand.items()}
    assert size == 256  # 1.294, against 1.286 at 128 and 1.246 at 512
    # an output layer that costs nothing: the whole vocabulary covers most; every target in 64 tokens: the smallest
    assert choose_draft_vocab(counts, 0, 1_000, 10_000)[0] == 512  # 512 and 1,024 tie at full coverage: the smaller
    counts[64:] = 0
    assert choose_draft_vocab(counts, 10, 1_000, 10_000)[0] == 64


def test_step_weights_count_what_a_plain_step_reads(tiny_llama):
    from medusa_train.families.eagle3.config import Eagle3Config, Eagle3Draft
    from medusa_train.model.draft_vocab import step_weights

    every = sum(p.numel() for p in tiny_llama.parameters())
    embedding = tiny_llama.get_input_embeddings().weight.numel()
    assert step_weights(tiny_llama.config) == every - embedding  # untied: the input embedding is read one row at a time
    tied = make_tiny_backbone(tie=True)
    assert step_weights(tied.config) == sum(p.numel() for p in tied.parameters())  # tied: the LM head, read whole
    config = Eagle3Config.for_backbone(make_tiny_backbone(layers=4), aux_layer_ids=[0, 1, 3])
    draft = Eagle3Draft(config)
    assert config.layer_weights() == sum(p.numel() for n, p in draft.named_parameters() if not n.startswith("lm_head"))
