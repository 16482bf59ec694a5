"""The package's structure (``scripts/layers.py`` reads it): no import cycles between its
modules, at module level or inside functions; every module imports only its own layer and the
ones below it (kernels, exchange, optimizers, integration, tools); no module takes an
underscore name from another (``_compat`` excepted: other libraries' private APIs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "layers.py"
_spec = importlib.util.spec_from_file_location("layers", SCRIPT)
assert _spec and _spec.loader
layers = importlib.util.module_from_spec(_spec)
sys.modules["layers"] = layers
_spec.loader.exec_module(layers)


def test_the_graph_sees_the_package_and_function_level_imports() -> None:
    g = layers.graph()
    assert "lightning_onebit.optim.zero_one_adam" in g and "lightning_onebit.comm.flat" in g
    # (comm.flat imports the kernels at module level; the strategy reaches the optimizers)
    assert "lightning_onebit.kernels" in g["lightning_onebit.comm.flat"]
    assert "lightning_onebit.optim" in g["lightning_onebit.strategy"]


def test_no_import_cycles() -> None:
    assert layers.cycles(layers.graph()) == []


def test_a_cycle_is_found_where_there_is_one() -> None:
    g = {"a": {"b": set()}, "b": {"c": set()}, "c": {"a": {"x"}}}
    assert layers.cycles(g) == [["a", "b", "c", "a"]]


def test_every_module_imports_only_its_layer_and_the_ones_below() -> None:
    assert layers.layer_violations(layers.graph()) == []
    upward = {"lightning_onebit.kernels.updates": {"lightning_onebit.optim._base": set()}}
    assert layers.layer_violations(upward) == [
        "lightning_onebit.kernels.updates (kernels) -> lightning_onebit.optim._base (optimizers)"
    ]


def test_no_underscore_name_is_imported_across_modules() -> None:
    assert layers.private_imports(layers.graph()) == []
    g = {"lightning_onebit.strategy": {"lightning_onebit.hook": {"_build", "build"}}}
    assert layers.private_imports(g) == ["lightning_onebit.strategy: lightning_onebit.hook._build"]
    assert layers.private_imports({"m": {layers.COMPAT: {"_private_api"}}}) == []


#: the largest a module may grow (lines), and the tighter limits of the classes a reader starts from
MODULE_LINES = 600
TIGHTER = {"optim/_base.py": 460, "strategy.py": 400, "fabric.py": 400}


def test_every_module_stays_readable_in_one_sitting() -> None:
    package = SCRIPT.parents[1] / "lightning_onebit"
    sizes = {
        p.relative_to(package).as_posix(): len(p.read_text().splitlines())
        for p in package.rglob("*.py")
    }
    assert set(TIGHTER) <= set(sizes)
    over = {name: n for name, n in sizes.items() if n > TIGHTER.get(name, MODULE_LINES)}
    assert over == {}, f"split these modules (lines): {over}"
