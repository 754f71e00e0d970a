"""Convert Medusa heads to another checkpoint layout.

    python scripts/export.py draft=<heads dir> format=native|medusa_v1|vllm output=<dir>
    python scripts/export.py draft=out/run/export format=medusa_v1 output=out/medusa lm_head_pt=true
    python scripts/export.py --help

The heads may be in any layout ``MedusaModel.from_pretrained`` reads. Keys: configs/commands/export.yaml;
the work is ``medusa_train.export.write.export_folder``.
"""

from medusa_train.cli.export import main

if __name__ == "__main__":
    main()
