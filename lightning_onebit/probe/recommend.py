"""The recommendation: the 1-bit method and ``OneBitStrategy`` options that the cost model
predicts fastest, or "stay with DDP" when none beats it by ``MIN_GAIN``."""

from __future__ import annotations

from typing import Any

from lightning_onebit.probe.costs import PLANS, bucket_penalty, method_costs
from lightning_onebit.probe.measure import Measured

__all__ = ["BUCKET_CHOICES", "MIN_GAIN", "predict", "recommend"]

#: A method's 1-bit run must beat DDP by this much for the probe to recommend switching.
MIN_GAIN = 0.05
#: Bucket sizes (MiB) the recommendation chooses from.
BUCKET_CHOICES = (5.0, 25.0, 100.0)


def recommend(m: Measured, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fastest 1-bit method of ``rows`` (``method_costs``) with its ``OneBitStrategy``
    options and bucket size, or "stay with DDP" with the reason; DDP's run time as the baseline."""
    ddp = rows["ddp"]["run_s"]
    onebit = {k: r for k, r in rows.items() if k.startswith("onebit")}
    best = min(onebit, key=lambda k: onebit[k]["run_s"])
    rec: dict[str, Any] = {"baseline_run_s": ddp}
    if onebit[best]["run_s"] > (1 - MIN_GAIN) * ddp:
        bf16 = rows["ddp_bf16"]["run_s"]
        rec.update(
            choice="stay with DDP",
            why=(
                f"the best 1-bit option ({onebit[best]['label']}) would take "
                f"{onebit[best]['run_s'] / ddp:.2f}x DDP's time: the step is set by compute, "
                f"not the network (DDP's communication left exposed: "
                f"{rows['ddp']['compression']['comm_exposed_s'] * 1e3:.0f} ms of "
                f"{rows['ddp']['compression']['step_s'] * 1e3:.0f} ms)"
            ),
            run_s=ddp,
            speedup=1.0,
        )
        if bf16 < (1 - MIN_GAIN) * ddp:
            rec["why"] += f"; DDP's bf16 compress hook would take {bf16 / ddp:.2f}x"
        return rec
    comm = PLANS[best][2]
    bucket = min(BUCKET_CHOICES, key=lambda b: bucket_penalty(m, comm, b))
    gain = bucket_penalty(m, comm, bucket) - bucket_penalty(m, comm, m.bucket_mb)
    options = {
        "algorithm": "onebit_adam",
        "hierarchical": best.startswith("onebit_hier"),
        "average_dtype": best.rsplit("_", 1)[1] if best.endswith(("_bf16", "_int4")) else "float32",
        "overlap_bucket_mb": bucket if gain < 0 else m.bucket_mb,
    }
    rec.update(
        choice="OneBitStrategy",
        options=options,
        run_s=onebit[best]["run_s"],
        speedup=ddp / onebit[best]["run_s"],
        step_speedup=rows["ddp"]["compression"]["step_s"] / onebit[best]["compression"]["step_s"],
        method=best,
    )
    return rec


def predict(m: Measured, steps: int, warmup_fraction: float) -> dict[str, Any]:
    """Per method: the predicted step time of each phase (compute + exposed communication +
    update), bytes per step, the run's end-to-end time; and the recommendation.

    Returns:
        ``{"methods": method_costs(...), "recommendation": recommend(...)}``.
    """
    rows = method_costs(m, steps, warmup_fraction)
    return {"methods": rows, "recommendation": recommend(m, rows)}
