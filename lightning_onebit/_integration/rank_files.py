"""Per-rank checkpoint files: ``<checkpoint>.onebit-rank<R>-of-<W>`` beside a checkpoint, how
they are found on resume (beside a link's target, where a copy was saved), read (with
``weights_only=True`` and a check of what is in them: nothing in a file can run code) and written
(atomically)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from fsspec.core import strip_protocol
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_onebit.optim import OneBitOptimizer, ZeroOneAdam

__all__ = [
    "PATH",
    "RankCheckpoint",
    "RankFileError",
    "Ranked",
    "find_rank_state",
    "load_rank_file",
    "rank_file_name",
    "read_rank_state",
    "save_atomically",
    "write_rank_file",
]

PATH = str | os.PathLike[str]  # what Lightning accepts as a checkpoint path

#: the entries of a rank file, as ``write_rank_file`` writes them
_RANK_FILE_KEYS = frozenset({"world_size", "rank", "global_step", "optimizer", "model"})
#: the values found in a rank file besides tensors and containers of them
_PLAIN = (bool, int, float, str, type(None))


class RankFileError(RuntimeError):
    """A per-rank 1-bit file beside a checkpoint that is refused: it cannot be loaded with
    ``weights_only=True`` (it would run code, or it is damaged), or it holds something a
    1-bit strategy does not write. Raised on every rank, before training starts."""


def rank_file_name(checkpoint_path: PATH, rank: int, world_size: int) -> str:
    return f"{os.fspath(checkpoint_path)}.onebit-rank{rank}-of-{world_size}"


def find_rank_state(
    checkpoint_path: PATH,
    checkpoint: Mapping[str, Any],
    rank: int,
    world_size: int,
    load: bool = True,
    weights_only: bool | None = None,
) -> tuple[Any, list[str]]:
    """Rank ``rank``'s file for ``checkpoint`` (its content; with ``load=False`` only whether
    there is one), and the paths looked at.

    Beside the path the user resumes from, else beside the file a symlink points to
    (``ModelCheckpoint(save_last="link")``), else beside the path the checkpoint was saved at
    (a copy). A loaded file counts only if it is from the checkpoint's step.

    Raises:
        RankFileError: a file found is refused by [load_rank_file][lightning_onebit._integration.rank_files.load_rank_file]
            (``weights_only``: as there).
    """
    candidates = [os.fspath(checkpoint_path)]
    fs = get_filesystem(candidates[0])
    if isinstance(fs, LocalFileSystem) and os.path.islink(candidates[0]):
        candidates.append(os.path.realpath(candidates[0]))
    saved_as = (checkpoint.get("onebit") or {}).get("saved_as")
    if saved_as:
        candidates.append(saved_as)
    looked: list[str] = []
    for candidate in dict.fromkeys(candidates):
        rank_file = rank_file_name(candidate, rank, world_size)
        fs = get_filesystem(rank_file)
        if not fs.exists(rank_file):
            looked.append(rank_file)
            continue
        if not load:
            return True, looked
        state = load_rank_file(rank_file, weights_only)
        if state.get("global_step") == checkpoint.get("global_step"):
            return state, looked
        looked.append(f"{rank_file} (from step {state.get('global_step')})")
    return None, looked


def load_rank_file(rank_file: str, weights_only: bool | None = None) -> dict[str, Any]:
    """The content of the rank file at ``rank_file``, loaded so that nothing in it can run code.

    Args:
        rank_file: the file's path (local or fsspec).
        weights_only: as given to Lightning's checkpoint load: ``None`` or ``True`` load with
            ``torch.load(weights_only=True)``; ``False`` (the user trusts the file) with a full
            unpickler. Either way the content must be what
            [write_rank_file][lightning_onebit._integration.rank_files.write_rank_file] writes:
            a dict of its five entries holding tensors, numbers, strings, ``None`` and lists,
            tuples and dicts of them.

    Raises:
        RankFileError: the file cannot be loaded that way, or holds anything else; the message
            names the file and what to do.
    """
    safe = weights_only is not False
    try:
        with get_filesystem(rank_file).open(rank_file, "rb") as f:
            state = torch.load(f, weights_only=safe)
    except Exception as err:  # an unpickling refusal, a damaged zip, a foreign format
        how = "torch.load(weights_only=True)" if safe else "torch.load"
        raise RankFileError(_refusal(rank_file, f"{how} failed: {_reason(err)}")) from err
    problem = _not_written_by_us(state)
    if problem is not None:
        raise RankFileError(_refusal(rank_file, problem))
    return state


def _reason(err: Exception) -> str:
    """The line of a failed ``torch.load`` that says what was refused (torch's weights-only error
    says it after "WeightsUnpickler error:", amid advice to load without ``weights_only`` or
    to allowlist what it refused)."""
    text = str(err)
    found = re.search(
        r"WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|Please use|$)", text, re.S
    )
    reason = " ".join((found.group(1) if found else text).split())
    return reason.rstrip(".") or type(err).__name__


def _refusal(rank_file: str, why: str) -> str:
    """The message of a refused rank file: which, why, and the two ways on."""
    return (
        f"refused to load the per-rank 1-bit file {rank_file}: {why}. It is not a file as a "
        "1-bit strategy writes it (changed or replaced since it was saved). Restore it as it "
        "was saved, or delete it to resume with this rank's 1-bit error buffers reset to zero "
        "(a warning then names the ranks whose buffers restart)"
    )


def _not_written_by_us(state: Any) -> str | None:
    """What in a loaded rank file is not what ``write_rank_file`` writes (``None``: all is)."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    if set(state) != _RANK_FILE_KEYS:
        return f"its entries are {sorted(map(str, state))}, not {sorted(_RANK_FILE_KEYS)}"
    todo: list[tuple[str, Any]] = [("", state)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, _PLAIN):
                    return f"{where or 'it'} has a key of type {type(k).__name__}"
                todo.append((f"{where}[{k!r}]", v))
        elif isinstance(value, list | tuple):
            todo.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif not isinstance(value, (torch.Tensor, *_PLAIN)):
            return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"
    return None


def _local_phase_note(checkpoint: Mapping[str, Any], every_rank: bool) -> str:
    """What a resume without some ranks' files does to parameters that differ across ranks."""
    meta = checkpoint.get("onebit") or {}
    differ = meta.get("params_differ_across_ranks")
    if differ is None:  # a checkpoint from before the "onebit" entry: 0/1 Adam's local phase
        states = checkpoint.get("optimizer_states") or [{}]
        differ = (
            isinstance(states[0], Mapping)
            and (states[0].get("onebit") or {}).get("phase") == ZeroOneAdam.PHASES[1]
        )
    if not differ:
        return ""
    who = "every rank resumes" if every_rank else "those ranks resume"
    return (
        "; the checkpoint was taken between two synchronisations of 0/1 Adam's local phase, when "
        f"each rank had its own parameters and momenta: {who} from rank 0's (the ones in the "
        "checkpoint), so the local steps the other ranks took since the last synchronisation are "
        "dropped" + (" and all ranks start from identical parameters" if every_rank else "")
    )


def save_atomically(obj: Any, path: str) -> None:
    """Write ``path`` so that it is never half-written, even if the process dies mid-write.

    Local paths: a temporary file in the same directory (so the same filesystem), flushed to
    disk, then renamed over ``path`` in one step. (Lightning's ``_atomic_save`` writes its
    temporary file into the system temp directory; when that is another filesystem than the
    checkpoint's, its final move is a copy, which a crash can leave half-written.) Remote
    (fsspec) paths: serialised in memory, then written in one fsspec transaction (an object
    store publishes the object when the transaction commits), as Lightning does.
    """
    fs = get_filesystem(path)
    if not isinstance(fs, LocalFileSystem):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with fs.transaction, fs.open(path, "wb") as f:
            f.write(buffer.getvalue())
        return
    path = strip_protocol(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_rank_file(
    opt: OneBitOptimizer,
    module: torch.nn.Module,
    checkpoint: dict[str, Any],
    filepath: PATH,
    rank_file: str,
    rank: int,
    world_size: int,
) -> None:
    """Write this rank's file for ``checkpoint`` (about to be saved at ``filepath`` by rank 0)
    and note in ``checkpoint`` what a resume needs to know."""
    rank_state = {
        "world_size": world_size,
        "rank": rank,
        "global_step": checkpoint.get("global_step"),
        # only what differs across ranks: the checkpoint holds the rest once
        "optimizer": opt.rank_state_dict(),
        # 0/1 Adam's local steps: parameters differ per rank until the next sync
        "model": module.state_dict() if opt.params_differ_across_ranks else None,
    }
    get_filesystem(rank_file).makedirs(os.path.dirname(rank_file) or ".", exist_ok=True)
    save_atomically(rank_state, rank_file)
    # what a resume from a copy, with another world size, or without this rank file needs to know
    checkpoint["onebit"] = {
        "world_size": world_size,
        "optimizer": type(opt).__name__,
        "params_differ_across_ranks": opt.params_differ_across_ranks,
        "saved_as": os.fspath(filepath),
    }
    # rank 0's error buffers do not belong in the checkpoint every rank loads
    for state in checkpoint.get("optimizer_states", []):
        if isinstance(state, dict) and "onebit" in state:
            state["onebit"] = {**state["onebit"], "exchange": None}


def _rank_files_note(
    path: PATH, checkpoint: Mapping[str, Any], world_size: int, found: bool, looked: list[str]
) -> str:
    """What rank 0 sees of every rank's file (the filesystem is shared in the usual case)."""
    missing: dict[int, list[str]] = {} if found else {0: looked}
    for r in range(1, world_size):
        there, where = find_rank_state(path, checkpoint, r, world_size, load=False)
        if not there:
            missing[r] = where
    if not missing:
        return ""
    p = Path(os.fspath(path))  # only to name what is there instead
    saved = sorted(q.name for q in p.parent.glob(p.name + ".onebit-rank*"))
    if not checkpoint.get("onebit") and not saved:
        return (
            f"{p.name} was not written by a 1-bit strategy (no 1-bit state in it or beside it: "
            "e.g. a strategy='ddp' checkpoint): the 1-bit optimizer takes its Adam moments and "
            "step count, and its error buffers start at zero"
        )
    saved_world = (checkpoint.get("onebit") or {}).get("world_size")
    if saved_world is None and saved:  # a checkpoint from before the "onebit" entry
        saved_world = int(saved[0].rsplit("-of-", 1)[-1])
    changed = saved_world is not None and saved_world != world_size
    who = "every rank" if len(missing) == world_size else f"ranks {sorted(missing)}"
    first, where = next(iter(missing.items()))
    return (
        f"no per-rank 1-bit state for {who} of {world_size} (rank {first}: looked for "
        f"{', '.join(where)}; found beside {p.name}: {', '.join(saved) or 'none'})"
        + (f": the world size changed from {saved_world} to {world_size}" if changed else "")
        + "; resuming with the 1-bit error buffers of those ranks reset to zero"
        + _local_phase_note(checkpoint, every_rank=changed or len(missing) == world_size)
    )


def read_rank_state(
    path: PATH,
    checkpoint: Mapping[str, Any],
    rank: int,
    world_size: int,
    weights_only: bool | None = None,
) -> dict[str, Any] | None:
    """This rank's file for ``checkpoint`` (loaded from ``path``), or ``None`` with a warning:
    rank 0 names every rank whose file is missing (the filesystem is shared in the usual case);
    another rank warns itself only where it saw a file from another step (what rank 0 cannot see).

    Raises:
        RankFileError: this rank's file is refused (see
            [load_rank_file][lightning_onebit._integration.rank_files.load_rank_file]).
    """
    state, looked = find_rank_state(path, checkpoint, rank, world_size, weights_only=weights_only)
    if rank == 0:  # one message for every rank, from rank 0
        note = _rank_files_note(
            path, checkpoint, world_size, found=state is not None, looked=looked
        )
        if note:
            rank_zero_warn(note)
    elif state is None and any("from step" in p for p in looked):
        warnings.warn(
            f"rank {rank}: no per-rank 1-bit state from the checkpoint's step "
            f"(looked for {', '.join(looked)}); this rank's error buffers restart from zero",
            UserWarning,
            stacklevel=2,
        )
    return state


class Ranked(Protocol):
    """What ``RankCheckpoint`` reads of its strategy (both Lightning ``DDPStrategy`` kinds
    have it)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class RankCheckpoint:
    """This rank's 1-bit state around a strategy's checkpoints: written beside each checkpoint
    (``write_rank_file``), read back on resume (``read_rank_state``) and restored into
    the optimizer and the model after Lightning restored theirs. Lightning writes a checkpoint
    on rank 0 only; the error buffers (and, between two synchronisations of 0/1 Adam, the
    parameters) differ across ranks.

    Args:
        strategy: the strategy whose rank and world size name the files.

    Attributes:
        pending: the state read by ``read``, until ``restore_optimizer`` used it.
        strict: the ``strict`` of the last model restore (used again by ``restore_model``).
    """

    def __init__(self, strategy: Ranked) -> None:
        self.strategy = strategy
        self.pending: dict[str, Any] | None = None
        self.strict = True

    def file(self, path: PATH) -> str:
        """This rank's file beside the checkpoint at ``path``."""
        return rank_file_name(path, self.strategy.global_rank, self.strategy.world_size)

    def save(
        self,
        opt: OneBitOptimizer,
        module: torch.nn.Module,
        checkpoint: dict[str, Any],
        path: PATH,
    ) -> None:
        """Write this rank's file for ``checkpoint`` (about to be saved at ``path`` by rank 0),
        and note in ``checkpoint`` what a resume needs to know."""
        s = self.strategy
        write_rank_file(opt, module, checkpoint, path, self.file(path), s.global_rank, s.world_size)

    def save_step_keyed(
        self,
        opt: OneBitOptimizer,
        module: torch.nn.Module | None,
        checkpoint: dict[str, Any],
        optimizer_states: list[Any],
        path: PATH,
        extra: dict[str, Any],
    ) -> None:
        """``save`` for a checkpoint with no global step (Fabric's): the optimizer's steps
        and skipped steps tie the rank file to it. ``optimizer_states``: the optimizer's entries
        in ``checkpoint`` (their error buffers are dropped); ``extra`` goes into the
        checkpoint's ``"onebit"`` entry."""
        view: dict[str, Any] = {
            "global_step": [opt.step_count, opt.skipped_steps],
            "optimizer_states": optimizer_states,
        }
        self.save(opt, module if module is not None else torch.nn.Module(), view, path)
        checkpoint["onebit"] = {**view["onebit"], "global_step": view["global_step"], **extra}

    def remove(self, path: PATH) -> None:
        """Delete this rank's file beside the checkpoint at ``path``, if there is one."""
        rank_file = self.file(path)
        fs = get_filesystem(rank_file)
        if fs.exists(rank_file):
            fs.rm(rank_file)

    def read(
        self, path: PATH, checkpoint: Mapping[str, Any], weights_only: bool | None = None
    ) -> None:
        """Read this rank's file for ``checkpoint`` (loaded from ``path``) into ``pending``
        (``None``, with a warning, where it is missing). Collective: every rank calls it.

        Args:
            path: the checkpoint's path.
            checkpoint: the loaded checkpoint.
            weights_only: the user's, as Lightning passed it to the checkpoint load (see
                [load_rank_file][lightning_onebit._integration.rank_files.load_rank_file]).

        Raises:
            RankFileError: on every rank, naming every refused file, when any rank's file is
                refused (the ranks agree before any goes on, so that none waits in training for
                one that stopped).
        """
        s = self.strategy
        self.strict = True
        refused: str | None = None
        try:
            self.pending = read_rank_state(
                path, checkpoint, s.global_rank, s.world_size, weights_only
            )
        except RankFileError as err:
            self.pending, refused = None, str(err)
        everyone = [refused]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, refused)
        if len(everyone) == 1 and refused is not None:
            raise RankFileError(refused)
        refusals = [f"rank {r}: {m}" for r, m in enumerate(everyone) if m is not None]
        if refusals:
            raise RankFileError("; ".join(refusals))

    def read_step_keyed(
        self, path: PATH, checkpoint: dict[str, Any], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """``read`` for a checkpoint ``save_step_keyed`` wrote; pops and returns its
        ``"onebit"`` entry (``{}`` where it has none)."""
        meta = checkpoint.pop("onebit", None) or {}
        self.read(path, {"global_step": meta.get("global_step"), "onebit": meta}, weights_only)
        return meta

    def forget(self) -> None:
        """Drop what ``read`` read (a checkpoint with nothing per rank to restore)."""
        self.pending = None

    def restore_model(self, module: torch.nn.Module, strict: bool | None = None) -> None:
        """This rank's own parameters into ``module``, where the checkpoint was taken while they
        differed across ranks (0/1 Adam between two synchronisations); ``strict``: as given to
        Lightning's model restore (``None``: the last one given)."""
        if strict is not None:
            self.strict = strict
        if self.pending is not None and self.pending.get("model") is not None:
            module.load_state_dict(self.pending["model"], strict=self.strict)

    def restore_optimizer(self, opt: OneBitOptimizer) -> None:
        """This rank's error buffers into ``opt`` (after Lightning restored its shared state);
        then ``pending`` is used up."""
        if self.pending is not None:
            opt.load_rank_state_dict(self.pending["optimizer"])
        self.pending = None
