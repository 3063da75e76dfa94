"""Names a package exports, imported on first use (PEP 562), so that importing the package stays light."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """``__getattr__`` and ``__dir__`` for ``package`` whose names are ``exports`` (name -> module, relative to
    ``package``): each imported on first use, then kept in the package's namespace."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(module, name, value)
        return value

    def __dir__():
        return sorted([*vars(module), *exports])

    return __getattr__, __dir__
