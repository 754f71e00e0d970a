"""Train Medusa heads: ``accelerate launch train.py +recipe=medusa1`` (see configs/train.yaml)."""

from medusa_train.training.medusa1 import main

if __name__ == "__main__":
    main()
