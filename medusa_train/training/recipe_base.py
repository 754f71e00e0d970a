"""What every training recipe ends with, written once: the export's view of the finished run (``trained``) and closing
its folder (``cleanup``). A recipe that adapts the backbone too says how (``adapted_backbone``: Medusa-2)."""

from __future__ import annotations

from medusa_train.training import loop, validation_walk
from medusa_train.training.run_folder import AdaptedBackbone, TrainedRun, run_chat_template


class RecipeBase:
    """Reads the recipe's ``cfg``, ``accelerator``, ``model``, ``tokenizer``, ``validation`` and ``run``, set by its
    ``setup``."""

    def adapted_backbone(self) -> AdaptedBackbone | None:
        """What rebuilds the adapted backbone in the export; None where the backbone stayed frozen."""
        return None

    def trained(self) -> TrainedRun:
        """What the run's export writes (``export/run.py``)."""
        return TrainedRun(self.cfg, self.accelerator, self.model, run_chat_template(self.cfg, self.tokenizer),
                          self.adapted_backbone(), validation_walk.last(self.validation))

    def cleanup(self) -> None:
        loop.finish(self.run)
