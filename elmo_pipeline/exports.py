"""A package's exported names, each imported from its module when first used (PEP 562), so that
importing the package, or one light module in it, does not import torch: `elmo-pipeline --help`
is built without it."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, for its names `homes` maps to their modules.

    Any other name but a dunder imports every home first, as importing the package did before its
    names were lazy: the submodules that loaded on the way were the package's attributes
    (`import elmo_pipeline` then `elmo_pipeline.model.scalar_mix.load_mix_specs`), and they still are."""

    def __getattr__(name: str) -> Any:
        module = sys.modules[package]
        home = homes.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home), name)
            setattr(module, name, value)  # found at once from now on
            return value
        if not (name.startswith("__") and name.endswith("__")):  # probes such as __wrapped__ load nothing
            for each in dict.fromkeys(homes.values()):
                importlib.import_module(each)
            if name in vars(module):
                return vars(module)[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
