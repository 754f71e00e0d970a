"""Fixtures for the tests against the real engine: heads trained for about a minute on the packaged model
and data, and the packaged model's folder (what vLLM loads; ``packaged:`` names mean nothing to it)."""

from __future__ import annotations

import pytest
from helpers.backbones import PACKAGED_MODEL
from helpers.training import compose_config

NUM_HEADS = 3


@pytest.fixture(scope="session")
def model_folder() -> str:
    from medusa_train.backbone.load import resolve_model_path

    return resolve_model_path(PACKAGED_MODEL)[0]


@pytest.fixture(scope="session")
def trained_heads(tmp_path_factory) -> str:
    """Plain heads as the demo trains them (shared LM head, a 4,096-token draft vocabulary, teacher targets),
    half a minute of training on ShareGPT with the frozen float32 backbone: the native export's folder."""
    from medusa_train.cli.train import run

    out = tmp_path_factory.mktemp("engine-heads")
    cfg = compose_config([
        f"model.name_or_path={PACKAGED_MODEL}", "model.dtype=float32", "trainer.mixed_precision=no",
        f"heads.num_heads={NUM_HEADS}", "heads.share_lm_head=true", "heads.draft_vocab_size=4096",
        "loss.targets=teacher", "data.max_samples=160", "data.max_length=128", "data.eval_size=8",
        "data.batch_size=8", "trainer.max_steps=14", "trainer.eval_every=14", "trainer.save_every=14",
        "optim.lr=3e-3", f"trainer.output_dir={out}"])
    run(cfg)
    return str(out / "export")


@pytest.fixture(scope="session")
def free_servers(model_folder, tmp_path_factory):
    """The packaged model served in float32 without speculation and with vLLM's n-gram speculation, as a user
    runs them already: the served evaluations of every engine test attach to them (``served.plain_url``,
    ``served.ngram_url``), so they start once a session. ``log_dir`` holds their logs (``plain.log``, ``ngram.log``)."""
    import contextlib

    from medusa_train.config.engine import ServedConfig
    from medusa_train.engine import VllmServer
    from medusa_train.evaluation.served import speculative_configs

    logs = tmp_path_factory.mktemp("free-servers")
    ngram = speculative_configs(None, 0, ServedConfig())["ngram"]
    servers = {name: VllmServer(model_folder, dtype="float32", speculative_config=spec, log_path=logs / f"{name}.log")
               for name, spec in (("plain", None), ("ngram", ngram))}
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.callback(server.stop)
        for server in servers.values():  # both start at once: a start is mostly one core's work
            server.launch()
        for server in servers.values():
            server.wait_ready()
        yield {**{name: server.url for name, server in servers.items()}, "log_dir": logs}
