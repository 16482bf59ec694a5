"""The console report: what was measured, one row per method, the recommendation."""

from __future__ import annotations

from typing import Any

from lightning_onebit.probe.measure import Measured

__all__ = ["report"]


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def report(m: Measured, pred: dict[str, Any], steps: int, warmup_fraction: float) -> str:
    """The console report: what was measured, one row per method, the recommendation."""
    nodes = m.world_size // m.ranks_per_node
    out = [
        f"lightning-onebit probe: {m.world_size} ranks ({nodes} node(s) x {m.ranks_per_node}), "
        f"{m.backend} on {m.device}, {m.numel:,} parameters ({_si(4 * m.numel, 'B')} fp32)",
        "links (timed all_reduce, fit: time = latency + wire bytes / bandwidth):",
    ]
    names = {"intra": "inside a node", "inter": "between nodes (one rank per node)"}
    for k, link in m.links.items():
        out.append(
            f"  {names[k]:<34} latency {_ms(link.latency_s)}, bandwidth "
            f"{_si(link.bandwidth_Bps, 'B/s')} ({_si(8 * link.bandwidth_Bps, 'bit/s')}), "
            f"{len(link.points)} sizes up to {_si(link.points[-1][0], 'B')}"
        )
    comp = _ms(m.compute_s) if m.compute_s else "not given (pass --model or --step-ms)"
    out.append(f"compute: forward+backward {comp} ({m.compute_source})")
    out.append(
        "kernels at this size: "
        + ", ".join(f"{k} {_ms(v)}" for k, v in m.kernels_s.items())
        + f"; torch Adam {_ms(m.update_s['torch_adam'])}"
    )
    out.append(
        "communication alone at this size: "
        + ", ".join(f"{k} {_ms(v)}" for k, v in m.comm_s.items())
    )
    w = round(steps * warmup_fraction)
    out += [
        "",
        f"{'method':<30} {'warmup step':>12} {'1-bit step':>12} {'exposed comm':>13} "
        f"{'MB/step':>14} {f'run of {steps} ({w} warmup)':>24}",
    ]
    for r in pred["methods"].values():
        wu, cp = r["warmup"], r["compression"]
        mb = (
            f"{cp['bytes'] / 1e6:.3g}"
            if wu["bytes"] == cp["bytes"]
            else f"{wu['bytes'] / 1e6:.3g}/{cp['bytes'] / 1e6:.3g}"
        )
        out.append(
            f"{r['label']:<30} {_ms(wu['step_s']):>12} {_ms(cp['step_s']):>12} "
            f"{_ms(cp['comm_exposed_s']):>13} {mb:>14} {_ms(r['run_s']):>24}"
        )
    rec = pred["recommendation"]
    out.append("")
    if rec["choice"] == "stay with DDP":
        out.append(f"recommendation: stay with DDP: {rec['why']}")
    else:
        opts = ", ".join(f"{k}={v!r}" for k, v in rec["options"].items())
        out.append(
            f"recommendation: OneBitStrategy({opts}): predicted {rec['step_speedup']:.2f}x "
            f"DDP's step in the 1-bit phase, {rec['speedup']:.2f}x over the run "
            f"({_ms(rec['baseline_run_s'])} -> {_ms(rec['run_s'])})"
        )
    return "\n".join(out)
