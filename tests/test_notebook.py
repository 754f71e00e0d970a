"""notebooks/quickstart.ipynb: stored clean, and when run top to bottom on exported heads it prints what
the library computes (recomputed here, outside the notebook): greedy Medusa text equal to plain greedy
decoding, the step count, one coloured span per verify step, and the per-head acceptance rates."""

import re

import nbformat
import pytest
import torch
from helpers import ROOT
from helpers.training import make_model_dir
from nbclient import NotebookClient

from medusa_train import MedusaModel, TokenTree, load_backbone, load_tokenizer, tree_generate

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
PROMPT, MAX_NEW_TOKENS = "Hello there", 24


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def cell_output(nb, marker: str) -> tuple[str, list[dict]]:
    """What the one code cell whose source contains ``marker`` printed (stdout; progress bars go to
    stderr), and all its outputs."""
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    return "".join(o.text for o in cell.outputs if o.get("name") == "stdout"), cell.outputs


@pytest.mark.integration
def test_notebook_runs_top_to_bottom_and_prints_what_the_library_computes(tmp_path, monkeypatch, one_thread):
    backbone, _ = load_backbone(make_model_dir(tmp_path / "model"), dtype="float32")
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    heads = tmp_path / "heads"
    model.save_pretrained(heads)
    for key, value in {"MEDUSA_HEADS": str(heads), "MEDUSA_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
                       "MEDUSA_PROMPT": PROMPT, "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)  # the kernel inherits the environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    # the same steps, here: the exported heads, the prompt, plain greedy decoding and Medusa's
    model = MedusaModel.from_pretrained(heads, dtype="float32").eval()
    tokenizer = load_tokenizer(model.config.base_model_name_or_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        plain = model.backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
    out = tree_generate(model, ids, tree=TokenTree.from_name("default", num_heads=4), max_new_tokens=MAX_NEW_TOKENS)
    assert out.sequences.tolist() == plain.tolist()
    plain_text = tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)

    loaded, _ = cell_output(nb, "MedusaModel.from_pretrained(HEADS")
    assert loaded.startswith(f"heads from {heads}: 4 heads x 1 layer(s)\n")
    generated, _ = cell_output(nb, "out = tree_generate(")
    assert generated == (f"{plain_text}\n\n{plain.shape[1] - ids.shape[1]} tokens in {out.steps} verify steps: "
                         f"{out.mean_accept_length:.2f} tokens per step\n")
    _, shown = cell_output(nb, "display(HTML(")
    html = "".join(o["data"]["text/html"] for o in shown if "text/html" in o.get("data", {}))
    assert re.findall(r'title="(step \d+: \d+ token\(s\))"', html) == [
        f"step {i + 1}: {n} token(s)" for i, n in enumerate(out.accept_lengths)]
    unchanged, _ = cell_output(nb, "identical = torch.equal(")
    assert unchanged == "token-identical to plain greedy decoding: True\n"
    rates, plotted = cell_output(nb, "head_acceptance_rates(")
    expected = {f"head{k + 1}": round(r, 3) for k, r in enumerate(out.head_acceptance_rates(4))}
    assert rates == f"{expected}\n"
    assert any("image/png" in o.get("data", {}) for o in plotted)
