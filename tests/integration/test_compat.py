"""One test per private API of Lightning and torch that ``lightning_onebit/_compat.py`` lists,
and the public replacements of the ones it no longer needs: an upgrade that breaks one fails
here, by name."""

from __future__ import annotations

import sys
import warnings
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OneBitStrategy
from lightning_onebit._compat import (
    DDP_HOOKS_OVERRIDDEN,
    FABRIC_DDP_PRIVATE,
    IS_INTERACTIVE,
    MockOptimizer,
    ddp_kwargs,
    mark_step_for_lr_schedulers,
    process_group_backend,
    scaler_found_inf,
    set_backward_sync_control,
    stateful_state,
)
from lightning_onebit._integration.rank_files import (
    find_rank_state,
    rank_file_name,
    save_atomically,
)
from lightning_onebit._integration.scaler import synced_scaler


def test_is_interactive_is_lightnings_test_for_a_shell() -> None:
    assert IS_INTERACTIVE is (hasattr(sys, "ps1") or bool(sys.flags.interactive))


def test_configure_optimizers_returning_none_gives_the_mock_optimizer() -> None:
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    class NoOptimizer(L.LightningModule):
        def configure_optimizers(self) -> None:
            return None

    module = NoOptimizer()
    module.trainer = L.Trainer(logger=False)  # (configure_optimizers is called through it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "this fit will run with no optimizer"
        optimizers = _init_optimizers_and_lr_schedulers(module)[0]
    assert isinstance(optimizers[0], MockOptimizer)


class _Recording(OneBitStrategy):
    calls: ClassVar[list[str]] = []

    def _setup_model(self, model: torch.nn.Module) -> Any:
        _Recording.calls.append("_setup_model")
        return super()._setup_model(model)

    def _register_ddp_hooks(self) -> None:
        _Recording.calls.append("_register_ddp_hooks")
        super()._register_ddp_hooks()

    def _configure_launcher(self) -> None:
        _Recording.calls.append("_configure_launcher")
        super()._configure_launcher()


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_fabric_still_has_what_the_fabric_strategy_relies_on() -> None:
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    from lightning_onebit import OneBitFabricStrategy

    plain = FabricDDPStrategy()
    for name in FABRIC_DDP_PRIVATE:
        assert hasattr(plain, name), f"Fabric's DDPStrategy has no {name}"
    calls = []

    class Recording(OneBitFabricStrategy):
        def _configure_launcher(self) -> None:
            calls.append("_configure_launcher")
            super()._configure_launcher()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=Recording(start_method="fork"))
    assert calls == ["_configure_launcher"]
    assert type(fabric.strategy._backward_sync_control).__name__ == "PausingBackwardSyncControl"


def test_lightning_still_calls_the_ddp_hooks_we_override() -> None:
    for name in DDP_HOOKS_OVERRIDDEN:
        assert callable(getattr(DDPStrategy, name, None)), f"DDPStrategy has no {name}"
    _Recording.calls.clear()
    trainer = L.Trainer(
        strategy=_Recording(),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # devices=1, few batches
        trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    assert set(_Recording.calls) == set(DDP_HOOKS_OVERRIDDEN), _Recording.calls


def test_both_ddp_strategies_keep_ddps_kwargs_and_their_backend() -> None:
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    cpu = [torch.device("cpu")] * 2
    for cls in (DDPStrategy, FabricDDPStrategy):
        plain = cls(parallel_devices=cpu, find_unused_parameters=True, bucket_cap_mb=5)
        assert ddp_kwargs(plain) == {"find_unused_parameters": True, "bucket_cap_mb": 5}, cls
        assert process_group_backend(plain) == "gloo", cls  # (before any group starts)
        assert plain.process_group_backend is None, cls  # (why the public one does not do)
        chosen = cls(parallel_devices=cpu, process_group_backend="mpi")
        assert process_group_backend(chosen) == "mpi", cls


def test_fabric_saves_a_stateful_objects_state_dict() -> None:
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    module = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(module.parameters())
    state = {"model": module, "optimizer": opt, "step": 3}
    converted = stateful_state(FabricDDPStrategy(), state, None)
    assert converted["step"] == 3 and set(converted) == {"model", "optimizer", "step"}
    assert converted["model"].keys() == module.state_dict().keys()
    assert converted["optimizer"] == opt.state_dict()
    only_bias = {"model": lambda key, _: key == "bias"}
    assert list(stateful_state(FabricDDPStrategy(), state, only_bias)["model"]) == ["bias"]


def test_fabric_no_backward_sync_uses_the_control_set() -> None:
    import inspect

    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    from lightning_onebit._compat import DDPBackwardSyncControl

    strategy = FabricDDPStrategy()
    control = DDPBackwardSyncControl()
    set_backward_sync_control(strategy, control)
    assert strategy._backward_sync_control is control
    # (what fabric.no_backward_sync asks; running it needs launched processes)
    assert "_strategy._backward_sync_control" in inspect.getsource(L.Fabric.no_backward_sync)


def test_scaler_found_inf_is_what_step_reads() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for grad, want in ((torch.tensor([1.0, float("inf"), 0.0]), 1.0), (torch.ones(3), 0.0)):
        scaler = torch.amp.GradScaler(device="cpu")
        p.grad = scaler.scale(grad)
        scaler.unscale_(opt)
        flags = scaler_found_inf(scaler, opt)
        assert [f.item() for f in flags] == [want]
        before = p.detach().clone()
        scaler.step(opt)  # skips exactly when the flags say so
        assert torch.equal(p.detach(), before) == (want == 1.0)


def test_the_synced_scaler_keeps_the_scalers_settings_and_scale() -> None:
    scaler = torch.amp.GradScaler(
        device="cpu", init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=7
    )
    fresh = synced_scaler(scaler, "cpu")
    assert fresh.get_scale() == 2.0**10 and fresh.get_growth_factor() == 3.0
    assert fresh.get_backoff_factor() == 0.25 and fresh.get_growth_interval() == 7
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.full((2,), float("inf"))
    scaler.scale(torch.ones(()))  # (initialises the scale tensor)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()  # backs off: 2**10 * 0.25
    used = synced_scaler(scaler, "cpu")
    assert used.get_scale() == 2.0**8 and used.is_enabled()
    assert not synced_scaler(torch.amp.GradScaler(device="cpu", enabled=False), "cpu").is_enabled()


def test_a_repointed_scheduler_sees_the_new_optimizers_steps() -> None:
    p = torch.nn.Parameter(torch.ones(1))
    for mark in (False, True):
        scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.Adam([p]), step_size=1)
        new = torch.optim.Adam([p])
        scheduler.optimizer = new
        if mark:
            mark_step_for_lr_schedulers(new)
            mark_step_for_lr_schedulers(new)  # a second call must not wrap twice
        p.grad = torch.ones(1)
        new.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()
        said = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
        assert bool(said) is not mark, said


def test_rank_files_on_a_remote_filesystem_round_trip() -> None:
    """The fsspec path of ``save_atomically`` (a transaction) and of the loader (fs.open)."""
    path = "memory://onebit-compat/epoch=0.ckpt"
    state = _rank_state(5, 1, 2, {"x": torch.arange(4.0)})
    save_atomically(state, rank_file_name(path, 1, 2))
    found, looked = find_rank_state(path, {"global_step": 5}, rank=1, world_size=2)
    assert looked == [] and torch.equal(found["optimizer"]["x"], torch.arange(4.0))
    missing, looked = find_rank_state(path, {"global_step": 5}, rank=0, world_size=2)
    assert missing is None and looked == [rank_file_name(path, 0, 2)]


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_rank_files_on_local_paths_round_trip(tmp_path: Any, prefix: str) -> None:
    path = f"{prefix}{tmp_path}/last.ckpt"
    save_atomically(_rank_state(3, 0, 1, {}), rank_file_name(path, 0, 1))
    assert (tmp_path / "last.ckpt.onebit-rank0-of-1").is_file()
    found = find_rank_state(path, {"global_step": 3}, rank=0, world_size=1)[0]
    assert found == _rank_state(3, 0, 1, {})


def _rank_state(step: int, rank: int, world_size: int, optimizer: dict) -> dict:
    """A rank file's content, as ``write_rank_file`` lays it out."""
    return {
        "world_size": world_size,
        "rank": rank,
        "global_step": step,
        "optimizer": optimizer,
        "model": None,
    }
