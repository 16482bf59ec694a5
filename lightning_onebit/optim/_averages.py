"""The two averages a 1-bit optimizer's step takes (``Averages``, a base of
``OneBitOptimizer``): the gradients averaged over the ranks in full precision (the warmup's,
0/1 Adam's variance steps) and the error-compensated 1-bit average of what the algorithm
exchanges. They use the optimizer's public attributes and composed objects (``flat``,
``verdict``, ``counters``, ``topology``, ``overlap``); the arithmetic around them is in
``_ops.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_onebit.comm import (
    CODED_BITS,
    NonFiniteError,
    average_bytes,
    fp32_allreduce_bytes,
    hierarchical_average,
    start_average,
)
from lightning_onebit.kernels import SignRuns, TensorSource, reads_sign_runs
from lightning_onebit.optim._coded_average import (
    CodedAverage,
    WindowVariance,
    check_coded,
    window_steps,
)
from lightning_onebit.optim._ops import SourceOf, all_finite_on_device, as_source

if TYPE_CHECKING:
    from lightning_onebit.optim._counters import CommCounters
    from lightning_onebit.optim._flat import FlatState
    from lightning_onebit.optim._overlap import BackwardOverlap
    from lightning_onebit.optim._rescale import VarianceRescale
    from lightning_onebit.optim._topology import Topology
    from lightning_onebit.optim._verdict import StepVerdict

__all__ = ["Averages"]


class Averages:
    """The averages of ``OneBitOptimizer``'s steps (see the module docstring): methods of the
    optimizer that its algorithms' ``_step`` call."""

    flat: FlatState
    param_groups: list[dict[str, Any]]
    counters: CommCounters
    topology: Topology
    verdict: StepVerdict
    overlap: BackwardOverlap | None
    rescale: VarianceRescale
    average_warmup_grads: bool
    average_dtype: torch.dtype
    coded_average: CodedAverage
    variance_window: float | int | None
    window_variance: WindowVariance
    switch_step: int
    caller_averaged: frozenset[int] | None
    step_count: int
    world_size: int
    process_group: Any

    def _averaged_grads(self) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """The step's gradients averaged over the ranks (in ``average_dtype``), one per parameter
        of the layout (``None``: zeros), and the average's verdict.

        Where this optimizer averages them (``average_warmup_grads``, ``W > 1``) they are the
        views of the flat gradient buffer: they are gathered there (with the overlap, bucket by
        bucket during backward) because the collective needs one contiguous buffer, and averaging
        the gradients in pieces of any other size would sum a value in another order at ``W >= 3``
        (a ring all-reduce's order depends on where the value lies in the buffer), so it would
        change the numbers. Otherwise (``W = 1``, or the caller, DDP, averaged them) each is read
        where autograd left it (``FlatState.grads``; on a GPU too, unless ``rescale_variance``
        takes their norms): no flat copy is made; the few the caller did not average
        (``caller_averaged``) are averaged here, in a buffer of their own for this step.

        The bytes of the average count in ``comm_stats`` either way: the algorithm needs them,
        whether this optimizer or DDP sends them.

        Returns:
            The gradients, and ``None`` or, with device verdicts (CUDA, see ``DEVICE_VERDICT``),
            whether every averaged value is finite as a bool tensor on the device (the same on
            every rank), for the step's update to take.

        Raises:
            NonFiniteError: (host verdicts) an averaged value is not finite, the same on every
                rank.
        """
        flat, w, nodes = self.flat, self.world_size, self.node_groups()
        layout, bits = flat.layout, self.coded_bits(self.step_count)
        check_coded(self.average_dtype, self.average_warmup_grads, nodes is not None)
        window = w > 1 and bits == 8 and CODED_BITS.get(self.average_dtype) == 4
        sent = None
        if w > 1 and bits is not None:  # in codes with error feedback, in the exchange's layout
            grads: list[torch.Tensor | None] = list(self.coded_inputs(self.step_count))
            # (with the overlap, the buckets backward started have theirs already)
            flat.gather_grads(self.param_groups, self.coded_average.unstarted, into=grads)
            sent = self.coded_average.average_()  # (NonFiniteError on every rank)
            checked: list[torch.Tensor | None] = grads
        elif w > 1 and self.average_warmup_grads:
            buf = flat.gather_grads(self.param_groups)
            if self.overlap is not None:
                self.overlap.all_reduce()  # per bucket, some started during backward
            elif nodes is not None:
                hierarchical_average(buf, self.average_dtype, nodes)
            else:
                start_average(buf, self.average_dtype, self.process_group)()
            grads = list(flat.views["grad"])
            checked = [buf]  # (one sweep of the whole buffer)
        else:
            idx = list(range(len(layout.params)))
            grads = flat.grads(self.param_groups, idx, on_gpu=not self.rescale.enabled)
            if w > 1:
                self._average_uncovered_(grads)
            checked = grads
        if sent is not None:
            ns = self.topology.node_size(w)
            self.counters.add(sent, self.coded_average.inter_node_bytes(ns))
        elif nodes is not None:
            intra, inter = average_bytes(layout.numel, self.average_dtype, nodes)
            self.counters.add(intra + inter, inter)
        elif bits is None:
            sent = fp32_allreduce_bytes(layout.numel, w) * self.average_dtype.itemsize // 4
            self.counters.add_ring(sent, w, self.topology.node_size(w))
        ok = None
        if self.verdict.uses_device(layout.device):  # averaged: the same verdict on every rank
            ok = all_finite_on_device(checked, layout.device)
            ok = self.verdict.hold_on_device(ok, ok, "average")
        elif not bool(all_finite_on_device(checked, layout.device)):
            raise NonFiniteError(
                f"the averaged gradient has non-finite values (NaN/Inf) at step {self.step_count}"
            )
        if window:
            betas2 = [self.param_groups[gi]["betas"][1] for gi in layout.group_of]
            self.window_variance.feed_(layout, betas2, grads, ok)
        return grads, ok

    def coded_bits(self, step: int) -> int | None:
        """The bits of step ``step``'s gradient average in integer codes (``None``: not in
        codes): ``average_dtype``'s, but 8 on the variance window's steps of an int4 one."""
        bits = CODED_BITS.get(self.average_dtype)
        return 8 if bits == 4 and self._in_variance_window(step) else bits

    def coded_inputs(self, step: int) -> list[torch.Tensor]:
        """Where step ``step``'s average in integer codes reads each parameter's gradient
        (``coded_average.inputs``, in ``coded_bits(step)``): with the overlap with backward,
        over its group, one exchange per bucket of its plan (backward starts them), else over
        ``process_group``, one exchange."""
        ov, bits = self.overlap, self.coded_bits(step)
        assert bits is not None, "not an average in integer codes"
        group = self.process_group if ov is None else ov.group()
        buckets = None if ov is None else ov.bucket_params
        return self.coded_average.inputs(self.flat.layout, group, bits, buckets)

    def _in_variance_window(self, step: int) -> bool:
        """Whether step ``step`` is one of the warmup's last ``variance_window`` steps before
        the built-in switch (``switch_step``)."""
        beta2 = max(group["betas"][1] for group in self.param_groups)  # the longest memory
        steps = window_steps(self.variance_window, self.switch_step, beta2)
        return steps > 0 and step > self.switch_step - steps

    def _average_uncovered_(self, grads: list[torch.Tensor | None]) -> None:
        """``average_warmup_grads=False``: the caller (DDP) averaged the gradients of the
        parameters it knows, ``caller_averaged``. DDP knows those that required grad when it
        was built; one made trainable later (e.g. the backbone that Lightning's
        ``BackboneFinetuning`` unfreezes mid-run) keeps its local gradient, and the ranks would
        drift apart silently (as they do under plain DDP). Those are averaged here, in one
        all_reduce of a buffer of their own; their entries of ``grads`` become its pieces (the
        parameters' ``.grad`` are left as they are)."""
        covered = self.caller_averaged
        if covered is None:
            return
        params = self.flat.layout.params
        idx = [j for j, p in enumerate(params) if id(p) not in covered]
        if not idx:
            return
        n = sum(params[j].numel() for j in idx)
        buf = torch.zeros(n, dtype=torch.float32, device=self.flat.layout.device)
        pieces = buf.split([params[j].numel() for j in idx])
        have = [
            (pieces[k], grads[j].reshape(-1)) for k, j in enumerate(idx) if grads[j] is not None
        ]
        if have:  # (none: every such gradient is missing, zeros on this rank)
            torch._foreach_copy_(*map(list, zip(*have, strict=True)))
        nodes = self.node_groups()
        if nodes is not None:
            hierarchical_average(buf, self.average_dtype, nodes)
        else:
            start_average(buf, self.average_dtype, self.process_group)()
        for k, j in enumerate(idx):
            grads[j] = pieces[k].view_as(params[j])

    def _compressed_average_into(
        self, source_of: SourceOf | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Error-compensated 1-bit average over the ranks into ``out`` (W = 1: compression only).

        ``source_of`` is the flat input (``out`` defaults to it: in place) or a function giving it
        (or a [kernels.ExchangeSource][lightning_onebit.kernels.ExchangeSource] of it) for a flat
        slice: called here for each range the exchange still needs (with
        ``overlap_with_backward``, the buckets not started during backward). Raises
        NonFiniteError on every rank, with ``out`` and the error buffers untouched, when any
        rank's input has a NaN/Inf; or, when the exchange keeps its verdict on the device (CUDA,
        see ``DEVICE_VERDICT``), returns it (a bool tensor): where it is false the error buffers
        are untouched and ``out`` is undefined, and the caller's update kernels must take it.
        ``None`` otherwise.
        """
        if out is None:
            if callable(source_of):
                raise TypeError("out is required when source_of is a function")
            out = source_of
        return self._exchange(source_of, out)[0]

    def _compressed_average(
        self, source_of: SourceOf | torch.Tensor, out: torch.Tensor | str
    ) -> tuple[torch.Tensor | None, torch.Tensor | SignRuns]:
        """``_compressed_average_into`` for an update kernel that reads
        [kernels.SignRuns][lightning_onebit.kernels.SignRuns]: returns ``(ok, x)``, ``x`` the
        average with each group's ``exp_avg_mask`` applied. Where the update kernels read the
        exchange's result where it lies (``kernels.reads_sign_runs``: the CPU with the compiled
        kernels, no mask, no verdict on the device) ``x`` is that (``out`` is not written: the
        kernel never writes the decoded values out and reads them back); otherwise ``out``,
        decoded. ``out`` may name a work buffer (``FlatState.work``), made only if the result is
        decoded into it."""
        ex = self.flat.exchange
        masked = any(g.get("exp_avg_mask") is not None for g in self.param_groups)
        if ex.returns_runs and not masked and not ex.device_verdict and reads_sign_runs(ex.device):
            return self._exchange(source_of, None)
        out = self.flat.work[out] if isinstance(out, str) else out
        ok, _ = self._exchange(source_of, out)
        self.flat.apply_mask_(self.param_groups, out)
        return ok, out

    def _exchange(
        self, source_of: SourceOf | torch.Tensor, out: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, SignRuns | None]:
        """The 1-bit average into ``out`` (``None``: its runs, undecoded), its bytes counted: the
        verdict and the runs. The inputs are computed here, one source per range the exchange still
        needs (values already computed as a
        [kernels.TensorSource][lightning_onebit.kernels.TensorSource]): the exchange calls nothing of
        the optimizer's."""
        ex = self.flat.exchange
        ranges = [slice(lo, hi) for lo, hi in ex.pending()]
        if callable(source_of):
            sources = [as_source(source_of(s)) for s in ranges]
        else:
            sources = [TensorSource(source_of.reshape(-1)[s]) for s in ranges]
        try:
            runs = ex.finish(sources, out)
        finally:
            ns = self.topology.node_size(self.world_size)
            self.counters.add(ex.bytes_sent, ex.inter_node_bytes(ns))
        return self.verdict.from_exchange(ex), runs
