"""What the Trainer strategy and the Fabric strategy do the same way: ``OneBitStrategyBase``,
first in the bases of [OneBitStrategy][lightning_onebit.OneBitStrategy] and
[OneBitFabricStrategy][lightning_onebit.OneBitFabricStrategy] (before Lightning's
``DDPStrategy`` of their kind), and ``takes_options``, which gives each strategy's ``__init__``
its signature and its docstring the options' ``Args``, both from the one declaration of the
options (``StrategyOptions``; why generated: see ``lightning_onebit._integration.options``).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import Self

from lightning_onebit._compat import (
    IS_INTERACTIVE,
    LauncherCheck,
    ddp_kwargs,
    process_group_backend,
)
from lightning_onebit._integration import lifecycle
from lightning_onebit._integration.errors import quiet_errors_on_this_rank
from lightning_onebit._integration.front_end import FrontEnd
from lightning_onebit._integration.hook import HookState, wrap_in_ddp
from lightning_onebit._integration.optimizer import OptimizerBuilder
from lightning_onebit._integration.options import StrategyOptions
from lightning_onebit._integration.rank_files import RankCheckpoint
from lightning_onebit._integration.registry import register_names
from lightning_onebit.optim import OneBitOptimizer

__all__ = ["OneBitStrategyBase", "takes_options"]

_Strategy = TypeVar("_Strategy", bound=type)

_OPTION_TYPES = typing.get_type_hints(StrategyOptions)
#: the arguments both strategies take before their own: the options, then the DeepSpeed config
_SHARED = (
    *(
        inspect.Parameter(
            f.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=f.default,
            annotation=_OPTION_TYPES[f.name],
        )
        for f in dataclasses.fields(StrategyOptions)
    ),
    inspect.Parameter(
        "deepspeed_config",
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=None,
        annotation=str | Path | dict[str, Any] | None,
    ),
)


class OneBitStrategyBase(LauncherCheck):
    """Data-parallel training with 1-bit Adam, 0/1 Adam or 1-bit LAMB: what both strategies do
    the same way (options, DeepSpeed configs, registered names, the processes' setup and
    teardown, DDP with our hook). Each strategy sets the class attributes below and lists its
    own arguments in its ``__init__`` (see ``takes_options``).

    Args:
        deepspeed_config: a DeepSpeed JSON config (path or dict): see ``from_deepspeed_config``.
        **kwargs: passed to Lightning's ``DDPStrategy`` and on to ``DistributedDataParallel``
            (e.g. ``find_unused_parameters``, ``bucket_cap_mb``).

    Attributes:
        front_end: how the user of this strategy does what a message asks.
        user_error: the exception type of the user's mistakes found while setting up the
            optimizer (the Trainer's ``MisconfigurationException``, Fabric's ``ValueError``).
        launcher_error: the exception type of a script launcher in an interactive session.
        options: the options, validated (a DeepSpeed config merged in).
        builder: makes the 1-bit optimizer from the user's.
    """

    front_end: ClassVar[FrontEnd]
    user_error: ClassVar[type[Exception]]
    launcher_error: ClassVar[type[Exception]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        lifecycle.check_ddp_kwargs(kwargs)
        given = _take_shared(args, kwargs)  # what is left in kwargs is DDP's
        config = given.pop("deepspeed_config", None)
        options, hparams, note = StrategyOptions(**given).with_deepspeed_config(
            config, self.front_end
        )
        # LightningCLI follows **kwargs from here to DDPStrategy's own arguments
        super().__init__(timeout=options.timeout, start_method=options.start_method, **kwargs)
        self.options = options
        self.builder = OptimizerBuilder(options, type(self).__name__, self.user_error, hparams)
        self._hook_state: HookState | None = None
        self._rank_checkpoint = RankCheckpoint(self)  # type: ignore[arg-type]
        if note:
            rank_zero_warn(note, category=UserWarning)

    @classmethod
    def from_deepspeed_config(cls, config: str | Path | dict[str, Any], **overrides: Any) -> Self:
        """The strategy a DeepSpeed JSON config of ``OneBitAdam``/``ZeroOneAdam``/``OneBitLamb``
        describes (a path or a dict): the ``"optimizer"`` section's type picks the algorithm,
        its params map to the options of the same name (``var_freeze_step`` to ``freeze_step``),
        and its ``lr``/``betas``/``eps``/``weight_decay`` build the optimizer when the Trainer's
        ``configure_optimizers`` returns none. A torch Adam/AdamW from ``configure_optimizers``
        or given to ``fabric.setup`` is converted as usual, and its own hyperparameters win
        (with Fabric, a warning names those that differ from the config's). The optimizer
        computes with DeepSpeed's arithmetic (``deepspeed_compatible=True``, unless given as
        ``False``). ``cuda_aware``, ``comm_backend_name`` and the other keys with no effect here
        are named in one warning; unknown optimizer parameters raise. ``overrides`` are further
        arguments of the strategy (``start_method="fork"``, ...); one the config also sets wins
        over the config (and is named in the warning). The same as the constructor's
        ``deepspeed_config=config`` (LightningCLI: ``init_args: {deepspeed_config:
        ds_config.json}``).
        """
        return cls(deepspeed_config=config, **overrides)

    @property
    def algorithm(self) -> str:
        """``"onebit_adam"``, ``"zero_one_adam"`` or ``"onebit_lamb"``."""
        return self.options.algorithm

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy under every algorithm's names in Lightning's
        ``strategy_registry`` (the Trainer's or Fabric's)."""
        register_names(cls, strategy_registry)

    # ------------------------------------------------------------------ processes

    def check_launcher(self) -> None:
        """Refuse a launcher that re-runs the script in an interactive session, naming the
        ``*_notebook`` strategy to use (called once Lightning has built the launcher)."""
        launcher = self.launcher  # type: ignore[attr-defined]
        if IS_INTERACTIVE and launcher is not None and not launcher.is_interactive_compatible:
            raise self.launcher_error(
                lifecycle.notebook_message(self.algorithm, type(self).__name__)
            )

    def setup_environment(self) -> None:
        """Start this rank's process group (Lightning's ``DDPStrategy.setup_environment``), on
        torchrun's store under a prefix per restart attempt; one traceback instead of one per
        rank from here on."""
        n, nodes = self.num_processes, self.num_nodes  # type: ignore[attr-defined]
        rank: int = self.global_rank  # type: ignore[attr-defined]
        o = self.options
        with lifecycle.process_setup(o.start_method, n, nodes, self.front_end):
            lifecycle.init_default_group_per_attempt(
                process_group_backend(self), rank, nodes * n, o.timeout,
                self.root_device,  # type: ignore[attr-defined]
            )  # fmt: skip
            super().setup_environment()  # type: ignore[misc]  # starts the group unless started above
        quiet_errors_on_this_rank(rank)

    def teardown(self) -> None:
        """Stop what the strategy and its optimizer started (the overlap's threads and groups,
        the hook's thread), then Lightning's teardown."""
        with lifecycle.teardown_steps(self._onebit_optimizers(), self._hook_state):
            super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------ model, optimizer

    def wrap_module(self, module: Module) -> DistributedDataParallel:
        """``module`` in DDP on the current stream (Lightning's ``DDPStrategy`` builds it on a
        side stream: see ``hook.build_ddp``), with our comm hook registered on every device."""
        device = self.root_device  # type: ignore[attr-defined]
        device_ids = None if device.type == "cpu" else [device.index]
        ddp, self._hook_state = wrap_in_ddp(module, device_ids, ddp_kwargs(self))
        return ddp

    def _onebit_optimizers(self) -> list[OneBitOptimizer]:
        """The strategy's 1-bit optimizer (none before it is set up): each strategy's own."""
        raise NotImplementedError

    @property
    def onebit_optimizer(self) -> OneBitOptimizer:
        """The 1-bit optimizer being trained with (after setup)."""
        found = self._onebit_optimizers()
        if len(found) != 1:
            raise RuntimeError(
                f"{type(self).__name__} has no optimizer yet (it exists after "
                f"{self.front_end.setup})"
            )
        return found[0]


def takes_options(cls: _Strategy) -> _Strategy:
    """``cls`` (a strategy) with the options in its ``__init__``'s signature and docstring.

    ``cls.__init__`` takes ``(self, *args, <its own keyword-only arguments>, **kwargs)`` and
    passes ``*args`` and ``**kwargs`` on to ``OneBitStrategyBase.__init__``. Its signature
    becomes ``(self, <the options>, deepspeed_config, <its own>, **kwargs)``, each option with
    its type and default, which ``inspect.signature``, ``help()`` and jsonargparse read; the
    ``Args`` of ``cls``'s docstring begin with the options' entries and ``OneBitStrategyBase``'s.
    """
    init = cls.__dict__["__init__"]
    own = inspect.signature(init)
    hints = typing.get_type_hints(init)
    self_param, *rest = (
        p.replace(annotation=hints.get(p.name, p.annotation)) for p in own.parameters.values()
    )
    keyword_only = [p for p in rest if p.kind is inspect.Parameter.KEYWORD_ONLY]
    var_keyword = [p for p in rest if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [self_param, *_SHARED, *keyword_only, *var_keyword]
    init.__signature__ = own.replace(parameters=params, return_annotation=None)
    # in the signature's order: the options, deepspeed_config, the class's own, **kwargs
    base = _args_entries(OneBitStrategyBase.__doc__)
    at = next(i for i, line in enumerate(base) if line.startswith("    **kwargs:"))
    first = _args_entries(StrategyOptions.__doc__) + base[:at]
    cls.__doc__ = _with_args(cls.__doc__ or "", first, base[at:])
    return cls


def _take_shared(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options and the DeepSpeed config given, by position (``args``) or by name (taken out
    of ``kwargs``), as ``inspect.Signature.bind`` would bind them."""
    names = [p.name for p in _SHARED]
    if len(args) > len(names):
        raise TypeError(f"takes {len(names)} positional arguments but {len(args)} were given")
    given = dict(zip(names, args, strict=False))
    for name in names:
        if name in kwargs:
            if name in given:
                raise TypeError(f"got multiple values for argument {name!r}")
            given[name] = kwargs.pop(name)
    return given


def _args_entries(doc: str | None) -> list[str]:
    """The lines of the ``Args:`` section of a Google-style docstring, indented as in it."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Args:" not in lines:
        return []
    entries = []
    for line in lines[lines.index("Args:") + 1 :]:
        if line and not line.startswith(" "):
            break
        entries.append(line)
    while entries and not entries[-1].strip():
        entries.pop()
    return entries


def _with_args(doc: str, first: list[str], last: list[str]) -> str:
    """``doc`` with ``first`` at the start of its ``Args:`` section and ``last`` at its end (the
    section added where it has none)."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Args:" not in lines:
        lines += ["", "Args:"]
    start = lines.index("Args:") + 1
    own = _args_entries("\n".join(lines))
    end = start + len(own)
    return "\n".join(lines[:start] + first + own + last + lines[end:])
