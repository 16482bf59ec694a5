"""A rank that dies or stops in the middle of a 2-rank ``OneBitStrategy`` fit (compression
phase) ends the run with a clear error within ``OneBitStrategy(timeout=...)``, never a hang.

* fork-started ranks (``*_notebook``), rank 1 stops: rank 0's exchange times out and its
  explained error reaches ``Trainer.fit`` in the parent (Lightning's launcher re-raises rank
  0's traceback in a ``ProcessRaisedException``);
* fork-started ranks, rank 1 dies: torch's launcher notices the exit at once and stops rank 0
  itself, so the parent's error names rank 1's exit, not rank 0's view of it;
* the default launcher (``popen``: one process per rank, as under torchrun), run as a script in
  a subprocess with a hard wall-clock limit: nobody stops rank 0 for us, so rank 0 must find
  out itself — at once when rank 1 dies (its socket closes), after the timeout when it stops.

Each with the exchange in ``optimizer.step()`` (``overlap_bucket_mb=None``) and overlapped with
backward on its communication thread (the default, 25 MiB buckets). A stopped rank 1 sleeps
three timeouts and then goes on, so a rank 0 that ignores the timeout fails the test in seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers.char_model import _fit
from tests.helpers.dist import script_env
from tests.scripts.stall_fit import Stall, strategy

TIMEOUT = 5.0  # seconds: OneBitStrategy(timeout=...)
# The popen launcher starts rank 1 as a new interpreter, and the rendezvous waits for it under
# the same timeout: scripts get one that covers importing torch + lightning on a busy machine.
POPEN_TIMEOUT = 15.0
EXPLAINED = (
    "1-bit exchange failed",
    "peer rank died, stopped",
    "within the process group's timeout",
)
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stall_fit.py"

OVERLAP = [
    pytest.param(None, id="exchange-in-step"),
    pytest.param(25.0, id="overlapped"),
]


def _since_stop(tmp: Path) -> float:
    return time.time() - float((tmp / "stopped").read_text())


@pytest.mark.parametrize("overlap", OVERLAP)
def test_stuck_rank_fork_started_fails_within_the_timeout(
    tmp_path: Path, overlap: float | None
) -> None:
    with pytest.raises(Exception) as err:
        _fit(
            tmp_path,
            strategy(TIMEOUT, "fork", overlap),
            steps=20,
            callbacks=[Stall("stuck", tmp_path, sleep=3 * TIMEOUT)],
        )
    after_stop = _since_stop(tmp_path)
    message = str(err.value)
    print(f"\nfork, rank 1 stuck: error {after_stop:.1f} s after it stopped")
    for part in (*EXPLAINED, "rank 0 of 2"):
        assert part in message, f"{part!r} not in: {message[-2000:]}"
    assert TIMEOUT - 0.5 < after_stop < TIMEOUT + 8


def test_dead_rank_fork_started_stops_the_fit_at_once(tmp_path: Path) -> None:
    with pytest.raises(Exception) as err:
        _fit(
            tmp_path,
            strategy(TIMEOUT, "fork", 25.0),
            steps=20,
            callbacks=[Stall("dies", tmp_path, sleep=0)],
        )
    after_stop = _since_stop(tmp_path)
    print(f"\nfork, rank 1 died: {type(err.value).__name__} {after_stop:.1f} s later: {err.value}")
    assert "process 1 terminated with exit code 1" in str(err.value)
    assert after_stop < TIMEOUT


def _run_script(mode: str, tmp: Path, overlap: float | None, limit: float) -> tuple:
    """Run the 2-rank popen fit; return (exit code, output, seconds from rank 1's stop to exit).

    Output goes to a file, not a pipe: a stopped rank 1 would keep a pipe open after rank 0 has
    exited. The whole process group is killed at the end (rank 1 may still be sleeping)."""
    log = tmp / "output.txt"
    env = script_env(PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(SCRIPT), mode, str(POPEN_TIMEOUT), str(tmp), str(overlap).lower()]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        ended = time.time()
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    output = log.read_text(errors="replace")
    assert code is not None, f"rank 0 still running after {limit} s (hang):\n{output[-3000:]}"
    stopped = tmp / "stopped"
    assert stopped.exists(), f"rank 1 never reached the step to stop at:\n{output[-3000:]}"
    return code, output, ended - float(stopped.read_text())


@pytest.mark.parametrize(
    ("mode", "overlap"),
    [
        # one case on every change (a stuck rank's timeout is the fork-started tests' above, in
        # both exchange modes); the others in the long run
        pytest.param("dies", None, id="dies-exchange-in-step", marks=pytest.mark.long),
        pytest.param("dies", 25.0, id="dies-overlapped"),
        pytest.param("stuck", None, id="stuck-exchange-in-step", marks=pytest.mark.long),
        pytest.param(
            "stuck", 25.0, id="stuck-overlapped", marks=[pytest.mark.slow, pytest.mark.long]
        ),
    ],
)
def test_dead_or_stuck_rank_popen_fails_with_an_explained_error(
    tmp_path: Path, mode: str, overlap: float | None
) -> None:
    code, output, after_stop = _run_script(mode, tmp_path, overlap, limit=120)
    print(f"\npopen, rank 1 {mode}: rank 0 exited with {code} {after_stop:.1f} s after the stop")
    assert code != 0 and "fit returned" not in output, output[-3000:]
    for part in (*EXPLAINED, "rank 0 of 2"):
        assert part in output, f"{part!r} not in rank 0's output:\n{output[-3000:]}"
    if mode == "dies":  # the closed socket is seen at once, no need to wait for the timeout
        assert after_stop < POPEN_TIMEOUT
    else:
        assert POPEN_TIMEOUT - 0.5 < after_stop < POPEN_TIMEOUT + 8
