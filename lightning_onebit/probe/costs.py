"""The cost model: each method's predicted step time in each phase (compute + the
communication left exposed + the update), its bytes, and its run's end-to-end time, from what
the probe measured."""

from __future__ import annotations

from typing import Any

from lightning_onebit.optim._coded_average import window_steps
from lightning_onebit.probe.measure import Measured
from lightning_onebit.probe.timing import buckets

__all__ = ["PLANS", "bucket_penalty", "method_costs"]

#: method -> (name shown, warmup communication, compression communication, update per phase)
PLANS = {
    "ddp": ("DDP (fp32 allreduce)", "fp32", "fp32", ("torch_adam", "torch_adam")),
    "ddp_bf16": ("DDP + bf16 hook", "bf16", "bf16", ("torch_adam", "torch_adam")),
    "onebit": ("1-bit flat", "fp32", "onebit", ("adam_warmup", "frozen_adam")),
    "onebit_bf16": (
        "1-bit flat, bf16 warmup",
        "bf16",
        "onebit",
        ("adam_warmup", "frozen_adam"),
    ),
    "onebit_int4": (
        "1-bit flat, int4 warmup",
        "int4",
        "onebit",
        ("adam_warmup", "frozen_adam"),
    ),
    "onebit_hier": (
        "1-bit two-level",
        "fp32_hier",
        "onebit_hier",
        ("adam_warmup", "frozen_adam"),
    ),
    "onebit_hier_bf16": (
        "1-bit two-level, bf16 warmup",
        "bf16_hier",
        "onebit_hier",
        ("adam_warmup", "frozen_adam"),
    ),
}


def bucket_penalty(m: Measured, comm: str, cap_mb: float) -> float:
    """Extra seconds of ``cap_mb`` buckets over the measured ones: the round trips of more
    calls, and the last bucket, which waits for backward's end (fewer, larger buckets leave
    more exposed), as far as the measured run hid the other buckets behind backward."""
    link = m.links.get("inter") or m.links.get("intra")
    if link is None:
        return 0.0
    calls = 2 if comm.startswith("onebit") else 1  # the exchange: all_to_all + all_gather
    size = 4 * m.numel
    mine, base = buckets(size, cap_mb), buckets(size, m.bucket_mb)
    extra_calls = (len(mine) - len(base)) * calls * link.latency_s
    t = m.comm_s[comm]
    hideable = t * (1 - base[-1] / size)  # all buckets but the last, of the measured run
    hidden = min(max((t - m.exposed_s[comm]) / hideable, 0.0), 1.0) if hideable > 0 else 0.0
    extra_tail = hidden * t * (mine[-1] - base[-1]) / size
    return max(extra_calls + extra_tail, -t)


#: the beta2 the int4 warmup's variance window is predicted for: torch Adam's default
ADAM_BETA2 = 0.999


def _comm(m: Measured, comm: str, warm_steps: int) -> dict[str, float]:
    """``comm``'s measured per-step time alone and exposed and bytes; the int4 warmup's (of
    ``warm_steps``) their mean over its int4 steps and its variance window's int8 steps."""
    keys = ("comm_s", "exposed_s", "bytes_step", "bytes_node")
    if comm != "int4" or "int8" not in m.comm_s:
        return {k: getattr(m, k)[comm] for k in keys}
    f = window_steps(None, warm_steps, ADAM_BETA2) / max(warm_steps, 1)
    return {k: (1 - f) * getattr(m, k)["int4"] + f * getattr(m, k)["int8"] for k in keys}


def method_costs(m: Measured, steps: int, warmup_fraction: float) -> dict[str, dict[str, Any]]:
    """Per method of ``PLANS`` whose communication was measured: the predicted step time of each
    phase (compute + exposed communication + update), bytes per step, and the run's end-to-end
    time and bytes (DDP's methods have no warmup: every step is the same)."""
    warm_steps = round(steps * warmup_fraction)
    rows: dict[str, dict[str, Any]] = {}
    for key, (label, c_warm, c_comp, (u_warm, u_comp)) in PLANS.items():
        if c_warm not in m.comm_s or c_comp not in m.comm_s:
            continue
        phase = {}
        for ph, comm, upd in (("warmup", c_warm, u_warm), ("compression", c_comp, u_comp)):
            c = _comm(m, comm, warm_steps)
            exposed = max(0.0, c["exposed_s"])
            phase[ph] = {
                "step_s": m.compute_s + exposed + m.update_s[upd],
                "compute_s": m.compute_s,
                "comm_exposed_s": exposed,
                "comm_alone_s": c["comm_s"],
                "update_s": m.update_s[upd],
                "bytes": c["bytes_step"],
                "bytes_node": c["bytes_node"],
            }
        if key.startswith("ddp"):
            run_s = steps * phase["compression"]["step_s"]
            total_bytes = steps * phase["compression"]["bytes"]
        else:
            run_s = (
                warm_steps * phase["warmup"]["step_s"]
                + (steps - warm_steps) * phase["compression"]["step_s"]
            )
            total_bytes = (
                warm_steps * phase["warmup"]["bytes"]
                + (steps - warm_steps) * phase["compression"]["bytes"]
            )
        rows[key] = {"label": label, **phase, "run_s": run_s, "run_bytes": total_bytes}
    return rows
