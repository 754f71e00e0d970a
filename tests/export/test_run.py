"""A run's export carries the chat template the run trained with, and loading the heads renders with it."""

from __future__ import annotations

import pytest
from helpers.tokenizers import CHATML_TEMPLATE
from helpers.training import compose_config, make_chat_jsonl, make_model_dir, train_overrides

from medusa_train.backbone.generation import encode_chat
from medusa_train.cli.train import run
from medusa_train.config.model import EvalModelConfig
from medusa_train.export.write import export_folder
from medusa_train.model.load import load_exported_draft, read_chat_template

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

MARKER = "ZEBRA-7"
TEMPLATE = CHATML_TEMPLATE.replace("You are a helpful AI assistant", f"You are {MARKER}")


def test_a_trained_export_carries_its_custom_template_and_load_heads_renders_with_it(tmp_path):
    model_dir, data = make_model_dir(tmp_path / "model"), make_chat_jsonl(tmp_path / "chat.jsonl", n=16)
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    cfg = compose_config(train_overrides(model_dir, data, tmp_path / "run", **{
        "trainer.max_steps": 2, "trainer.eval_every": 0, "heads.num_heads": 2,
        "data.chat_template": tmp_path / "template.jinja"}))
    run(cfg)
    export = tmp_path / "run/export"
    assert (export / "chat_template.jinja").read_text() == TEMPLATE
    assert read_chat_template(export) == TEMPLATE

    messages = [{"role": "user", "content": "Count from one."}]
    _, tokenizer = load_exported_draft(export, EvalModelConfig(), device="cpu")
    assert MARKER in tokenizer.decode(encode_chat(tokenizer, messages)[0])
    _, own = load_exported_draft(export, EvalModelConfig(), device="cpu", export_template=False)
    assert MARKER not in own.decode(encode_chat(own, messages)[0])  # the tokenizer's template, when asked

    _, other = load_exported_draft(export, EvalModelConfig(chat_template=CHATML_TEMPLATE), device="cpu")
    assert MARKER not in other.decode(encode_chat(other, messages)[0])  # model.chat_template= over the heads' own

    # the evaluate command renders its prompts with the run's template: the input ids it decoded are those
    from medusa_train.cli.evaluate import build_eval_config
    from medusa_train.cli.evaluate import run as evaluate

    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"question_id": 1, "category": "math", "turns": ["Count from one."]}\n')
    report = evaluate(build_eval_config({"heads": str(export), "tree": "chain", "bench": {"source": str(bench)},
                                         "generation": {"max_new_tokens": 4}, "output_dir": str(tmp_path / "eval"),
                                         "baselines": {"prompt_lookup": False}, "device": "cpu", "warmup": False,
                                         "progress": False}))
    assert report["per_prompt"][0]["prompt_tokens"] == encode_chat(tokenizer, messages).shape[1] \
        != encode_chat(own, messages).shape[1]

    export_folder(export, tmp_path / "vllm", "vllm")  # a conversion keeps it
    _, tokenizer = load_exported_draft(tmp_path / "vllm", EvalModelConfig(), device="cpu")
    assert MARKER in tokenizer.decode(encode_chat(tokenizer, messages)[0])

    (export / "precious.txt").write_text("mine")  # a second run into it must not delete the user's file
    with pytest.raises(ValueError, match=r"holds files medusa-train did not write \(precious.txt\).*"
                                         "choose another trainer.output_dir="):
        run(cfg)
    assert (export / "precious.txt").read_text() == "mine" and (export / "chat_template.jinja").is_file()


def test_a_run_whose_export_folder_holds_a_file_of_yours_is_refused_before_training(tmp_path, monkeypatch, capfd):
    """The export at the end of a run would be refused; the train command says so before anything loads, with
    exit 2, naming trainer.output_dir, and the file is still there."""
    from helpers.training import run_train_command

    model_dir, data = make_model_dir(tmp_path / "model"), make_chat_jsonl(tmp_path / "chat.jsonl", n=16)
    precious = tmp_path / "run" / "export" / "precious.txt"
    precious.parent.mkdir(parents=True)
    precious.write_text("mine")
    assert run_train_command(train_overrides(model_dir, data, tmp_path / "run"), monkeypatch) == 2
    err = capfd.readouterr().err
    assert "holds files medusa-train did not write (precious.txt)" in err and "trainer.output_dir=" in err
    assert "Traceback" not in err and precious.read_text() == "mine"
    assert not (tmp_path / "run" / "checkpoints").exists()
