"""``OneBitOptimizer``'s checkpoints: torch's state dict plus the ``"onebit"`` entry (step
count, phase, counters, this rank's error buffers), and what of it differs per rank:
``CheckpointLayout``, behind the optimizer's ``state_dict``/``load_state_dict``/
``rank_state_dict``/``load_rank_state_dict``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_onebit.optim._base import OneBitOptimizer

__all__ = ["CheckpointLayout", "Checkpointed"]


class CheckpointLayout:
    """What an optimizer's checkpoint holds beyond torch's state dict, as the algorithm declares
    it: the per-parameter states kept in fp32 (``tensors``) and the optimizer-wide attributes
    (``attrs``), besides what every algorithm has (step count, phase, counters, the exchange's
    error buffers, ``rescale_variance``'s counters). It reads the optimizer's public attributes
    and composed objects.

    Interface: ``save``, ``load``, ``rank_state``, ``load_rank_state``.

    Args:
        tensors: the names of the per-parameter states (flat states and per-tensor scalars).
        attrs: the names of the optimizer's checkpointed attributes.
    """

    def __init__(self, tensors: tuple[str, ...], attrs: tuple[str, ...]) -> None:
        self.tensors, self.attrs = tensors, attrs

    def _entry(self, opt: OneBitOptimizer) -> dict[str, Any]:
        """The ``"onebit"`` entry of ``save``."""
        return {
            "step_count": opt.step_count,
            "variance_updates": opt.variance_updates,
            "phase": opt.phase.value,
            "skipped_steps": opt.skipped_steps,
            "comm_stats": dict(opt.comm_stats),
            **{k: copy.deepcopy(getattr(opt, k)) for k in self.attrs},
            **opt.rescale.state_dict(),
            "exchange": opt.flat.exchange_state(),
            "coded_average": opt.coded_average.state(),
            "window_variance": opt.window_variance.state(),
        }

    def save(self, opt: OneBitOptimizer, state: dict[str, Any]) -> dict[str, Any]:
        """torch's optimizer ``state`` of ``opt`` with torch Adam's per-parameter ``step`` (the
        steps its group has taken, less those it had no gradient in) and the ``"onebit"``
        entry."""
        for saved, group in zip(state["param_groups"], opt.param_groups, strict=True):
            steps = torch.tensor(float(opt.step_count - group.get("joined_at", (0, 0))[0]))
            for i in saved["params"]:  # torch's packed indices
                if i in state["state"]:  # less the steps it had no gradient in: torch's count
                    missed = state["state"][i].get("steps_without_grad", (0, 0))[0]
                    state["state"][i] = {**state["state"][i], "step": steps - missed}
        state["onebit"] = self._entry(opt)
        return state

    def rank_state(self, opt: OneBitOptimizer) -> dict[str, Any]:
        """What of this rank's state differs from the other ranks' (see the optimizer's)."""
        if opt.params_differ_across_ranks:
            return opt.state_dict()
        mine: dict[str, Any] = {
            "exchange": opt.flat.exchange_state(),
            "coded_average": opt.coded_average.state(),
        }
        sums = [opt.state.get(p, {}).get("grad_sq_sum") for p in self._trainable(opt)]
        if opt.rescale_variance and all(x is not None for x in sums):
            # rescale_variance: this rank's sums of g**2 since the last all-reduce
            mine["grad_sq_sum"] = torch.stack(sums).detach().cpu().clone()
        return {"onebit": mine}

    def load_rank_state(self, opt: OneBitOptimizer, state_dict: dict[str, Any]) -> None:
        """Restore a ``rank_state`` (after the shared state dict, unless it is whole)."""
        if "state" in state_dict:  # a whole state dict
            opt.load_state_dict(state_dict)
            return
        opt.flat.load_exchange_state(state_dict["onebit"]["exchange"])
        opt.coded_average.load(state_dict["onebit"].get("coded_average"))
        sums = state_dict["onebit"].get("grad_sq_sum")
        params = self._trainable(opt)
        if opt.rescale_variance and sums is not None and len(sums) == len(params):
            for p, x in zip(params, sums, strict=True):  # adopted by the next layout
                opt.state[p]["grad_sq_sum"] = x.to(device=p.device, dtype=torch.float32)
            opt.flat.invalidate()

    def _trainable(self, opt: OneBitOptimizer) -> list[torch.Tensor]:
        """The parameters of the flat layout, in its order."""
        return [p for g in opt.param_groups for p in g["params"] if p.requires_grad]

    def load(
        self,
        opt: OneBitOptimizer,
        state_dict: dict[str, Any],
        torch_load: Callable[[dict[str, Any]], None],
    ) -> bool:
        """Restore a ``save`` into ``opt``: our per-parameter tensors are taken out
        before ``torch_load`` (torch's loader, which would cast them to the parameters' dtype)
        and put into ``opt.state`` in fp32, for the next layout to adopt. Returns whether the
        state dict was another optimizer's (torch Adam's: no ``"onebit"`` entry)."""
        opt.verdict.pending = None  # of the steps the loaded state replaces
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in opt.param_groups]:
            raise ValueError(
                "loaded state dict has param groups of sizes "
                f"{[len(g['params']) for g in saved_groups]}, this optimizer "
                f"{[len(g['params']) for g in opt.param_groups]}: build the optimizer over the "
                "same parameters as the one that was saved"
            )
        for saved, group in zip(saved_groups, opt.param_groups, strict=True):
            saved.pop("exp_avg_mask", None)
            if "exp_avg_mask" in group:
                saved["exp_avg_mask"] = group["exp_avg_mask"]
        state_dict["param_groups"] = saved_groups

        # take our per-parameter tensors out before torch's loader casts them
        ours = self.tensors
        id_map = {
            idx: p
            for saved, group in zip(saved_groups, opt.param_groups, strict=True)
            for idx, p in zip(saved["params"], group["params"], strict=True)
        }
        kept: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        rest: dict[Any, Any] = {}
        # torch's Adam counts steps per parameter; ours are counters of the optimizer
        torch_steps = [
            max(
                (int(state_dict["state"].get(i, {}).get("step", 0)) for i in g["params"]), default=0
            )
            for g in saved_groups
        ]
        for idx, pstate in state_dict["state"].items():
            mine = {k: v for k, v in pstate.items() if k in ours and isinstance(v, torch.Tensor)}
            other = {k: v for k, v in pstate.items() if k not in mine}
            other.pop("step", None)  # torch Adam's count: see state_dict
            if mine and idx in id_map:
                kept[id_map[idx]] = mine
            if other:
                rest[idx] = other
        state_dict["state"] = rest
        torch_load(state_dict)
        for p, mine in kept.items():
            opt.state[p].update(
                {
                    k: v.detach().to(device=p.device, dtype=torch.float32, copy=True)
                    for k, v in mine.items()
                }
            )

        foreign, extra = extra is None, extra or {}
        opt.loaded_foreign = foreign
        opt.step_count = int(extra.get("step_count", max(torch_steps, default=0)))
        if foreign:
            for group, steps in zip(opt.param_groups, torch_steps, strict=True):
                for k, v in opt.defaults.items():  # e.g. 1-bit LAMB's, which Adam lacks
                    group.setdefault(k, v)
                if 0 < steps < opt.step_count:
                    group["joined_at"] = (opt.step_count - steps,) * 2
        # a checkpoint from before the counter: every step had updated the variance
        opt.variance_updates = int(extra.get("variance_updates", opt.step_count))
        opt.verdict.skipped_steps = int(extra.get("skipped_steps", 0))
        opt.phases.restore(extra.get("phase", opt.phases.first.value))
        opt.comm_stats.update(extra.get("comm_stats", {}))
        for k in self.attrs:
            if k in extra:
                setattr(opt, k, copy.deepcopy(extra[k]))
        opt.rescale.load_state_dict(extra)
        opt.flat.load_exchange_state(extra.get("exchange"))
        opt.coded_average.load(extra.get("coded_average"))
        opt.window_variance.load(extra.get("window_variance"))
        opt.flat.invalidate()  # adopt the loaded tensors at the next step
        return foreign


class Checkpointed:
    """The checkpoint methods of ``OneBitOptimizer`` (a base before ``torch.optim.Optimizer``,
    whose ``state_dict``/``load_state_dict`` they extend), over its ``checkpoint`` layout."""

    checkpoint: CheckpointLayout

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"onebit"``: step count, phase, counters, this rank's
        error buffers ([`rank_state_dict`][lightning_onebit.optim.OneBitOptimizer.rank_state_dict]).
        Each parameter's state has torch Adam's ``step`` too, so that ``torch.optim.Adam``/``AdamW``
        can load it."""
        self._apply_last_step()  # the counts must be final
        return self.checkpoint.save(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a [`state_dict`][lightning_onebit.optim.OneBitOptimizer.state_dict] (states in
        fp32; each group keeps its current ``exp_avg_mask``, as DeepSpeed). One without ``"onebit"``
        (``torch.optim.Adam``'s) loads the moments and step counts into the first phase (then
        [`catch_up_switch`][lightning_onebit.optim.OneBitOptimizer.catch_up_switch])."""
        if self.checkpoint.load(self, state_dict, super().load_state_dict):
            self._on_foreign_load()
        self.divergence.reset()

    def rank_state_dict(self) -> dict[str, Any]:
        """What of this rank's state differs from the others': its error buffers, or the whole
        [`state_dict`][lightning_onebit.optim.OneBitOptimizer.state_dict] where
        [`params_differ_across_ranks`][lightning_onebit.optim.OneBitOptimizer.params_differ_across_ranks]."""
        return self.checkpoint.rank_state(self)

    def load_rank_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a [`rank_state_dict`][lightning_onebit.optim.OneBitOptimizer.rank_state_dict]
        after loading the shared
        [`state_dict`][lightning_onebit.optim.OneBitOptimizer.state_dict]."""
        self.checkpoint.load_rank_state(self, state_dict)
