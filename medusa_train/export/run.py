"""What a finished training run leaves in ``<trainer.output_dir>/export``: the recipe trains, this writes.

- Medusa-1: the heads (native layout) and ``training_config.json``; EAGLE-3: the draft (vLLM's layout, ``families/eagle3/config.py``)
  and ``training_config.json``.
- Every draft: ``validation.json``, the last validation walk's tokens per step (``training/validation_walk.py``).
- Both: ``chat_template.jinja``, the template the run rendered its data with (``data.chat_template`` when set,
  else the tokenizer's), which ``model.load.load_exported_draft`` sets on the tokenizer again.
- Medusa-2: the heads, the LoRA adapter (``adapter/``, peft), ``backbone.json`` (how to rebuild the backbone:
  base model, quantization, adapter, merged folder), and with ``trainer.merge_export=true`` a standalone
  backbone (``merged/``: the LoRA merged into the original weights, or with ``trainer.merge_into=dequantized``
  into the 4-bit weights dequantized, plus the tokenizer; ``backbone/merge.py``) that needs neither peft nor
  bitsandbytes, which the heads' config then names. ``model/load.py``'s ``load_adapted_export`` loads either form.

A recipe hands what it trained (``TrainedRun``: the config, the draft, the chat template, and for a backbone trained
too, what rebuilds it); nothing else of the recipe is read. Every process calls ``save_run_export`` (a sharded adapter
is gathered from all of them); the main process writes, atomically (``model.folder.replace_folder``: an ``export`` folder holding files of someone else's is refused).
"""

from __future__ import annotations

import json
from pathlib import Path

from medusa_train.backbone.merge import ADAPTER_DIR, BACKBONE_INFO, MERGED_DIR, merge_backbone
from medusa_train.model.folder import VALIDATION_FILE, replace_folder, write_heads_files
from medusa_train.training import loop
from medusa_train.training.run_folder import OPTION, RunFolder, TrainedRun


def save_run_export(run: TrainedRun) -> Path | None:
    """Write ``run``'s trained draft to ``<output_dir>/export``; ``None`` with ``trainer.export=false``. A collective:
    every process calls it."""
    cfg = run.cfg
    if not cfg.trainer.export:
        return None
    target = RunFolder.of(cfg).export
    adapter = run.adapted.whole_adapter() if run.adapted and run.adapted.joint else None
    if run.accelerator.is_main_process:
        if run.adapted:
            write_adapted_export(run, target, adapter)
        else:
            def fill(tmp: Path) -> None:
                write_heads_files(tmp, *run.model.native_files(), chat_template=run.chat_template)
                loop.write_training_config(cfg, tmp)
                write_validation(tmp, run.validation)

            replace_folder(target, fill, OPTION)
            loop.say(run.accelerator, f"exported {run.model.config.draft_name} to {target} (its backbone, as recorded: "
                                      f"{run.model.config.base_model_name_or_path})")
    run.accelerator.wait_for_everyone()
    return target


def write_validation(folder: Path, figures: dict | None) -> None:
    """``validation.json``: the last validation walk's figures (what the training log promised for this export)."""
    if figures:
        (folder / VALIDATION_FILE).write_text(json.dumps(figures, indent=2) + "\n")


def write_adapted_export(run: TrainedRun, target: Path, adapter: dict | None) -> None:
    """Heads, adapter (``adapter``: its weights gathered whole, or None for peft to read them from the model),
    ``backbone.json`` and, with ``trainer.merge_export``, ``merged/``: into a temporary folder, then renamed."""
    replace_folder(target, lambda tmp: _fill_adapted_export(run, tmp, adapter), OPTION)
    loop.say(run.accelerator, f"exported heads{', adapter' if run.adapted.joint else ''}"
                              f"{', merged backbone' if run.cfg.trainer.merge_export else ''} to {target}")


def _fill_adapted_export(run: TrainedRun, tmp: Path, adapter: dict | None) -> None:
    cfg, m, model, joint = run.cfg, run.cfg.model, run.model, run.adapted.joint
    merge = cfg.trainer.merge_export
    reference = model.config.base_model_name_or_path
    # Heads trained with an adapter must not silently load on the original backbone: they name
    # the merged folder, or nothing (then load_adapted_export reads backbone.json).
    model.config.base_model_name_or_path = MERGED_DIR if merge else (None if joint else reference)
    try:
        files, config = model.native_files()
    finally:
        model.config.base_model_name_or_path = reference
    write_heads_files(tmp, files, config, chat_template=run.chat_template)
    write_validation(tmp, run.validation)
    if joint:
        # embeddings are never adapted; "auto" would look the base model up on the hub
        run.adapted.peft_model.save_pretrained(tmp / ADAPTER_DIR, save_embedding_layers=False, state_dict=adapter)
    if merge:
        merged = merge_backbone(model.backbone, tmp / ADAPTER_DIR if joint else None,
                                m.name_or_path, dtype=m.dtype, into=cfg.trainer.merge_into,
                                trust_remote_code=m.trust_remote_code, attn_implementation=m.attn_implementation)
        merged.save_pretrained(tmp / MERGED_DIR, safe_serialization=True)
        run.adapted.tokenizer.save_pretrained(tmp / MERGED_DIR)
        del merged
    info = {"base_model_name_or_path": str(m.name_or_path), "quantization": m.quantization,
            "dtype": m.dtype, "bnb_compute_dtype": m.bnb_compute_dtype,
            "bnb_double_quant": m.bnb_double_quant, "adapter": ADAPTER_DIR if joint else None,
            "merged": MERGED_DIR if merge else None, "merged_from": cfg.trainer.merge_into if merge else None,
            "stage": cfg.stage}
    (tmp / BACKBONE_INFO).write_text(json.dumps(info, indent=2) + "\n")
    loop.write_training_config(cfg, tmp)
