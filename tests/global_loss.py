"""A test callback: the loss of each optimizer step over the whole global batch, as one number.

Lightning logs the loss of rank 0's micro-batch; runs on 1 or 2 processes are compared on the
global batch's loss instead: the mean over ranks, summed over the accumulated micro-batches (the
`loss` Lightning hands to on_train_batch_end is already divided by the accumulation).
"""

import json
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class GlobalLoss(Callback):
    def __init__(self, path: str):
        self.path, self.losses, self.pending, self.step = Path(path), {}, 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.pending += float(
            trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean")
        )
        if trainer.global_step > self.step:  # this micro-batch ended an optimizer step
            self.losses[self.step] = self.pending
            self.pending = 0.0

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.losses))
