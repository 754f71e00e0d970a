"""Train Medusa heads: ``accelerate launch train.py +recipe=medusa1`` (see configs/train.yaml)."""

from medusa_train.cli.train import main

if __name__ == "__main__":
    main()
