"""A zoo of the models ordinary users train, and a runner that fits one on CPU ranks (test helper).

Every model is a plain LightningModule whose ``configure_optimizers`` returns ``torch.optim.Adam``
or ``AdamW`` (nothing in it knows about 1-bit training), deterministic given ``seed``, on real
data that ships with Python or scikit-learn (no downloads):

* text: Python's standard library source, one id per frequent byte (``TEXT_VOCAB`` ids);
* images: ``sklearn.datasets.load_digits`` (8x8, upsampled with ``F.interpolate``);
* tabular regression: ``sklearn.datasets.load_diabetes`` (X and y standardized).

Each model has ``default_steps``, ``batch_size`` (per rank), ``train_set(n)`` (``n`` training
samples, cycling over the training split) and ``eval_loss()``: the loss on a fixed held-out batch,
so the final quality of every strategy is measured on the same data.

:func:`fit_user_model` trains one of them (``MODELS[name]``) under a strategy and returns one
record per rank; :func:`compare` puts a run next to the DDP run of the same model.

Several models carry what trips 1-bit optimizers in practice: coordinates whose gradient is
(numerically) zero, so the variance frozen after warmup is ~0 (a conv bias before BatchNorm, dead
ReLU units, the key bias of attention, embedding rows of bytes rarely or never seen, BERT's unused
token-type and position rows), a learning-rate warmup from 0, beta2 = 0.999, tied weights.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_onebit.comm import fp32_allreduce_bytes
from tests.helpers.fit import fit_ranks

__all__ = [
    "MODELS",
    "TEXT_VOCAB",
    "UserModel",
    "bytes_to_ids",
    "compare",
    "fit_user_model",
    "ranks_in_sync",
    "stdlib_text",
]

TEXT_VOCAB = 96  # 95 most frequent bytes of the training text + one id for all others
_TRAIN_TEXT = 120_000  # bytes [0, 120k) train, [120k, 200k) held out
_TEXT_BYTES = 200_000
_SPLIT_SEED = 1234  # the fixed train / held-out split of the sklearn data sets


# --------------------------------------------------------------------------- data


@functools.cache
def stdlib_text(nbytes: int = _TEXT_BYTES) -> bytes:
    lib = Path(os.__file__).parent
    text = b""
    for path in sorted(lib.glob("*.py")):
        text += path.read_bytes()
        if len(text) > nbytes:
            break
    return text[:nbytes]


def bytes_to_ids(raw: bytes, vocab: int, table_from: bytes) -> torch.Tensor:
    """Byte ids: the ``vocab - 1`` most frequent bytes of ``table_from`` get their own id, the
    rest share id ``vocab - 1``."""
    ref = torch.frombuffer(bytearray(table_from), dtype=torch.uint8).long()
    frequent = torch.bincount(ref, minlength=256).argsort(descending=True, stable=True)[: vocab - 1]
    ids = torch.full((256,), vocab - 1, dtype=torch.long)
    ids[frequent] = torch.arange(vocab - 1)
    return ids[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]


@functools.cache
def _text_ids(vocab: int = TEXT_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out ids) of the standard-library text."""
    text = stdlib_text()
    ids = bytes_to_ids(text, vocab, text[:_TRAIN_TEXT])
    return ids[:_TRAIN_TEXT], ids[_TRAIN_TEXT:]


def _windows(data: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` windows of ``length`` ids at fixed, evenly spread offsets: (n, length)."""
    offsets = torch.linspace(0, len(data) - length, n).long()
    return data[offsets[:, None] + torch.arange(length)]


def _split(x: torch.Tensor, y: torch.Tensor, held: int) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_held, y_held): the last ``held`` rows of a fixed permutation held out."""
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    x, y = x[perm], y[perm]
    return x[:-held], y[:-held], x[-held:], y[-held:]


@functools.cache
def _digits(size: int) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_held, y_held): digits upsampled to size x size, standardized on
    train; 1500 train, 297 held out."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8)
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    xt, yt, xh, yh = _split(x, torch.tensor(d.target, dtype=torch.long), held=297)
    mean, std = xt.mean(), xt.std()
    return (xt - mean) / std, yt, (xh - mean) / std, yh


@functools.cache
def _diabetes() -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_held, y_held) of the diabetes regression, x and y standardized on
    train; 354 train, 88 held out."""
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.float32)[:, None]
    xt, yt, xh, yh = _split(x, y, held=88)
    xm, xs = xt.mean(0), xt.std(0)
    ym, ys = yt.mean(), yt.std()
    return (xt - xm) / xs, (yt - ym) / ys, (xh - xm) / xs, (yh - ym) / ys


_SNIPPET_MODULES = ("argparse.py", "_pydecimal.py", "turtle.py", "ssl.py")
_SNIPPET = 64


@functools.cache
def _snippets(per_class_train: int = 1024, per_class_held: int = 64) -> tuple[torch.Tensor, ...]:
    """Which standard-library module a 64-byte snippet comes from (4 classes): the first 80% of
    each file for training, the last 20% held out. Ids as the text models' (+ [CLS] = vocab)."""
    lib = Path(os.__file__).parent
    table = stdlib_text()[:_TRAIN_TEXT]
    parts: dict[str, list[torch.Tensor]] = {"xt": [], "yt": [], "xh": [], "yh": []}
    for label, name in enumerate(_SNIPPET_MODULES):
        ids = bytes_to_ids((lib / name).read_bytes(), TEXT_VOCAB, table)
        cut = int(0.8 * len(ids))
        for split, data, n in (("t", ids[:cut], per_class_train), ("h", ids[cut:], per_class_held)):
            parts["x" + split].append(_windows(data, n, _SNIPPET))
            parts["y" + split].append(torch.full((n,), label, dtype=torch.long))
    cls = torch.full((1,), TEXT_VOCAB, dtype=torch.long)

    def with_cls(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([cls.expand(len(x), 1), x], dim=1)

    return (
        with_cls(torch.cat(parts["xt"])),
        torch.cat(parts["yt"]),
        with_cls(torch.cat(parts["xh"])),
        torch.cat(parts["yh"]),
    )


class Cycle(Dataset):
    """``n`` samples that cycle over the rows of the given tensors (one epoch = the whole run)."""

    def __init__(self, n: int, *tensors: torch.Tensor) -> None:
        self.n = n
        self.tensors = tensors

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        j = i % len(self.tensors[0])
        return tuple(t[j] for t in self.tensors)


# --------------------------------------------------------------------------- the models


class UserModel(L.LightningModule):
    """Shared plumbing: the seed, ``train_loss`` logged every step, a fixed held-out
    ``eval_loss()``, and ``configure_optimizers`` returning ``optimizer(params, lr=lr,
    **optimizer_kw)``, torch's own, as the user wrote it.

    A subclass builds its layers after ``super().__init__(seed, lr)`` (which seeds torch) and
    says where its data comes from: ``splits()`` (x_train, y_train, x_held, y_held), or its own
    ``train_set`` and ``eval_batch``.
    """

    default_steps = 200
    batch_size = 32
    #: ``Trainer(precision=...)`` the model is trained with (``None``: the Trainer's default)
    precision: str | None = None
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam
    optimizer_kw: dict[str, Any] = {}  # noqa: RUF012 (read only)

    def __init__(self, seed: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(seed)

    def batch_loss(self, batch: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def splits(self) -> tuple[torch.Tensor, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def train_set(self, n: int) -> Dataset:
        x, y, _, _ = self.splits()
        return Cycle(n, x, y)

    def eval_batch(self) -> Any:
        _, _, x, y = self.splits()
        return x, y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.batch_loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters(), lr=self.lr, **self.optimizer_kw)

    @torch.no_grad()
    def eval_loss(self) -> float:
        was_training = self.training
        self.eval()
        try:
            return float(self.batch_loss(self.eval_batch()))
        finally:
            self.train(was_training)


class _DigitsModel(UserModel):
    """A classifier of the digits at ``image_size`` x ``image_size``."""

    image_size = 16

    def splits(self) -> tuple[torch.Tensor, ...]:
        return _digits(self.image_size)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def batch_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.logits(x), y)


class ConvBN(_DigitsModel):
    """Two Conv2d(bias=True) -> BatchNorm2d -> ReLU blocks, pooling, a linear classifier: the conv
    biases have (numerically) zero gradient, as BatchNorm removes the channel mean."""

    def __init__(self, seed: int = 0, lr: float = 2e-3) -> None:
        super().__init__(seed, lr)
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=True),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16x16 -> 8x8
            nn.Conv2d(16, 32, 3, padding=1, bias=True),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(2),  # 8x8 -> 2x2
            nn.Flatten(),
        )
        self.classifier = nn.Linear(32 * 4, 10)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DeadReLU(_DigitsModel):
    """64 -> 32 -> 10 ReLU MLP on 8x8 digits; 4 hidden units are dead from the start (incoming
    weights 0, bias -1): their weights and biases, in and out, never get a gradient."""

    image_size = 8
    dead = 4

    def __init__(self, seed: int = 0, lr: float = 3e-3) -> None:
        super().__init__(seed, lr)
        self.hidden = nn.Linear(64, 32)
        self.out = nn.Linear(32, 10)
        with torch.no_grad():
            self.hidden.weight[-self.dead :] = 0.0
            self.hidden.bias[-self.dead :] = -1.0

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.hidden(x.flatten(1))))


class _TextLM(UserModel):
    """Next-character prediction on the standard-library text: windows of ``context + 1`` ids."""

    context = 32
    eval_windows = 256

    def train_set(self, n: int) -> Dataset:
        train, _ = _text_ids()
        return Cycle(n, _windows(train, n, self.context + 1))

    def eval_batch(self) -> Any:
        _, held = _text_ids()
        return (_windows(held, self.eval_windows, self.context + 1),)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def batch_loss(self, batch: Any) -> torch.Tensor:
        (seq,) = batch
        logits = self.lm_logits(seq[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))


class MHABlock(_TextLM):
    """A GPT-style block around ``nn.MultiheadAttention`` (causal, in_proj bias): embeddings,
    pre-LayerNorm attention and MLP, a final LayerNorm and an LM head."""

    optimizer = torch.optim.AdamW
    optimizer_kw = {"betas": (0.9, 0.95)}  # noqa: RUF012

    def __init__(self, seed: int = 0, lr: float = 3e-3, dim: int = 64, heads: int = 4) -> None:
        super().__init__(seed, lr)
        self.tok = nn.Embedding(TEXT_VOCAB, dim)
        self.pos = nn.Embedding(self.context, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, bias=True, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, TEXT_VOCAB)
        mask = torch.triu(torch.ones(self.context, self.context, dtype=torch.bool), 1)
        self.register_buffer("causal", mask, persistent=False)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=self.causal[:t, :t], need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        return self.head(self.ln_f(h))


class TiedEmbeddings(_TextLM):
    """A window LM whose output projection *is* the input embedding (``head.weight = emb.weight``,
    as Hugging Face ties them): 16 characters -> MLP -> the next one."""

    context = 16
    optimizer = torch.optim.AdamW
    optimizer_kw = {"weight_decay": 0.01}  # noqa: RUF012

    def __init__(self, seed: int = 0, lr: float = 3e-3, dim: int = 32, hidden: int = 128) -> None:
        super().__init__(seed, lr)
        self.emb = nn.Embedding(TEXT_VOCAB, dim)
        self.body = nn.Sequential(
            nn.Flatten(), nn.Linear(self.context * dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)
        )
        self.head = nn.Linear(dim, TEXT_VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def batch_loss(self, batch: Any) -> torch.Tensor:
        (seq,) = batch  # predict the last id from the 16 before it
        return F.cross_entropy(self.head(self.body(self.emb(seq[:, :-1]))), seq[:, -1])


class GPT2(_TextLM):
    """``transformers.GPT2LMHeadModel`` (2 layers, 128 wide, 4 heads; tied embeddings); the
    slowest of the zoo, hence 150 steps."""

    default_steps = 150
    optimizer = torch.optim.AdamW
    optimizer_kw = {"betas": (0.9, 0.95), "weight_decay": 0.1}  # noqa: RUF012

    def __init__(self, seed: int = 0, lr: float = 3e-3) -> None:
        super().__init__(seed, lr)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=TEXT_VOCAB,
            n_positions=64,
            n_embd=128,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)
        self.model.loss_type = "ForCausalLM"  # what it falls back to anyway, without the warning

    def batch_loss(self, batch: Any) -> torch.Tensor:
        (seq,) = batch
        return self.model(input_ids=seq, labels=seq).loss  # the model shifts the labels


class Bert(UserModel):
    """``transformers.BertForSequenceClassification`` (2 layers, 64 wide, 2 heads): which of 4
    standard-library modules a 64-byte snippet comes from; AdamW with Hugging Face's linear
    warmup/decay schedule (from lr 0, stepped every batch)."""

    optimizer = torch.optim.AdamW
    optimizer_kw = {"weight_decay": 0.01}  # noqa: RUF012

    def __init__(self, seed: int = 0, lr: float = 3e-3, warmup: float = 0.1) -> None:
        super().__init__(seed, lr)
        from transformers import BertConfig, BertForSequenceClassification

        self.warmup = warmup
        config = BertConfig(
            vocab_size=TEXT_VOCAB + 1,  # + [CLS]
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=len(_SNIPPET_MODULES),
            pad_token_id=TEXT_VOCAB - 1,
        )
        self.model = BertForSequenceClassification(config)

    def splits(self) -> tuple[torch.Tensor, ...]:
        return _snippets()

    def batch_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        opt = super().configure_optimizers()
        total = int(self.trainer.estimated_stepping_batches)
        sched = get_linear_schedule_with_warmup(opt, math.ceil(self.warmup * total), total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class BertMLM(UserModel):
    """``transformers.BertForMaskedLM`` (2 layers, 128 wide, 2 heads) on 64-byte windows of the
    standard-library text with 15% of the positions replaced by ``[MASK]`` (fixed per window:
    every strategy sees the same masks), predicting the masked bytes; AdamW at torch's defaults,
    300 steps under ``bf16-mixed`` (the setting of 1-bit LAMB's paper: BERT pretraining)."""

    default_steps = 300
    precision = "bf16-mixed"
    optimizer = torch.optim.AdamW
    vocab = 64  # 63 byte ids (the 62 most frequent bytes + one for the rest) + [MASK]
    length = 64
    mask_rate = 0.15
    eval_windows = 256

    def __init__(self, seed: int = 0, lr: float = 1e-3) -> None:
        super().__init__(seed, lr)
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=self.vocab,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
            max_position_embeddings=self.length,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=self.vocab - 2,
        )
        self.model = BertForMaskedLM(config)

    def _masked(self, ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids with ``[MASK]`` at ``mask_rate`` of the positions, labels: the original id
        there, -100 elsewhere); the positions drawn from ``seed``, at least one per window."""
        rand = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed))
        mask = rand < self.mask_rate
        mask[torch.arange(len(ids)), rand.argmin(1)] = True
        return ids.masked_fill(mask, self.vocab - 1), ids.masked_fill(~mask, -100)

    def train_set(self, n: int) -> Dataset:
        train, _ = _text_ids(self.vocab - 1)
        return Cycle(n, *self._masked(_windows(train, n, self.length), seed=1))

    def eval_batch(self) -> Any:
        _, held = _text_ids(self.vocab - 1)
        return self._masked(_windows(held, self.eval_windows, self.length), seed=2)

    def batch_loss(self, batch: Any) -> torch.Tensor:
        x, labels = batch
        return self.model(input_ids=x, labels=labels).loss


class _HFImageClassifier(_DigitsModel):
    """A ``transformers`` image classifier (``self.model``) on 32x32 digits."""

    image_size = 32

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


class ResNet(_HFImageClassifier):
    """``transformers.ResNetForImageClassification`` (basic blocks, [16, 32] wide) on 32x32."""

    def __init__(self, seed: int = 0, lr: float = 2e-3) -> None:
        super().__init__(seed, lr)
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(
            num_channels=1,
            embedding_size=16,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            layer_type="basic",
            num_labels=10,
        )
        self.model = ResNetForImageClassification(config)


class ViT(_HFImageClassifier):
    """``transformers.ViTForImageClassification`` (2 blocks, 64 wide, 2 heads, 8x8 patches of
    32x32 digits)."""

    optimizer = torch.optim.AdamW
    optimizer_kw = {"weight_decay": 0.01}  # noqa: RUF012

    def __init__(self, seed: int = 0, lr: float = 2e-3) -> None:
        super().__init__(seed, lr)
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=32,
            patch_size=8,
            num_channels=1,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=10,
        )
        self.model = ViTForImageClassification(config)


class MLPRegression(UserModel):
    """10 -> 32 -> 1 ReLU MLP on diabetes (MSE), Adam at torch's default betas (wider or
    deeper nets overfit the 354 training rows within the 300 steps)."""

    default_steps = 300

    def __init__(self, seed: int = 0, lr: float = 1e-2) -> None:
        super().__init__(seed, lr)
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))

    def splits(self) -> tuple[torch.Tensor, ...]:
        return _diabetes()

    def batch_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)


#: name -> factory(seed=0, **hparams) -> UserModel
MODELS: dict[str, Callable[..., UserModel]] = {
    "conv_bn": ConvBN,
    "dead_relu": DeadReLU,
    "mha_block": MHABlock,
    "mlp_regression": MLPRegression,
    "tied_embeddings": TiedEmbeddings,
    "gpt2": GPT2,
    "bert": Bert,
    "bert_mlm": BertMLM,
    "resnet": ResNet,
    "vit": ViT,
}


# --------------------------------------------------------------------------- the runner


def fit_user_model(
    name: str,
    strategy: Any,
    tmp: Path,
    steps: int | None = None,
    devices: int = 2,
    seed: int = 0,
    model_kw: dict[str, Any] | None = None,
    **trainer_kw: Any,
) -> list[dict]:
    """Train ``MODELS[name]`` for ``steps`` optimizer steps (default: the model's) on ``devices``
    CPU ranks under ``strategy`` at the model's ``precision`` (unless ``trainer_kw`` names one);
    return every rank's record (``tests.helpers.fit.RecordRanks``).

    The data loader holds one epoch of exactly ``steps`` batches per rank, shuffled with
    Lightning's distributed sampler (seed 0): every strategy sees the same batches.
    """
    model = MODELS[name](seed=seed, **(model_kw or {}))
    steps = steps or model.default_steps
    if model.precision is not None:
        trainer_kw.setdefault("precision", model.precision)
    return fit_ranks(
        model, model.train_set, strategy, tmp, steps, devices, model.batch_size, **trainer_kw
    )


# --------------------------------------------------------------------------- comparison


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:  # NaN == NaN bitwise, -0.0 != 0.0
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def ranks_in_sync(records: list[dict], buffers: bool = False) -> bool:
    """Whether every rank ended with bitwise the same parameters (``buffers=True``: the buffers,
    e.g. BatchNorm's running statistics, which each rank updates from its own batches)."""
    ref = records[0]["params"]
    names = set(records[0]["param_names"])
    keys = [k for k in ref if (k not in names) == buffers]
    return all(all(_bitwise_equal(ref[k], r["params"][k]) for k in keys) for r in records[1:])


def _abs_max(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    if not torch.isfinite(t).all():
        return math.inf
    return float(t.abs().max())


def compare(ddp_records: list[dict], records: list[dict]) -> dict[str, Any]:
    """A run next to the DDP run of the same model (same seed, data and steps).

    Returns:
        ``ddp_loss``, ``loss`` (the worst rank's held-out loss) and ``loss_ratio`` (loss / DDP's);
        ``param_ratio`` and ``param_name``: the largest ``max |p| / max(max |p_ddp|, 1e-3)`` over
        the parameters (the worst rank's ``p``) and where it is reached; ``buffer_ratio`` and
        ``buffer_name``: the same over floating-point buffers (e.g. BatchNorm's running variance,
        which follows the scale of the weights before it), ``None`` without buffers;
        ``in_sync``: every rank's parameters bitwise equal; ``buffers_in_sync``: the same for the
        buffers (BatchNorm's running statistics differ across ranks under DDP too: each rank
        updates them from its own batches after the last broadcast); ``may_differ``: the
        optimizer says the parameters may legitimately differ now (0/1 Adam between
        synchronisations); ``phase``: the final phase; ``compressed_steps``: steps run in the
        optimizer's second phase; ``compression_bytes``: the mean bytes a rank sent per such
        step; ``fp32_bytes``: what an fp32 DDP (ring) allreduce of the gradients sends per step;
        ``bytes_ratio``: their quotient; ``skipped_steps``: steps dropped for NaN/Inf.
    """
    ddp_loss = ddp_records[0]["eval_loss"]
    loss = max(r["eval_loss"] for r in records)
    loss = math.inf if math.isnan(loss) else loss
    names = set(ddp_records[0]["param_names"])
    worst: dict[bool, tuple[float, str | None]] = {True: (0.0, None), False: (0.0, None)}
    for k, ref in ddp_records[0]["params"].items():
        if not ref.dtype.is_floating_point:
            continue
        ratio = max(_abs_max(r["params"][k]) for r in records) / max(_abs_max(ref), 1e-3)
        if worst[k in names][1] is None or ratio > worst[k in names][0]:
            worst[k in names] = (ratio, k)
    rec = records[0]
    phases = rec.get("phases")
    compressed = [h for h in rec["history"] if phases and h["phase"] == phases[1]]
    sent = [h["bytes"] for h in compressed if h["bytes"] is not None]
    fp32 = fp32_allreduce_bytes(rec["numel"], rec["world_size"])
    mean_bytes = sum(sent) / len(sent) if sent else None
    return {
        "ddp_loss": ddp_loss,
        "loss": loss,
        "loss_ratio": loss / ddp_loss,
        "param_ratio": worst[True][0],
        "param_name": worst[True][1],
        "buffer_ratio": worst[False][0] if worst[False][1] is not None else None,
        "buffer_name": worst[False][1],
        "in_sync": ranks_in_sync(records),
        "buffers_in_sync": ranks_in_sync(records, buffers=True),
        "may_differ": bool(rec.get("params_differ_across_ranks")),
        "phase": rec.get("phase"),
        "compressed_steps": len(compressed),
        "compression_bytes": mean_bytes,
        "fp32_bytes": fp32,
        "bytes_ratio": None if mean_bytes is None else mean_bytes / fp32,
        "skipped_steps": rec.get("skipped_steps"),
    }
