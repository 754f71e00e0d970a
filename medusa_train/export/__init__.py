"""Export: heads written in another layout (native | medusa_v1 | vllm), each loadable by its engine (``write.py``),
and what a finished training run leaves in ``<output_dir>/export`` (``run.py``)."""
