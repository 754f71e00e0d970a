"""Fit a Medusa tree to the heads' measured accuracies and write it as a tree YAML.

    python scripts/build_tree.py draft=outputs/medusa1/export nodes=64 calibration=packaged:sharegpt-v3
    python scripts/evaluate.py draft=outputs/medusa1/export tree=outputs/trees/medusa1-n64.yaml

Each head's top-k accuracy is measured on the backbone's own greedy continuations of calibration
prompts (MT-Bench, the evaluation set, is excluded), then the ``nodes`` most likely paths are kept.
Prints the expected accepted length last. Keys: configs/commands/build_tree.yaml.
"""

from medusa_train.cli.build_tree import main

if __name__ == "__main__":
    main()
