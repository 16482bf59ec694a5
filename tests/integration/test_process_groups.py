"""Every process group a 1-bit run needs is made while it sets up, never inside a training step,
and one that cannot connect fails within the timeout, naming itself.

* A 2-rank Trainer fit with the exchange overlapped with backward, and 4 ranks in two levels
  (``hierarchical=True``, overlap on) driven directly: no ``dist.new_group`` after setup /
  ``connect()``.
* A group whose other rank never comes fails after the timeout with an error naming it.
* Under torchrun's agent store, the default group of a restart attempt connects although the
  previous attempt's ranks left their addresses in the store (what makes a plain ``env://`` start
  fail or hang there): ``init_default_group_per_attempt``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_onebit import OneBitStrategy
from lightning_onebit.comm import new_group
from lightning_onebit.optim import OneBitAdam
from tests.helpers.char_model import _fit
from tests.helpers.dist import free_port, run_distributed

_made: list[str] = []  # (per process) the phase each new_group call came in
_phase = ["setup"]


def _recording_new_group(real: Any) -> Any:
    def made(*args: Any, **kwargs: Any) -> Any:
        _made.append(_phase[0])
        return real(*args, **kwargs)

    return made


class GroupsPerPhase(Callback):
    """Each rank writes the phases its ``new_group`` calls came in."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, *args: Any) -> None:
        _phase[0] = "step"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.out / f"groups{trainer.global_rank}.txt").write_text(" ".join(_made))


@pytest.mark.slow
def test_a_fit_makes_its_groups_at_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "new_group", _recording_new_group(dist.new_group))
    strategy = OneBitStrategy(freeze_step=3, start_method="fork", overlap_bucket_mb=0.01)
    records = _fit(tmp_path, strategy, steps=6, callbacks=[GroupsPerPhase(tmp_path)])
    assert records[0]["overlap"] and records[0]["phase"] == "compression"
    for r in range(2):
        made = (tmp_path / f"groups{r}.txt").read_text().split()
        assert made and set(made) == {"setup"}, f"rank {r} made groups in: {made}"


def _steps_after_connect(rank: int, world_size: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, hierarchical=True)
    opt.ranks_per_node = 2
    opt.overlap_with_backward(0.0005, timeout=timedelta(seconds=60))
    real = dist.new_group
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.new_group = counted
    try:
        opt.connect(timedelta(seconds=60))
        at_connect = calls[0]
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            model(torch.randn(16, 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.node_groups() is not None and opt.phase == "compression"
    finally:
        dist.new_group = real
        opt.close()
    return at_connect, calls[0]


@pytest.mark.slow
def test_connect_makes_every_group_of_the_two_level_overlapped_exchange() -> None:
    for at_connect, total in run_distributed(_steps_after_connect, 4):
        # the two levels' groups (2 nodes + 2 local ranks) for the optimizer and for the
        # overlap, and the overlap's flat group
        assert at_connect == 9 and total == at_connect


def _one_rank_absent(rank: int, world_size: int) -> tuple[float, str]:
    if rank == 1:
        time.sleep(8)
        return 0.0, ""
    t0 = time.perf_counter()
    try:
        new_group([0, 1], "gloo", timedelta(seconds=2), "the test's group")
    except RuntimeError as err:
        return time.perf_counter() - t0, str(err)
    return time.perf_counter() - t0, "made"


def test_a_group_that_cannot_connect_fails_within_its_timeout_naming_it() -> None:
    seconds, message = run_distributed(_one_rank_absent, 2)[0]
    assert 1.5 < seconds < 6, seconds
    assert message.startswith("could not create the test's group (gloo process group of ranks"), (
        message
    )
    assert "timeout 0:00:02" in message and "GLOO_SOCKET_IFNAME" in message, message


def _attempt(rank: int, port: int, attempt: int, delay: float, q: Any) -> None:
    """One rank of a torchrun attempt on the agent's store at ``port``: start the default group
    (ours), all-reduce once, then die without a word (attempt 0) or report (later attempts)."""
    from lightning_onebit._integration.lifecycle import init_default_group_per_attempt

    os.environ.update(
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    time.sleep(delay)
    try:
        started = init_default_group_per_attempt(
            "gloo", rank, 2, timedelta(seconds=10), torch.device("cpu")
        )
        x = torch.ones(1)
        dist.all_reduce(x)
        q.put((rank, f"started={started} sum={float(x)}"))
    except Exception as err:
        q.put((rank, f"failed: {err}"))
    q.close()
    q.join_thread()  # (what was put is sent before the exit)
    os._exit(0)  # (no destroy: the store keeps what this attempt wrote, as after a SIGKILL)


def test_a_restart_attempt_connects_past_the_dead_attempts_addresses() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    for attempt, delays in ((0, (0.0, 0.0)), (1, (1.5, 0.0))):  # then rank 1 reads first
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_attempt, args=(r, port, attempt, delays[r], q)) for r in (0, 1)
        ]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(timeout=10)
        assert got == {0: "started=True sum=2.0", 1: "started=True sum=2.0"}, (attempt, got)
    del agent_store
