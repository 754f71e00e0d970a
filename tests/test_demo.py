"""The demo (``medusa-train demo``): settings checked before anything runs, folders keyed by the settings of their
stage and the stages before it, and a larger distillation that reuses a finished smaller one instead of starting over."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.distill import KEEP_ALL, make_multiturn_jsonl, read_jsonl, tiny_config
from helpers.training import make_model_dir

from medusa_train.backbone.load import load_backbone
from medusa_train.config.check import ConfigError, parse_config
from medusa_train.config.compose import compose_config
from medusa_train.config.demo import DemoConfig
from medusa_train.data.distill import build_distill_config, distill
from medusa_train.pipeline import demo

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def demo_config(*overrides: str) -> DemoConfig:
    """configs/commands/demo.yaml with command-line overrides, read as the demo reads it (its run()
    then turns dtype=auto into this machine's fast dtype)."""
    return demo.build(compose_config("demo", list(overrides)))


def test_a_larger_distillation_starts_from_the_largest_finished_smaller_one_and_equals_an_uninterrupted_run(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    model, tokenizer = load_backbone(model_dir, dtype="float32")
    source = make_multiturn_jsonl(tmp_path / "chat.jsonl", 16, seed=3)
    cfg = demo_config(f"model={model_dir}")
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
    other = replace(cfg, distill=replace(cfg.distill, max_new_tokens=7))
    elsewhere = demo.distill_path(out, other, 11)
    run(11, elsewhere)
    assert demo.distill_path(out, cfg, 11) != elsewhere

    larger = replace(cfg, distill=replace(cfg.distill, num_prompts=12))
    target = demo.distill_path(out, larger, 12)
    assert demo.seed_distillation(out, larger) == (8, smaller)
    assert target.read_bytes() == before
    assert demo.seed_distillation(out, larger) is None  # the target exists: distill resumes it itself

    resumed = run(12, target)
    assert resumed.resumed_records == 8 and resumed.records == 12
    records = read_jsonl(target)
    assert records == read_jsonl(tmp_path / "reference.jsonl")  # same replies, same order, none twice
    assert smaller.read_bytes() == before  # the smaller run is left as it was
    assert demo.seed_distillation(out, replace(cfg, distill=replace(cfg.distill, num_prompts=8))) is None


@pytest.mark.parametrize("overrides, named", [
    (["recipe=medusa3"], "recipe='medusa3': must be medusa1, medusa2, eagle3 or peagle"),
    (["recipe=eagle3"], "train.experiment='demo': recipe=eagle3 trains with its own preset: add train.experiment=eagle3"),
    (["train.dtype=float16"], "train.dtype='float16': must be one of auto, float32, bfloat16 (or fp32, bf16)"),
    (["recipe=medusa2", 'train.overrides=["trainer.epochs=6"]', "medusa2.stage1_epochs=6"],
     "medusa2.stage1_epochs=6: must be in [0, trainer.epochs=6)"),
    (["recipe=medusa2", "medusa2.stage1_epochs=4"], "medusa2.stage1_epochs=4: must be in [0, trainer.epochs=4)"),
    (["recipe=medusa2", "medusa2.stage1_epochs=-1"], "medusa2.stage1_epochs=-1"),
    (['train.overrides=["trainer.epochs=two"]'], "trainer.epochs='two': expected int"),
    (["eval.dtype=fp16"], "eval.dtype='fp16': must be one of auto, float32, bfloat16 (or fp32, bf16)"),
    (['train.overrides=["heads.draft_vocab_size=0"]'], "heads.draft_vocab_size=0: must be >= 1"),
    (['train.overrides=["heads.num_head=3"]'], "heads.num_head"),  # a typo in a training key: Hydra names it
    (["train.experiment=fast"], "train.experiment='fast': must name a preset in configs/experiment/ (demo, eagle3, served)"),
    (["+tree.depth=3"], "tree.depth: unknown key"),
])
def test_an_impossible_demo_setting_stops_before_anything_runs_and_names_the_key(overrides, named):
    with pytest.raises(ConfigError) as stopped:
        demo_config(*overrides)
    assert named in str(stopped.value)


@pytest.mark.integration
def test_the_command_line_reports_every_problem_and_runs_nothing(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "medusa_train", "demo", "recipe=medusa3", "train.dtype=float16",
                           f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert "recipe='medusa3'" in done.stderr and "train.dtype='float16'" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no stage ran, and Hydra wrote nothing of its own


STAGES = ("data", "run", "tree", "report")


def changed(before: dict, after: dict) -> set[str]:
    return {stage for stage in STAGES if before[stage] != after[stage]}


@pytest.mark.parametrize("override, redone", [
    ("distill.max_new_tokens=64", {"data", "run", "tree", "report"}),  # new data: everything after it again
    ("distill.engine=null", {"data", "run", "tree", "report"}),  # another engine's numerics: other replies
    ("distill.max_minutes=30", {"data", "run", "tree", "report"}),  # data sized to another time: other data
    ("model=/models/other", {"data", "run", "tree", "report"}),
    ('train.overrides=["trainer.epochs=3"]', {"run", "tree", "report"}),  # the same data, new heads
    ("train.dtype=float32", {"run", "tree", "report"}),
    ('train.overrides=["heads.draft_vocab_size=null"]', {"run", "tree", "report"}),
    ("train.experiment=served", {"run", "tree", "report"}),
    ("recipe=medusa2", {"run", "tree", "report"}),
    (("recipe=eagle3", "train.experiment=eagle3"), {"run", "tree", "report"}),  # the same data, a draft
    ("tree.nodes=64", {"tree", "report"}),  # the same heads, another tree
    ("eval.dtype=float32", {"tree", "report"}),  # an auto tree is sized in the evaluation's dtype...
    ("eval.max_new_tokens=256", {"tree", "report"}),  # ... at its answers' mean context
    ("tree.guard_max_minutes=null", {"tree", "report"}),  # the guard sized to another time: maybe another tree
    ("eval.limit=8", {"report"}),
    ("eval.max_minutes=30", {"report"}),  # the evaluation sized to another time: other prompts
    ("max_minutes=30", set()),  # the whole demo's time: a run's evaluation is cut by the hour, its folder the same
])
def test_a_setting_redoes_its_stage_and_the_stages_after_it_only(override, redone):
    overrides = (override,) if isinstance(override, str) else override
    base = {stage: path for stage, path in demo.stage_paths(demo_config("train.dtype=bfloat16",
                                                                          "eval.dtype=bfloat16")).items()}
    other = {stage: path for stage, path in demo.stage_paths(demo_config("train.dtype=bfloat16", "eval.dtype=bfloat16",
                                                                           *overrides)).items()}
    assert changed(base, other) == redone
    assert base["run"].name.startswith("medusa1-") and other["run"].name.startswith(demo_config(*overrides).recipe)


def test_auto_dtype_is_bfloat16_only_where_it_runs_natively_and_keys_folders_as_the_dtype_it_becomes():
    from medusa_train.backbone.load import native_bf16
    from medusa_train.config.demo import resolve_dtypes

    assert native_bf16("cpu", "flags : fpu avx2 avx512f avx512_bf16 amx_tile")
    assert native_bf16("cpu", "flags : fpu sse avx2 amx_bf16")
    assert not native_bf16("cpu", "flags : fpu sse sse2 avx avx2 fma")  # AVX2 only: bf16 is emulated
    raw = compose_config("demo")
    for native, dtype in ((True, "bfloat16"), (False, "float32")):
        cfg = resolve_dtypes(parse_config(DemoConfig, raw, lambda c: []), bf16=native)
        assert (cfg.distill.dtype, cfg.train.dtype, cfg.eval.dtype) == (dtype, dtype, dtype)
        explicit = demo_config(f"distill.dtype={dtype}", f"train.dtype={dtype}", f"eval.dtype={dtype}")
        assert demo.stage_paths(cfg) == demo.stage_paths(explicit)
    assert demo_config("train.dtype=float32").train.dtype == "float32"  # an explicit dtype stays


def test_the_demo_trains_its_preset_as_the_train_command_composes_it():
    """No training setting of the demo's own: every key of configs/experiment/demo.yaml reaches the training config
    unchanged (so the README's `medusa-train train +recipe=medusa1 experiment=demo` trains what the demo measures),
    and an override on the demo's command line reaches it too."""
    import yaml

    from medusa_train.config.paths import CONFIG_DIR

    preset = yaml.safe_load((CONFIG_DIR / "experiment" / "demo.yaml").read_text())
    preset.pop("defaults", None)
    settings = demo.training_settings(demo_config("train.dtype=bfloat16"))
    for section, keys in preset.items():
        for key, value in keys.items():
            assert settings[section][key] == value, f"{section}.{key}"
    assert settings["model"]["dtype"] == "bfloat16" and settings["trainer"]["mixed_precision"] == "bfloat16"
    changed = demo.training_settings(demo_config("train.dtype=float32", 'train.overrides=["loss.targets=text"]'))
    assert changed["loss"]["targets"] == "text" and changed["model"]["dtype"] == "float32"
    assert changed["trainer"]["mixed_precision"] == "no"
    served = demo.training_settings(demo_config("train.dtype=bfloat16", "train.experiment=served"))
    assert not served["heads"]["path_input"] and served["heads"]["draft_vocab_size"] is None


def test_when_the_engine_fails_the_demo_distils_in_process_and_says_why(tmp_path, monkeypatch, capfd):
    """A vLLM that cannot start (its Python exits at once): the distill stage runs again in-process, into the data
    folder an in-process run is keyed by, and says why; the engine's partial file is left where it is."""
    model_dir = make_model_dir(tmp_path / "model")
    cfg = demo_config(f"model={model_dir}", f"output_dir={tmp_path / 'out'}", "distill.num_prompts=3",
                      "distill.max_new_tokens=4", "distill.dtype=float32")
    engine_path = demo.stage_paths(cfg)["data"]
    monkeypatch.setitem(demo.ENV, "MEDUSA_TRAIN_VLLM_PYTHON", "/bin/false")
    monkeypatch.setenv("MEDUSA_TRAIN_VLLM_PYTHON", "/bin/false")
    seconds = demo.distill_stage(cfg, [sys.executable, "-m", "medusa_train"], tmp_path / "out")
    out = capfd.readouterr().out
    assert "distilling in-process instead of through vLLM: distilling through vLLM failed" in out
    assert seconds > 0 and cfg.distill.engine is None
    data = demo.stage_paths(cfg)["data"]
    assert data != engine_path and data.parent == tmp_path / "out"
    assert "in-process" in demo.data_summary(data) and len(read_jsonl(data)) >= 1


def test_the_demo_stages_are_declared_with_what_they_read_and_write(tmp_path):
    """Each declared stage runs a registered command, reads what an earlier stage writes, and writes where
    ``stage_paths`` says, for every recipe."""
    from medusa_train.backbone.load import native_bf16
    from medusa_train.config.commands import COMMANDS
    from medusa_train.config.demo import resolve_dtypes
    from medusa_train.config.methods import METHODS

    written = set()
    for s in demo.STAGES:
        assert s.command in COMMANDS, s
        assert set(s.reads) <= written, (s, written)
        written.add(s.writes)
    for recipe, method in METHODS.items():
        preset = [f"train.experiment={method.experiment}"] if method.experiment else []
        cfg = resolve_dtypes(demo_config(f"recipe={recipe}", f"output_dir={tmp_path}", *preset), native_bf16())
        assert written <= set(demo.stage_paths(cfg)), recipe


def test_the_evaluation_drops_the_branches_alone_where_they_would_crowd_out_the_questions():
    """``eval.branches`` null: the branches alone are decoded when ``eval.limit`` questions fit the evaluation's time
    with them by the guard's measured rates (the AMX CPU's demo), not where they do not (the one-core stand-in's: 9 of
    24 questions with them), and the log says why; set, it is what it says; a tree without a guard or a chain: on."""
    from medusa_train.config.demo import branches_fit

    def tree(generate_ms, hybrid, draft, lookup, lookup_nodes=6):
        return {"chosen_lookup_nodes": lookup_nodes, "cost_curve": {"generate_ms": generate_ms},
                "guard": {"measured": {"hybrid": {"tokens_per_s": hybrid}, "draft alone": {"tokens_per_s": draft},
                                       "lookup chain alone": {"tokens_per_s": lookup}}}}

    cfg = demo_config()
    stand_in, amx = tree(53.9, 27.1, 20.7, 22.0), tree(22.7, 80.6, 64.2, 60.4)
    off, why = branches_fit(cfg, stand_in, 5.38)
    assert off is False and "of 24 in 5.4 min" in why and "eval.branches=true" in why
    assert branches_fit(cfg, amx, 6.0) == (True, None)
    assert branches_fit(demo_config("eval.branches=true"), stand_in, 5.38) == (True, None)
    assert branches_fit(demo_config("eval.branches=false"), amx, 6.0) == (False, None)
    assert branches_fit(cfg, stand_in, None) == (True, None)  # no time limit
    assert branches_fit(cfg, tree(53.9, 27.1, 20.7, 22.0, lookup_nodes=0), 5.38) == (True, None)
    assert branches_fit(cfg, {"chosen_lookup_nodes": 6}, 5.38) == (True, None)  # no guard measured


def test_the_evaluation_gets_what_the_demos_time_leaves():
    """``max_minutes`` bounds the whole demo: the evaluation is given its own budget or what the stages before it
    left less the reserve, whichever is less, and never less than the floor."""
    from medusa_train.config.demo import EVAL_FLOOR_MINUTES, EVAL_RESERVE_MINUTES, evaluation_minutes

    cfg = demo_config("max_minutes=35", "eval.max_minutes=6")
    assert evaluation_minutes(cfg, 20 * 60) == 6  # early: its own budget
    assert evaluation_minutes(cfg, 29 * 60) == pytest.approx(35 - 29 - EVAL_RESERVE_MINUTES)  # the stand-in's hour
    assert evaluation_minutes(cfg, 40 * 60) == EVAL_FLOOR_MINUTES  # late: still a question or two
    assert evaluation_minutes(demo_config("max_minutes=null", "eval.max_minutes=6"), 40 * 60) == 6
    assert evaluation_minutes(demo_config("max_minutes=35", "eval.max_minutes=null"), 29 * 60) == pytest.approx(
        35 - 29 - EVAL_RESERVE_MINUTES)
    assert evaluation_minutes(demo_config("max_minutes=null", "eval.max_minutes=null"), 0) is None
