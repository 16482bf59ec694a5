"""How a user of each of Lightning's front ends (the Trainer, Fabric) does what a message asks,
so that a message names the user's own API: a Fabric user never reads
``Trainer(gradient_clip_val=...)``, nor a Trainer user ``fabric.clip_gradients``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FABRIC", "TRAINER", "FrontEnd"]


@dataclass(frozen=True)
class FrontEnd:
    """One front end's way of doing each thing a message may ask for.

    Attributes:
        name: ``"Trainer"`` or ``"Fabric"``.
        clip: how to clip the gradients.
        accumulate: how to accumulate gradients over several batches.
        batch_size: what makes up the global batch size.
        precision: how to pick a precision, with ``{}`` for the value (e.g. ``'16-mixed'``).
        scheduler: where an LR scheduler goes.
        run_length: how to give the run a step limit (a fractional ``freeze_step`` needs it).
        start: what starts the processes.
        setup: after what the strategy's optimizer exists.
    """

    name: str
    clip: str
    accumulate: str
    batch_size: str
    precision: str
    scheduler: str
    run_length: str
    start: str
    setup: str


TRAINER = FrontEnd(
    name="Trainer",
    clip="Trainer(gradient_clip_val=...)",
    accumulate="Trainer(accumulate_grad_batches=...)",
    batch_size="the DataLoader's batch_size x accumulate_grad_batches x world size",
    precision="Trainer(precision={})",
    scheduler="an LR scheduler returned by configure_optimizers",
    run_length="set Trainer(max_steps=...) or max_epochs",
    start="Trainer.fit",
    setup="Trainer setup",
)

FABRIC = FrontEnd(
    name="Fabric",
    clip="fabric.clip_gradients(model, optimizer, max_norm=...)",
    accumulate="fabric.no_backward_sync(model) on all but the last backward of each step",
    batch_size="the DataLoader's batch_size x backward passes per optimizer step x world size",
    precision="Fabric(precision={})",
    scheduler="a torch LR scheduler on the optimizer you pass to fabric.setup",
    run_length="pass the strategy's max_steps=...",
    start="fabric.launch",
    setup="fabric.setup",
)
