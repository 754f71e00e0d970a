"""Greedy replies to many prompts at once (``medusa_train/backbone/batched.py``, used by ``data/validation.py``).

What it must hold: where ``batch_rows`` says a step may take several prompts, every reply is token for token the
one HF ``generate`` gives its prompt alone (prompts of different lengths, replies ending at eos at different
steps, groups smaller than the batch), in float32 and, where the row kernel takes it, bfloat16; where a batched
step could round otherwise (layers off the kernel, another attention, one row asked) one prompt at a time, with
the reason; the validation replies of the packaged model the same made either way.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.decoding import hf_greedy, prompts
from transformers import AttentionInterface

from medusa_train.backbone.attention import use_grouped_attention
from medusa_train.backbone.batched import batch_rows, batched_greedy
from medusa_train.backbone.native import cpu_isa
from medusa_train.backbone.row_layers import row_kernel_during, use_row_kernel
from medusa_train.backbone.rows import row_dtypes, row_range

pytestmark = [
    pytest.mark.usefixtures("one_thread", "grouped"),
    pytest.mark.skipif(cpu_isa() is None or shutil.which("c++") is None,
                       reason="batched replies need the row kernel (AVX2/AVX-512 CPUs with a C++ compiler)"),
]
# a 1-token step on an Intel CPU runs MKL's GEMV, which rounds otherwise than the kernel: one prompt at a time there
exact_here = pytest.mark.skipif(row_range()[0] != 1, reason="a 1-token step runs torch's GEMV on this CPU")


@pytest.fixture
def grouped():
    """The decoders' attention registered for the test, whatever ``sdpa`` was before it after."""
    before = AttentionInterface._global_mapping["sdpa"]
    use_grouped_attention()
    yield
    AttentionInterface.register("sdpa", before)


def _alone(backbone, ids: list[torch.Tensor], max_new_tokens: int, eos: list[int]) -> list[list[int]]:
    """HF ``generate``'s greedy reply to each prompt alone, stopping at ``eos``."""
    return [hf_greedy(backbone, p, max_new_tokens, eos)[0, p.shape[1]:].tolist() for p in ids]


@pytest.mark.parametrize("arch, dtype", [("llama", torch.float32), ("qwen2", torch.float32),
                                         ("llama", torch.bfloat16)])
def test_each_batched_reply_is_generates_reply_to_its_prompt_alone(arch, dtype):
    if dtype not in row_dtypes():
        pytest.skip(f"the row kernel takes no {dtype} here")
    if row_range(dtype)[0] != 1:  # Intel's float32: MKL's GEMV takes 1-token steps (bf16 there: the kernel)
        pytest.skip(f"a 1-token {dtype} step runs torch's GEMV on this CPU")
    backbone = make_tiny_backbone(arch, seed=3).to(dtype)
    use_row_kernel(backbone)
    rows, why = batch_rows(backbone, wanted=3)
    assert rows == 3, why
    ids = prompts(7, seed=5)  # 1-23 tokens each: every group's rows padded differently
    assert len({p.shape[1] for p in ids}) > 3
    first = _alone(backbone, ids, 24, [backbone.config.eos_token_id])
    assert len(first[0]) > 9
    # an eos some replies reach part-way, so rows leave their group at different steps
    eos = [first[0][9]]
    alone = _alone(backbone, ids, 24, eos)
    lengths = {len(r) for r in alone}
    assert min(lengths) < 24 and max(lengths) == 24, lengths
    assert batched_greedy(backbone, ids, 24, eos, rows) == alone
    assert batched_greedy(backbone, ids[:2], 24, eos, rows) == alone[:2]  # a group smaller than the batch
    assert batched_greedy(backbone, ids, 1, eos, rows) == [r[:1] for r in alone]  # the prefill's token alone


def test_where_a_batched_step_could_round_otherwise_one_prompt_at_a_time():
    off_kernel = make_tiny_backbone("llama")
    rows, why = batch_rows(off_kernel)
    assert rows == 1 and "row kernel" in why
    eager = make_tiny_backbone("llama", attn_implementation="eager")
    use_row_kernel(eager)
    rows, why = batch_rows(eager)
    assert rows == 1 and ("attention" in why or "GEMV" in why)
    switched = make_tiny_backbone("llama")
    use_row_kernel(switched)
    assert batch_rows(switched, wanted=1) == (1, "one prompt at a time (asked)")
    with pytest.raises(ValueError, match="at least 1"):
        batched_greedy(switched, prompts(1), 0, [], 4)


@exact_here
@pytest.mark.slow
def test_the_packaged_models_validation_replies_are_the_same_made_either_way(packaged_backbone):
    from medusa_train.backbone.generation import encode_chat, eos_token_ids
    from medusa_train.data.validation import greedy_replies, validation_prompts

    backbone, tokenizer = packaged_backbone
    texts = validation_prompts("packaged:sharegpt-v3", 64)[:6]
    kept, sequences = greedy_replies(backbone, tokenizer, texts, 40, 256, progress=False)
    with row_kernel_during(backbone):
        assert batch_rows(backbone)[0] > 1  # made batched
        eos = eos_token_ids(backbone)
        for text, (ids, prompt_length) in zip(kept, sequences):
            prompt = encode_chat(tokenizer, [{"role": "user", "content": text}])
            assert torch.equal(ids[:, :prompt_length], prompt)
            assert ids[0, prompt_length:].tolist() == _alone(backbone, [prompt], 40, eos)[0]
