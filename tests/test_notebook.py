import os
from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient
from train_fixtures import make_model_dir

from medusa_train import MedusaModel, load_backbone

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_runs_top_to_bottom_on_exported_heads(tmp_path, monkeypatch):
    backbone, _ = load_backbone(make_model_dir(tmp_path / "model"), dtype="float32")
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "heads")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"MEDUSA_HEADS": str(tmp_path / "heads"), "MEDUSA_MAX_NEW_TOKENS": "24", "MEDUSA_PROMPT": "Hello there"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert f"heads from {tmp_path / 'heads'}: 4 heads" in outputs
    assert "token-identical to plain greedy decoding: True" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert any("text/html" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert os.environ["MEDUSA_HEADS"]
