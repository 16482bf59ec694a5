"""A small GPT-style byte-level language model and the data module that feeds it.

Read top to bottom: the transformer (attention, MLP, block), the LightningModule that trains it
(``GPT``), and ``TextDataModule``, which turns any text file or directory into training windows.
By default it trains on the Python standard library's own source, which every Python install
has, so nothing is downloaded.

Nothing here knows about 1-bit compression: ``configure_optimizers`` returns a plain
``torch.optim.AdamW``. Pick the communication with the Trainer's strategy (``train.py``,
``configs/*.yaml``): ``strategy="ddp"`` all-reduces fp32 gradients, ``strategy="onebit_adam"``
(after ``import lightning_onebit``) swaps AdamW for 1-bit Adam and sends ~32x fewer bytes once
its warmup is over.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

import lightning.pytorch as L
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader, Dataset

# --------------------------------------------------------------------------- the transformer


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = n_head
        # No bias: a key bias gets an exactly-zero gradient (softmax ignores a shift shared by all
        # keys), so its Adam variance stays ~0, and once 1-bit Adam freezes the variance any
        # nonzero 1-bit momentum would take steps of size lr * scale / eps there.
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time (sequence), channels (n_embd)
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


# --------------------------------------------------------------------------- the LightningModule


class GPT(L.LightningModule):
    """A GPT-style language model over bytes (nanoGPT's architecture, scaled down).

    Args:
        vocab_size: number of token ids; ``train.py`` links it to ``TextDataModule.vocab_size``.
        block_size: context length in tokens; ``train.py`` links it to the data module's.
        n_layer: transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: width of the residual stream.
        dropout: dropout probability (0 for short runs).
        lr: peak learning rate, reached after ``warmup_steps`` and decayed along a cosine to
            ``min_lr_ratio * lr`` at the last step. Adam(W) and 1-bit Adam: ~1e-3 to 3e-3 for
            this model; LAMB scales each layer's step by ``||p|| / ||update||``, so it usually
            wants a larger one (~1e-2).
        betas: Adam's coefficients. 1-bit Adam freezes the variance after its warmup and, like
            DeepSpeed, does no bias correction: keep ``1 / (1 - beta2)`` well below the number of
            warmup (uncompressed) steps so that the frozen variance has warmed up; 0.95 suits
            runs of a few hundred steps, 0.999 needs thousands of warmup steps.
        weight_decay: decoupled weight decay (AdamW's; the 1-bit optimizers use the same form).
            Above 0, as in nanoGPT, only the matrices decay: biases and LayerNorms go in a
            second param group without decay (the 1-bit optimizers exchange each group with
            its own scale).
        warmup_steps: linear learning-rate warmup. Not the same thing as the 1-bit optimizers'
            ``freeze_step`` (the uncompressed phase), which should be longer.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        optimizer: ``"adamw"`` (the default; the 1-bit strategies replace it by their own
            optimizer) or ``"lamb"``: plain, uncompressed LAMB, the baseline that 1-bit LAMB is
            compared with (see ``configure_optimizers``).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 3,
        n_head: int = 4,
        n_embd: int = 96,
        dropout: float = 0.0,
        lr: float = 2e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        optimizer: Literal["adamw", "lamb"] = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying (as GPT-2). It also matters for 1-bit compression: every row of the tied
        # matrix gets a gradient through the softmax at every step, so no row of Adam's frozen
        # variance is left at zero (a zero variance turns the +-scale of a 1-bit momentum into a
        # huge update on a coordinate that never learned anything).
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # validation loss per token, averaged over all batches of all ranks (torchmetrics syncs)
        self.val_loss = torchmetrics.MeanMetric()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]  # idx: (B, T) token ids
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.head(self.ln_f(x))  # (B, T, vocab_size)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T): y is x shifted left by one token
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over B*T tokens

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), weight=batch[0].numel())
        self.log("val_loss", self.val_loss, prog_bar=True)  # computed and synced at epoch end

    def on_validation_epoch_end(self) -> None:
        # compute() is already averaged over all ranks (sync_dist only averages equal values
        # again, and keeps Lightning from warning that an epoch-level value is unsynced)
        self.log("val_ppl", self.val_loss.compute().exp(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "lamb":
            # Plain LAMB for the comparison with 1-bit LAMB: OneBitLamb whose freeze_step lies
            # beyond the last step never leaves its warmup, which is exactly uncompressed LAMB.
            # DDP has already averaged the gradients, so it must not average them again.
            from lightning_onebit.optim import OneBitLamb

            return OneBitLamb(
                self._param_groups(),
                lr=hp.lr,
                betas=hp.betas,
                weight_decay=hp.weight_decay,
                freeze_step=2**62,
                average_warmup_grads=False,
            )
        # The 1-bit strategies replace this AdamW with their optimizer, carrying over lr, betas,
        # eps and weight_decay: the model code is the same for strategy="ddp" and "onebit_adam".
        return torch.optim.AdamW(
            self._param_groups(), lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay
        )

    def _param_groups(self) -> list[dict]:
        """One group, or (weight decay on) matrices decayed, biases and LayerNorms not."""
        wd = self.hparams.weight_decay
        if wd == 0:
            return [{"params": list(self.parameters()), "weight_decay": 0.0}]
        params = list(self.parameters())
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
        hp = self.hparams
        if step < hp.warmup_steps:
            return hp.lr * (step + 1) / hp.warmup_steps
        total = max(self.trainer.max_steps, hp.warmup_steps + 1)
        progress = min(1.0, (step - hp.warmup_steps) / (total - hp.warmup_steps))
        return hp.lr * (
            hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        )

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Set the learning rate by hand (as nanoGPT does) rather than with an LR scheduler: it
        # applies to whatever optimizer the strategy installed in place of our AdamW.
        lr = self.lr_at(self.global_step)
        for optimizer in self.trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.log("lr", lr)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8):
        """Continue each row of ``idx`` (B, T) by sampling ``max_new_tokens`` tokens."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.hparams.block_size :]  # (B, <=block_size)
            logits = self(context)[:, -1, :] / temperature  # (B, V)
            next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat([idx, next_id], dim=1)  # (B, T+1)
        return idx


# --------------------------------------------------------------------------- the data


class _Windows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens: input and next-token target."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class TextDataModule(L.LightningDataModule):
    """Byte-level language-modelling data from any text file or directory.

    The files are read in sorted order and concatenated; the last ``val_fraction`` of the bytes
    is held out for validation. The vocabulary is the set of byte values that occur at least
    ``min_count`` times in the corpus; rarer bytes (e.g. most of multi-byte UTF-8) share one
    "unknown" id 0. Keeping only bytes the corpus actually uses matters for 1-bit optimizers:
    an embedding row that never receives a gradient keeps a zero variance.

    Args:
        path: a text file, or a directory of them. Default: the Python standard library's own
            source (``*.py`` next to ``os.py``, about 4.7 MB), present in every Python install.
        pattern: glob for the files of a directory, e.g. ``"**/*.md"`` to recurse.
        block_size: tokens per training window (the model's context length).
        batch_size: windows per batch *per process*; the global batch is
            ``batch_size * devices * num_nodes``.
        val_fraction: fraction of the corpus (its end) held out for validation.
        min_count: bytes rarer than this map to the unknown id.
        max_bytes: read at most this many bytes of the corpus (``None``: all).
        num_workers: DataLoader worker processes (0: load in the training process).
    """

    def __init__(
        self,
        path: str | None = None,
        pattern: str = "*.py",
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        min_count: int = 100,
        max_bytes: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Read the corpus here rather than in setup(): the model needs vocab_size when the CLI
        # builds it. Every process reads it; a few MB take well under a second.
        data = b"".join(p.read_bytes() for p in self.files())[:max_bytes]
        if len(data) < 2 * (block_size + 1):
            raise ValueError(
                f"{path!r} holds {len(data)} bytes; need at least {2 * (block_size + 1)}"
            )
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # (N,)
        counts = torch.bincount(raw, minlength=256)  # (256,)
        kept = (counts >= min_count).nonzero().flatten()  # byte values in the vocabulary
        self.itos = [-1, *kept.tolist()]  # id -> byte value (-1: unknown)
        lookup = torch.zeros(256, dtype=torch.uint8)  # byte value -> id, 0 = unknown
        lookup[kept] = torch.arange(1, len(kept) + 1, dtype=torch.uint8)
        tokens = lookup[raw]  # (N,) uint8 ids
        n_val = max(block_size + 1, int(len(tokens) * val_fraction))
        self.train_tokens, self.val_tokens = tokens[:-n_val], tokens[-n_val:]

    def files(self) -> list[Path]:
        """The files of the corpus, in the (deterministic) order they are read."""
        path = Path(self.hparams.path) if self.hparams.path else Path(os.__file__).parent
        if path.is_file():
            return [path]
        files = sorted(p for p in path.glob(self.hparams.pattern) if p.is_file())
        if not files:
            raise FileNotFoundError(f"no files match {self.hparams.pattern!r} in {path}")
        return files

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> torch.Tensor:
        stoi = {b: i for i, b in enumerate(self.itos) if b >= 0}
        return torch.tensor([stoi.get(b, 0) for b in text.encode()], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        out = bytes(self.itos[i] if self.itos[i] >= 0 else ord("?") for i in ids.tolist())
        return out.decode(errors="replace")

    def train_dataloader(self) -> DataLoader:
        # Lightning adds a DistributedSampler: each process sees its own shuffled share.
        return self._loader(self.train_tokens, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_tokens, shuffle=False)

    def _loader(self, tokens: torch.Tensor, shuffle: bool) -> DataLoader:
        hp = self.hparams
        return DataLoader(
            _Windows(tokens, hp.block_size),
            batch_size=hp.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=hp.num_workers,
            persistent_workers=hp.num_workers > 0,
        )
