"""One folder a draft family: its settings (the training config section it reads), its config and model, its layouts
and their converter, its recipes and loss. ``model/family.py`` holds the one table of them and
``config/methods.py`` the table of training methods; nothing outside a family's folder and those tables names one.

Within a folder a module's name says its stage (``tests/test_layout.py``): ``settings`` is config, ``recipe*`` and
``loss`` are training, ``demo`` is pipeline (a method's own stages in ``medusa-train demo``), every other module
is model."""
