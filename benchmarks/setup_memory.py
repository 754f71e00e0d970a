"""Peak host memory of each process once a Medusa-1 run is set up (backbone loaded, sharded or not, heads built,
data ready), without training: what a launch needs per process before its first step.

    accelerate launch --cpu --num_processes 2 -m benchmarks.setup_memory +recipe=medusa1 model.fsdp=true ...

Takes the training keys (configs/train.yaml); prints one line per process. Run from the repository root.
"""

import os
import resource
import sys

from medusa_train.cli.launch import relaunch_cpu_processes_if_asked
from medusa_train.config.compose import compose_config
from medusa_train.config.train import build_config
from medusa_train.families.medusa.recipe_medusa1 import Medusa1Recipe
from medusa_train.training import loop


def main() -> None:
    relaunch_cpu_processes_if_asked()
    cfg = build_config(compose_config("train", sys.argv[1:]))
    recipe = Medusa1Recipe(cfg)
    recipe.setup()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"process {os.environ.get('RANK', '0')}: peak host memory after setup {peak:,.0f} MiB", flush=True)
    loop.finish(recipe.run)


if __name__ == "__main__":
    main()
