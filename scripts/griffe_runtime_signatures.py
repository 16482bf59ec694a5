"""A griffe extension for the API reference (``mkdocs.yml``): a class whose ``__init__``
signature and docstring are made when the class is defined (the strategies:
``lightning_onebit._integration.strategy_base.takes_options``) is documented with the ones it
has at runtime, not with its source's ``*args, **kwargs``. Every other object keeps what
griffe's static analysis found (dynamic analysis of the whole package loses comments and fails
on some of it)."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

#: a dotted name's module part (``datetime.timedelta`` -> ``timedelta``), as the source writes it
_QUALIFIED = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*)")


def _short(text: str) -> str:
    return _QUALIFIED.sub("", text)


class RuntimeSignatures(griffe.Extension):
    """The runtime ``__init__`` signature and docstring of a class whose ``__init__`` carries a
    ``__signature__`` of its own."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        init = cls.members.get("__init__")
        if init is None or init.is_alias:
            return
        try:
            obj = getattr(importlib.import_module(cls.module.path), cls.name)
        except (ImportError, AttributeError):
            return
        runtime = vars(obj).get("__init__")
        if runtime is None or "__signature__" not in vars(runtime):
            return
        init.parameters = griffe.Parameters(
            *(
                griffe.Parameter(
                    p.name,
                    annotation=None
                    if p.annotation is p.empty
                    else _short(inspect.formatannotation(p.annotation)),
                    kind=griffe.ParameterKind(p.kind.description),
                    default=None if p.default is p.empty else _short(repr(p.default)),
                )
                for p in inspect.signature(runtime).parameters.values()
            )
        )
        old = cls.docstring
        cls.docstring = griffe.Docstring(
            inspect.cleandoc(obj.__doc__),
            lineno=old.lineno if old else None,
            endlineno=old.endlineno if old else None,
            parent=cls,
            parser=old.parser if old else None,
            parser_options=old.parser_options if old else None,
        )
