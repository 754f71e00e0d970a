import pytest
import torch

from medusa_train import MedusaModel
from medusa_train.families.medusa.heads import MedusaHead, ResBlock


def test_resblock_starts_as_identity():
    block = ResBlock(16)
    x = torch.randn(3, 5, 16)
    assert torch.equal(block.linear.weight, torch.zeros(16, 16))
    assert torch.equal(block.linear.bias, torch.zeros(16))
    assert torch.equal(block(x), x)  # SiLU(0) = 0 exactly


def test_layers_and_heads_share_no_parameters(tiny_llama):
    model = MedusaModel.from_backbone(tiny_llama, num_heads=3, num_layers=2)
    head_params = [p for head in model.heads for p in head.parameters()]
    assert len({p.data_ptr() for p in head_params}) == len(head_params)
    assert len(model.heads[0].blocks) == 2
    lm_ptr = tiny_llama.get_output_embeddings().weight.data_ptr()
    assert all(p.data_ptr() != lm_ptr for p in head_params)  # a clone, not the LM head itself


@pytest.mark.parametrize("share_lm_head", [False, True])
@pytest.mark.parametrize("num_layers", [0, 1, 2])
def test_heads_at_init_reproduce_lm_head_exactly(tiny_backbone, share_lm_head, num_layers):
    model = MedusaModel.from_backbone(tiny_backbone, num_heads=3, num_layers=num_layers, share_lm_head=share_lm_head)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        out = model(ids, return_base_logits=True)
        reference = tiny_backbone(ids).logits
        assert torch.equal(out.base_logits, reference)
        for k in range(3):
            assert torch.equal(model.head_logits(out.hidden_states, k), reference)


def test_heads_reproduce_tied_lm_head():
    from helpers.backbones import make_tiny_backbone

    backbone = make_tiny_backbone("llama", tie=True)
    assert backbone.get_output_embeddings().weight is backbone.get_input_embeddings().weight
    model = MedusaModel.from_backbone(backbone, num_heads=2)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(model.head_logits(model(ids).hidden_states, 1), backbone(ids).logits)
    # training the clone must not touch the (tied) embeddings
    assert model.heads[0].lm_head.weight.data_ptr() != backbone.get_input_embeddings().weight.data_ptr()


def test_shared_head_has_no_output_layer_of_its_own():
    head = MedusaHead(8, 32, num_layers=1, share_lm_head=True)
    assert head.lm_head is None
    with pytest.raises(ValueError, match="shared_lm_head"):
        head(torch.zeros(1, 8))


@pytest.mark.slow
def test_heads_at_init_reproduce_lm_head_on_packaged_model(packaged_backbone):
    backbone, tokenizer = packaged_backbone
    model = MedusaModel.from_backbone(backbone, num_heads=4, num_layers=1)
    ids = tokenizer("Medusa heads guess several tokens at once.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, return_base_logits=True)
        diffs = [(model.head_logits(out.hidden_states, k) - out.base_logits).abs().max().item() for k in range(4)]
        assert diffs == [0.0] * 4
        assert torch.equal(out.base_logits, backbone(ids).logits)


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_all_head_logits_equals_each_head_alone(tiny_llama, share_lm_head):
    model = MedusaModel.from_backbone(tiny_llama, num_heads=3, num_layers=1, share_lm_head=share_lm_head)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(std=0.1)
        hidden = torch.randn(2, 5, 64)
        stacked = model.all_head_logits(hidden)
        assert stacked.shape == (3, 2, 5, 256)
        for k in range(3):
            torch.testing.assert_close(stacked[k], model.head_logits(hidden, k), rtol=1e-6, atol=1e-6)
        assert model.all_head_logits(hidden, 2).shape[0] == 2
