"""Train the byte-level GPT of ``gpt.py`` from the command line (LightningCLI).

    python examples/train.py fit --config examples/configs/onebit_adam.yaml
    python examples/train.py fit --config examples/configs/ddp_adam.yaml --trainer.max_steps 50
    python examples/train.py fit --config examples/configs/onebit_adam.yaml --data.path ~/my_corpus
    python examples/train.py fit --help        # every option, from the docstrings

The configs differ only in ``trainer.strategy``: the model and its AdamW are the same for DDP and
for the 1-bit strategies. At the end of ``fit``, rank 0 prints how many bytes each rank sent and
how that compares with what fp32 DDP would have sent (``RunSummary`` below); with
``--summary.json_path run.json`` it also writes the curves to a JSON file (``compare.py`` does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as L
import torch
from gpt import GPT, TextDataModule
from lightning.pytorch.cli import LightningCLI

import lightning_onebit  # noqa: F401  (registers the strategy names "onebit_adam", ...)
from lightning_onebit.comm import fp32_allreduce_bytes


class RunSummary(L.Callback):
    """Records validation loss, wire bytes and step time; rank 0 prints (and saves) them at the end.

    Bytes per rank come from the 1-bit optimizers' own counters (``optimizer.comm_stats``:
    exact bytes handed to the collectives, warmup allreduces included). With another optimizer
    (``strategy="ddp"``) they are what DDP's fp32 ring allreduce of the gradients sends per
    rank and step: ``2 (W - 1) / W * 4`` bytes per parameter.

    Args:
        json_path: where rank 0 writes the run's record (``None``: print only).
    """

    def __init__(self, json_path: str | None = None) -> None:
        self.json_path = json_path
        self.val_curve: list[dict[str, float]] = []  # one entry per validation run
        self.bytes_curve: list[int] = []  # cumulative bytes sent by this rank, after each step
        self.samples = 0  # training sequences seen, all ranks together
        self.train_time = 0.0  # seconds inside training steps (validation excluded)
        self.timed_steps = 0

    @staticmethod
    def _comm_stats(trainer: L.Trainer) -> dict[str, int] | None:
        for opt in trainer.strategy.optimizers:
            for candidate in (opt, getattr(opt, "optimizer", None)):
                stats = getattr(candidate, "comm_stats", None)
                if stats is not None:
                    return stats
        return None

    def _bytes(self, trainer: L.Trainer, steps: int) -> tuple[int, int]:
        """(bytes this rank sent, what fp32 DDP would have sent) after ``steps`` steps."""
        stats = self._comm_stats(trainer)
        fp32 = steps * fp32_allreduce_bytes(self.numel, trainer.world_size)
        if stats is None:
            return fp32, fp32
        return stats["bytes_total"], stats["fp32_equiv_total"]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step > 2:  # the first steps build buffers and warm caches: skip them
            self.train_time += time.perf_counter() - self._t0
            self.timed_steps += 1
        self.samples += len(batch[0]) * trainer.world_size
        self.bytes_curve.append(self._bytes(trainer, trainer.global_step)[0])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self.val_curve.append(
            {
                "step": trainer.global_step,
                "samples": self.samples,
                "val_loss": trainer.callback_metrics["val_loss"].item(),
                "bytes": self._bytes(trainer, trainer.global_step)[0],
            }
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        sent, fp32 = self._bytes(trainer, trainer.global_step)
        strategy = trainer.strategy
        record = {
            "strategy": getattr(strategy, "algorithm", None) or type(strategy).__name__,
            "optimizer": type(strategy.optimizers[0]).__name__,
            "world_size": trainer.world_size,
            "parameters": self.numel,
            "steps": trainer.global_step,
            "samples": self.samples,
            "steps_per_s": self.timed_steps / self.train_time if self.train_time else None,
            "final_val_loss": self.val_curve[-1]["val_loss"] if self.val_curve else None,
            "bytes_per_rank": sent,
            "fp32_ddp_bytes_per_rank": fp32,
            "val_curve": self.val_curve,
            "bytes_curve": self.bytes_curve,
        }
        loss = record["final_val_loss"]
        print(
            f"\n[{record['strategy']}] {record['steps']} steps on {record['world_size']} "
            f"process(es): final val_loss {'n/a' if loss is None else f'{loss:.4f}'}, "
            f"{record['steps_per_s'] or 0:.2f} steps/s, {sent / 1e6:.1f} MB sent per rank; "
            f"fp32 DDP: {fp32 / 1e6:.1f} MB ({fp32 / max(sent, 1):.1f}x)"
        )
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.json_path).write_text(json.dumps(record, indent=1))


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The model's vocabulary and context come from the data: set them in one place.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.block_size", "model.block_size")
        parser.add_lightning_class_args(RunSummary, "summary")


#: a one-line usage for each subcommand: a bad value in a config is an error of a few lines,
#: not one after the ~60 lines that list every option of the Trainer (`fit --help` lists them)
SHORT_USAGE = {
    name: {"usage": "%(prog)s [-c CONFIG] [--help] [options]"}
    for name in ("fit", "validate", "test", "predict")
}


def main() -> None:
    torch.set_float32_matmul_precision("high")  # TF32 on GPUs that have it; no-op on CPU
    CLI(
        GPT,
        TextDataModule,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=SHORT_USAGE,
    )


if __name__ == "__main__":
    main()
