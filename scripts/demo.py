"""The whole pipeline on the packaged model (``make demo``): ``medusa-train demo``; see medusa_train/pipeline/demo.py."""

from medusa_train.cli.demo import main

if __name__ == "__main__":
    main()
