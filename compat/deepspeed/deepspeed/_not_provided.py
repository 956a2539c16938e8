"""Names of DeepSpeed 0.19.8's layout whose feature dscore does not have: importable, refused when used.

:func:`not_provided` makes a class standing for such a name. ``from deepspeed.x import Name`` works (so one
missing feature does not take a whole module, or a test file, down); calling it, instantiating it or reading
any attribute of it raises :class:`dscore.errors.DscoreError` saying what is not provided and what dscore
offers instead. Subclassing it at import time works too; instantiating the subclass raises the same error.
"""

from __future__ import annotations

from typing import Any, NoReturn

from dscore.errors import DscoreError

__all__ = ["NotProvidedError", "not_provided", "refused_module_getattr", "zero_optimizer_class"]


class NotProvidedError(DscoreError, NotImplementedError):
    """A DeepSpeed 0.19.8 name was used whose feature dscore does not provide (the message says which and
    what to use instead)."""


class _NotProvidedMeta(type):
    _ds_message: str

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotProvidedError(cls._ds_message)

    def __getattr__(cls, attr: str) -> NoReturn:
        if attr.startswith("__") and attr.endswith("__"):  # introspection (copy, pickle, doc tools)
            raise AttributeError(attr)
        raise NotProvidedError(f"{cls._ds_message} (attribute {attr!r} read)")

    def __repr__(cls) -> str:
        return f"<not provided by dscore: {cls.__qualname__}>"


def not_provided(qualname: str, reason: str) -> Any:
    """A stand-in for DeepSpeed 0.19.8's ``qualname`` (``"deepspeed.ops.op_builder.InferenceBuilder"``).

    Args:
        qualname: the full dotted DeepSpeed name, quoted in the error.
        reason: why dscore does not provide it and what to use instead (one sentence).

    Returns:
        A class: using it in any way (call, instantiate, read an attribute) raises
        :class:`NotProvidedError` with ``"<qualname> (DeepSpeed 0.19.8) is not provided by dscore: <reason>"``.
    """
    module, _, name = qualname.rpartition(".")
    message = f"{qualname} (DeepSpeed 0.19.8) is not provided by dscore: {reason}"
    return _NotProvidedMeta(name, (), {"__module__": module, "__qualname__": name, "_ds_message": message,
                                       "__doc__": message})


class _ZeroOptimizerMeta(_NotProvidedMeta):
    _ds_zero_stages: tuple[int, ...]

    def __instancecheck__(cls, obj: Any) -> bool:
        # the optimizer a dscore engine returns carries the engine's bound state methods (weakly held): it
        # is "DeepSpeed's ZeRO optimizer" of that stage when that live engine's stage steps it (not ZeRO-3's
        # parameter manager, which engine.optimizer returns without an optimizer: DeepSpeed's ZeRoOffload)
        from dscore.runtime.offload_states import OPTIMIZER_STATE_METHODS, OptimizerStateMethod

        attrs = getattr(obj, "__dict__", None) or {}
        for name in OPTIMIZER_STATE_METHODS:
            method = attrs.get(name)
            if isinstance(method, OptimizerStateMethod):
                engine = method.engine
                return (
                    engine is not None
                    and engine.optimizer is obj
                    and getattr(engine.zero_stage_impl, "optimizer", None) is obj
                    and engine.zero_optimization_stage() in cls._ds_zero_stages
                )
        return False


def zero_optimizer_class(qualname: str, stages: tuple[int, ...], reason: str) -> Any:
    """A :func:`not_provided` stand-in for one of DeepSpeed's ZeRO optimizer classes
    (``DeepSpeedZeroOptimizer``: ``stages`` (1, 2); ``DeepSpeedZeroOptimizer_Stage3``: (3,)) that
    ``isinstance`` answers: True for ``engine.optimizer`` of a live dscore engine at one of ``stages`` (the
    torch optimizer dscore's stage steps), False for anything else. Constructing it or reading its
    attributes raises :class:`NotProvidedError` with ``reason``."""
    module, _, name = qualname.rpartition(".")
    message = f"{qualname} (DeepSpeed 0.19.8) is not provided by dscore: {reason}"
    return _ZeroOptimizerMeta(name, (), {"__module__": module, "__qualname__": name, "_ds_message": message,
                                         "__doc__": message, "_ds_zero_stages": tuple(stages)})


def refused_module_getattr(module_name: str, reason: str) -> Any:
    """A module-level ``__getattr__`` for a module of DeepSpeed 0.19.8 whose whole feature dscore does not
    have: each public name read from it is a :func:`not_provided` stand-in (kept in the module; a package's
    submodules are imported as usual), so
    ``from module import name`` works and using ``name`` raises :class:`NotProvidedError` with ``reason``."""
    import importlib
    import importlib.util
    import sys

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        module = sys.modules[module_name]
        if hasattr(module, "__path__") and importlib.util.find_spec(f"{module_name}.{attr}") is not None:
            return importlib.import_module(f"{module_name}.{attr}")  # a submodule (`from pkg import mod`)
        value = not_provided(f"{module_name}.{attr}", reason)
        setattr(module, attr, value)
        return value

    return __getattr__
