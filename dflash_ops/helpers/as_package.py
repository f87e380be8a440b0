"""How a helper imports the modules shipped beside it: `from . import nodefacts`, the one way, on both
sides (stdlib only, python3.8+). Not a helper: it is never run.

On the operator's side a helper is the module dflash_ops.helpers.NAME, and `from . import m` imports
its sibling (contract and destination: the trainer's own modules, dflash_ops/helpers/__init__.py).
In a container it runs as a script, BASE/helpers/<hash>/NAME.py, its shared modules beside it, and
has no package until `enter` makes that directory one. A helper run as a script begins

    if not __package__:  # run as a script: its directory becomes its package (as_package.py)
        import as_package
        as_package.enter(globals())
    from . import nodefacts

(`import as_package` finds this file beside the script: a script's directory is sys.path[0].) The
shared modules it imports are never run, so they need only the `from . import` line.
"""

import importlib
import importlib.machinery
import os
import sys
import types

PACKAGE = "dflash_helpers"  # a helper bundle's directory, as a package


def enter(script: dict) -> None:
    """Give the running script (its globals) a package, its own directory: afterwards `from . import m`
    imports m.py beside it. Run in place from dflash_ops/helpers/ (Container.helpers_in_place: this
    machine is the container), the package is dflash_ops.helpers itself."""
    path = os.path.abspath(script["__file__"])
    here = os.path.dirname(path)
    if os.path.isfile(os.path.join(here, "__init__.py")):  # in place: the operator's own package
        sys.path.insert(1, os.path.dirname(os.path.dirname(here)))  # the dflash_ops this file is part of
        # dflash_ops.helpers without running its __init__, the operator's bundling code (dataclasses,
        # pathlib, hashlib...: ~35 ms of imports a helper never uses, on every run in place): its
        # __getattr__ is what a helper needs of it, `from . import contract` (and destination)
        name = "dflash_ops.helpers"
        package = _package(name, here)
        if package is not None:
            vars(package)["__getattr__"] = _trainer_module  # PEP 562, as in __init__
    else:
        name = PACKAGE
        _package(name, here)
    script["__package__"] = name  # what `from . import` resolves against (and, from 3.15 on, __spec__)
    script["__spec__"] = importlib.machinery.ModuleSpec(
        f"{name}.{os.path.splitext(os.path.basename(path))[0]}", None, origin=path)


def _package(name: str, here: str) -> "types.ModuleType | None":
    """The package `name` whose submodules are found in `here`, made unless it is imported already (then None)."""
    if name in sys.modules:
        return None
    package = types.ModuleType(name)
    package.__path__ = [here]  # type: ignore[attr-defined]  # a package: its submodules are found here
    sys.modules[name] = package
    return package


def _trainer_module(name: str) -> types.ModuleType:
    """`from . import contract` (or destination) in a helper run in place: the trainer's module of that
    name, its one copy (dflash_ops/helpers/__init__.py's __getattr__ gives the operator's side the same)."""
    if name in ("contract", "destination"):
        return importlib.import_module("trainer.run." + name)
    raise AttributeError("module 'dflash_ops.helpers' has no attribute %r" % name)
