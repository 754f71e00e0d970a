"""``benchmarks/restrict.py``: trained full-vocabulary heads restricted to a draft vocabulary (``benchmarks vocab``)."""

import pytest
import torch

from benchmarks.restrict import restrict_heads
from medusa_train import MedusaModel

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 64
TOKEN_MAP = torch.tensor(sorted({1, 2, *range(3, 256, 5)}))  # 53 tokens, EOS (1) among them


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_restricted_trained_heads_score_their_own_logits_at_the_maps_tokens(tiny_llama, share_lm_head):
    full = MedusaModel.from_backbone(tiny_llama, 2, share_lm_head=share_lm_head)
    with torch.no_grad():
        for p in full.heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    restricted = restrict_heads(full, TOKEN_MAP)
    assert restricted.config.draft_vocab_size == len(TOKEN_MAP) and torch.equal(restricted.token_map, TOKEN_MAP)
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(4))
    for k in range(2):
        torch.testing.assert_close(restricted.head_logits(hidden, k), full.head_logits(hidden, k)[..., TOKEN_MAP],
                                   rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="already score a draft vocabulary"):
        restrict_heads(restricted, TOKEN_MAP)
