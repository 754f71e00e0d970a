"""``python -m medusa_train <command> ...``: the ``medusa-train`` command (``medusa_train/cli/main.py``)."""

from medusa_train.cli.main import main

main()
