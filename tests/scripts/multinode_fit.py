"""One launch of a multi-node fit (``tests/integration/test_multinode.py``), every algorithm in turn::

    NODE_RANK=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/scripts/multinode_fit.py OUT NODES DEVICES STAGE
    python -m torch.distributed.run --nnodes 2 --node-rank n ... tests/scripts/multinode_fit.py OUT 2 1 STAGE

(``DEVICES`` ranks per node: with 2, the strategy's default ``hierarchical="auto"`` runs the
two-level exchange.)

``STAGE`` ``first``: fit 8 steps (warmup 4, so 4 compressed) and save a checkpoint (every rank
writes its 1-bit state beside it); ``resume``: continue that checkpoint to 16 steps. Each rank
saves ``OUT/STAGE-ALGO-rank{R}.pt``: its parameters, the last loss, the ranks Lightning gave it
(global, local, node) and the world size, the phase, the rank files it found after saving, the
kind of exchange and the byte counters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_onebit

ALGORITHMS = ("onebit_adam", "zero_one_adam", "onebit_lamb")


class Attention(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 32)
        self.block = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.head = torch.nn.Linear(32, 32)
        self.last_loss = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        logits = self.head(self.block(self.embed(x[:, :-1])))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        self.last_loss = float(loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95))

    def on_train_end(self) -> None:
        # (the kind of exchange, before teardown closes the optimizer and lets go of it)
        ex = self.trainer.strategy.onebit_optimizer.flat.exchange
        self.exchange = type(getattr(ex, "buckets", [ex])[0]).__name__


def main(out: Path, nodes: int, devices: int, stage: str) -> None:
    data = torch.randint(0, 32, (1024, 9), generator=torch.Generator().manual_seed(0))
    for algorithm in ALGORITHMS:
        trainer = L.Trainer(
            strategy=lightning_onebit.OneBitStrategy(algorithm=algorithm, freeze_step=4),
            accelerator="cpu",
            devices=devices,
            num_nodes=nodes,
            max_steps=8 if stage == "first" else 16,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        ckpt = out / f"{algorithm}.ckpt"
        model = Attention()
        loader = DataLoader(TensorDataset(data), batch_size=16, shuffle=False)
        trainer.fit(model, loader, ckpt_path=ckpt if stage == "resume" else None)
        if stage == "first":
            trainer.save_checkpoint(ckpt)
        trainer.strategy.barrier()
        opt = trainer.strategy.onebit_optimizer
        record = {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "loss": model.last_loss,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "phase": str(opt.phase),
            "rank_files": sorted(p.name for p in out.glob(f"{algorithm}.ckpt.onebit-rank*")),
            "exchange": model.exchange,
            "comm_stats": dict(opt.comm_stats),
            "metrics": sorted(k for k in trainer.callback_metrics if k.startswith("onebit/")),
        }
        torch.save(record, out / f"{stage}-{algorithm}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
