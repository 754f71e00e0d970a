"""Pipelines of the package's own commands: the demo (``demo.py``), each stage a command the user can run alone."""
