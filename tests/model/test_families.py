"""Every registered draft family through the pipeline: trained (a few steps) by its method from the methods table,
written in each layout its family declares, loaded back through the family table, and decoded: greedy output is
plain greedy decoding's, and the same draft made an oracle (its scores put the backbone's own continuation first)
is accepted in full at every step, so a family whose proposals are garbage, or mapped to the wrong tokens or tree
nodes, fails. Each family's model and config are checked against the contract (``model/contract.py``'s runtime-checkable
Protocols). A new family is tested by registering it (``model/family.py``) and giving it an oracle here."""

from __future__ import annotations

import pytest
import torch
from helpers.decoding import hf_greedy
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, train_overrides

from medusa_train.config.methods import METHODS
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.model.contract import CapturedStates, DraftConfig, DraftModel
from medusa_train.model.family import FAMILIES, captured_for, family_of, family_of_model
from medusa_train.model.files import read_config_json

NEW_TOKENS = 40


def _oracle_scores(model, reference: torch.Tensor, vocab: int, to_index):
    """``scores(rows, offset) -> (rows, vocab)`` putting ``reference``'s token ``offset`` past the current root first,
    and the wrapped ``model.propose`` that tells it where the root is: the tokens verified so far, counted from what
    every family's ``propose`` is handed (the prompt at the first step, then what each step accepted)."""
    tokens = reference[0].tolist()
    seen = {"verified": 0}
    propose = model.propose

    def counting_propose(tree, accepted_inputs, accepted_tokens, root_token, state):
        seen["verified"] += accepted_tokens.reshape(-1).shape[0]
        return propose(tree, accepted_inputs, accepted_tokens, root_token, state)

    def scores(rows: int, offset: int) -> torch.Tensor:
        out = torch.zeros(rows, vocab)
        target = seen["verified"] + offset  # the root is token `verified`; depth d guesses the one d + 1 past it
        if target < len(tokens):
            index = int(to_index(torch.tensor([tokens[target]]))[0])
            if index >= 0:
                out[:, index] = 1.0
        return out

    model.propose = counting_propose
    return scores


def oracle_medusa(model, reference: torch.Tensor) -> None:
    """Head k scores the reference's token k + 2 past the last verified position first."""
    scores = _oracle_scores(model, reference, model.config.head_vocab_size, model.head_indices)
    model.head_logits = lambda inputs, k: scores(inputs.reshape(-1, inputs.shape[-1]).shape[0], k + 1).reshape(
        *inputs.shape[:-1], -1)


def oracle_eagle3(model, reference: torch.Tensor) -> None:
    """The draft's step d (its d-th scoring within one proposal) scores the reference's token d + 2 past the last
    verified position first."""
    scores = _oracle_scores(model, reference, model.config.draft_vocab_size, model.draft_indices)
    calls = {"propose": model.propose}

    def propose(*args):
        calls["depth"] = 0
        return calls["propose"](*args)

    def logits(normed: torch.Tensor) -> torch.Tensor:
        calls["depth"] += 1
        return scores(normed.reshape(-1, normed.shape[-1]).shape[0], calls["depth"])

    model.propose = propose
    model.draft.logits = logits


def oracle_peagle(model, reference: torch.Tensor) -> None:
    """The draft's one pass a step: its row d (the root's, then each masked slot's) scores the reference's token d + 2
    past the last verified position first."""
    scores = _oracle_scores(model, reference, model.config.draft_vocab_size, model.draft_indices)
    model.draft.logits = lambda normed: torch.cat([scores(1, d + 1) for d in range(normed.reshape(-1, normed.shape[-1]).shape[0])])


ORACLES = {"medusa": oracle_medusa, "eagle3": oracle_eagle3, "peagle": oracle_peagle}


def test_every_registered_family_has_an_oracle_and_a_method_that_trains_it():
    assert set(ORACLES) == set(FAMILIES)
    assert {m.family for m in METHODS.values()} == set(FAMILIES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    # 8 layers: the EAGLE-3 draft's default layers (2, L // 2, L - 3) are three distinct ones
    return make_model_dir(root / "model", layers=8), make_chat_jsonl(root / "chat.jsonl", n=24)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_trains_exports_each_layout_loads_and_decodes_losslessly(name, tiny, tmp_path):
    from medusa_train import load_backbone
    from medusa_train.cli.train import run
    from medusa_train.export.write import export_folder
    from medusa_train.model.load import load_draft
    from medusa_train.training.run_folder import RunFolder

    model_dir, data = tiny
    method = next(m for m in METHODS.values() if m.family == name and not m.adapts_backbone)
    # the whole vocabulary: the oracle below makes the draft guess the backbone's every token, which a draft
    # vocabulary chosen from 2 steps' data may not hold
    cfg = compose_config(train_overrides(model_dir, data, tmp_path / "run", **{
        "trainer.max_steps": 2, "trainer.eval_every": 0, "trainer.save_every": 0, "eagle3.draft_vocab_size": "null"}),
        recipe=method.name)
    run(cfg)
    trained = RunFolder.of(cfg).export
    family, layout = family_of(read_config_json(trained))
    assert family is FAMILIES[name] and layout in family.layouts

    backbone, tokenizer = load_backbone(model_dir, dtype="float32")
    ids = tokenizer("one two three four", return_tensors="pt").input_ids
    plain = hf_greedy(backbone, ids, NEW_TOKENS, eos_token_id=[])
    for layout in family.layouts:
        folder = export_folder(trained, tmp_path / layout, layout)
        assert family_of(read_config_json(folder))[0] is family
        draft = load_draft(folder, backbone).eval()
        assert family_of_model(draft) is family
        # the contract every family provides, checked by shape (model/contract.py)
        assert isinstance(draft, DraftModel) and isinstance(draft.config, DraftConfig), (name, layout)
        assert isinstance(captured_for(cfg), CapturedStates)
        tree = TokenTree.chain(draft.config.depth)
        out = tree_generate(draft, ids, tree, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        assert torch.equal(out.sequences, plain), (name, layout)
        ORACLES[name](draft, plain)
        out = tree_generate(draft, ids, tree, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        assert torch.equal(out.sequences, plain), (name, layout)
        # every step but the last (cut at the token limit) keeps the whole chain
        assert out.accepted_depths[:-1] == [tree.depth] * (len(out.accepted_depths) - 1), (name, layout)
        assert len(out.accepted_depths) == -(-(NEW_TOKENS - 1) // (tree.depth + 1)), (name, layout)
