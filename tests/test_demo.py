"""scripts/demo.py: a larger distillation reuses a finished smaller one instead of starting over."""

import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_distill import KEEP_ALL, make_multiturn_jsonl, read_jsonl, tiny_config
from train_fixtures import make_model_dir

from medusa_train.backbone.load import load_backbone
from medusa_train.data.distill.run import build_distill_config, distill

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import demo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_a_larger_distillation_starts_from_the_largest_finished_smaller_one_and_equals_an_uninterrupted_run(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    model, tokenizer = load_backbone(model_dir, dtype="float32")
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 16, seed=3)
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "demo.yaml"), {"model": str(model_dir)})
    out = tmp_path / "out"
    out.mkdir()

    def run(num_prompts: int, output: Path):
        settings = tiny_config(model_dir, source, output, num_prompts=num_prompts, batch_size=2, sort_window=2,
                               generation={"max_new_tokens": 16}, **KEEP_ALL)
        return distill(build_distill_config(settings), model, tokenizer)

    reference = run(12, tmp_path / "reference.jsonl")
    assert reference.records == 12
    run(4, demo.distill_path(out, cfg, 4))  # finished too, but smaller
    smaller = demo.distill_path(out, cfg, 8)
    run(8, smaller)
    before = smaller.read_bytes()
    # neither may be taken: 10 prompts, but not finished; 11 prompts, but other settings (another key)
    unfinished = demo.distill_path(out, cfg, 10)
    unfinished.write_bytes(before)
    unfinished.with_suffix(".stats.json").write_text(json.dumps({"complete": False}))
    other = OmegaConf.merge(cfg, {"distill": {"max_new_tokens": 7}})
    elsewhere = demo.distill_path(out, other, 11)
    run(11, elsewhere)
    assert demo.distill_path(out, cfg, 11) != elsewhere

    larger = OmegaConf.merge(cfg, {"distill": {"num_prompts": 12}})
    target = demo.distill_path(out, larger, 12)
    assert demo.seed_distillation(out, larger) == (8, smaller)
    assert target.read_bytes() == before
    assert demo.seed_distillation(out, larger) is None  # the target exists: distill resumes it itself

    resumed = run(12, target)
    assert resumed.resumed_records == 8 and resumed.records == 12
    records = read_jsonl(target)
    assert records == read_jsonl(tmp_path / "reference.jsonl")  # same replies, same order, none twice
    assert smaller.read_bytes() == before  # the smaller run is left as it was
    assert demo.seed_distillation(out, OmegaConf.merge(cfg, {"distill": {"num_prompts": 8}})) is None


@pytest.mark.parametrize("override, named", [
    ({"recipe": "medusa3"}, "recipe=medusa3: must be medusa1 or medusa2"),
    ({"train": {"dtype": "float16"}}, "train.dtype=float16: must be bfloat16 or float32"),
    ({"recipe": "medusa2", "medusa2": {"stage1_epochs": 6}}, "medusa2.stage1_epochs=6: must be in [0, train.epochs=6)"),
    ({"recipe": "medusa2", "medusa2": {"stage1_epochs": -1}}, "medusa2.stage1_epochs=-1"),
])
def test_an_impossible_demo_setting_stops_before_anything_runs_and_names_the_key(override, named):
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "demo.yaml"), override)
    with pytest.raises(SystemExit) as stopped:
        demo.check(cfg)
    assert named in str(stopped.value.code)


def test_medusa2_and_float32_runs_get_their_own_folders_and_a_default_run_keeps_its_old_one():
    cfg = OmegaConf.load(ROOT / "configs" / "demo.yaml")
    demo.check(cfg)
    demo.check(OmegaConf.merge(cfg, {"recipe": "medusa2", "medusa2": {"stage1_epochs": 0}}))
    before_dtype = OmegaConf.masked_copy(cfg.train, [k for k in cfg.train if k != "dtype"])
    assert demo._key(demo._train_key(cfg.train)) == demo._key(before_dtype)  # train.dtype=bfloat16: the old key
    as_float32 = OmegaConf.merge(cfg.train, {"dtype": "float32"})
    assert demo._key(demo._train_key(as_float32)) != demo._key(before_dtype)
