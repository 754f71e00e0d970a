"""The shipped accelerate config files load with accelerate's own reader, as ``accelerate launch --config_file`` does."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"


@pytest.mark.parametrize("name, kind", [("ddp", DistributedType.MULTI_GPU), ("fsdp", DistributedType.FSDP)])
def test_accelerate_config_files_load_as_the_engine_they_name(name, kind):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert config.distributed_type == kind
    assert config.num_machines == 1 and not config.use_cpu
    assert config.mixed_precision == "no"  # the recipe passes trainer.mixed_precision itself
