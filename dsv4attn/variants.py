"""Which kernel runs each pass of each op within the Triton backend: the one place for the Gluon-or-Triton choice.

Every op registers, per pass, its implementations in preference order (:func:`register`), each with a predicate
``usable(*args) -> (bool, reason)``. :func:`choose` takes the first usable one under the mode:

- ``"auto"`` (default): the first usable implementation (the SM90 Gluon kernels where they apply, else Triton);
- ``"triton"``: the Triton kernels only (every Gluon kernel stays out);
- ``"gluon"``: as "auto", but a Gluon kernel that cannot be built raises instead of falling back (a config's
  ``KERNEL="gluon"`` also raises where the kernel does not apply).

The mode comes from ``DSV4ATTN_KERNELS`` (``DSV4ATTN_FORWARD_KERNEL`` is its deprecated alias) or
:func:`set_kernels`; a caller may request one implementation for one call (a config's ``KERNEL`` key). The
deterministic backward is a form of the same kernels (Gluon on SM90, else the Triton passes), not an entry of its
own. A Gluon kernel that this Triton cannot build is recorded in :data:`FAILED` (warned once): "auto" then takes
the next implementation for that (op, pass, key).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

MODES = ("auto", "triton", "gluon")
ENV = "DSV4ATTN_KERNELS"
DEPRECATED_ENV = "DSV4ATTN_FORWARD_KERNEL"


def _mode_from_env() -> str:
    value = os.environ.get(ENV)
    if value is None and os.environ.get(DEPRECATED_ENV) is not None:
        warnings.warn(f"{DEPRECATED_ENV} is deprecated: use {ENV} (it chooses every kernel, not only the forward)",
                      DeprecationWarning, stacklevel=2)
        value = os.environ[DEPRECATED_ENV]
    return value or "auto"


_mode = _mode_from_env()             # validated where it is read, so a bad value names itself at the first call


def set_kernels(mode: str | None) -> None:
    """``"auto"`` (or None), ``"triton"`` or ``"gluon"`` for every op from now on (see the module docstring)."""
    global _mode
    mode = mode or "auto"
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    _mode = mode


def kernels_mode() -> str:
    if _mode not in MODES:
        raise ValueError(f"{ENV} (or {DEPRECATED_ENV}) must be one of {MODES}, got {_mode!r}")
    return _mode


@dataclass(frozen=True)
class Variant:
    """One implementation of a pass. ``name``: "gluon" or "triton"; ``kernel``: what it computes and its function,
    for messages; ``usable(*args)``: (bool, reason) for one call's arguments; ``on_device(device)``: the same for a
    device alone (``python -m dsv4attn.env``)."""
    name: str
    kernel: str
    usable: Callable[..., tuple[bool, str]]
    on_device: Callable[..., tuple[bool, str]]


def always(*_args) -> tuple[bool, str]:
    return True, ""


# (op, pass) -> its variants in preference order.
PASSES: dict[tuple[str, str], tuple[Variant, ...]] = {}
# (op, pass, key) -> why the Gluon kernel could not be built for ``key`` (shape / dtype) in this process.
FAILED: dict[tuple, str] = {}


def register(op: str, pass_: str, *variants: Variant) -> None:
    PASSES[(op, pass_)] = tuple(variants)


def _reasons(op: str, pass_: str, key, args) -> list[tuple[Variant, bool, str]]:
    out = []
    for v in PASSES[(op, pass_)]:
        if (op, pass_, key) in FAILED and v.name == "gluon":
            out.append((v, False, f"failed to build here ({FAILED[(op, pass_, key)][:200]})"))
        else:
            out.append((v, *v.usable(*args)))
    return out


def choose(op: str, pass_: str, key, *args, request: str | None = None) -> str:
    """The implementation of ``op``'s ``pass_`` for one call. ``request`` (a config's ``KERNEL``; None: the global
    mode): "gluon" runs the Gluon kernel or raises saying why it cannot, "triton" the Triton one, "auto" the first
    usable variant; the global mode "gluon" chooses as "auto" does (a build failure then raises: :func:`strict`).
    ``key`` is the (D, dtype) key of :data:`FAILED`; ``args`` go to the predicates."""
    if request is not None and request not in MODES:
        raise ValueError(f"{op} {pass_}: KERNEL must be 'auto', 'gluon' or 'triton', got {request!r}")
    mode = kernels_mode() if request in (None, "auto") else request      # "auto" never overrides the global mode
    reasons = _reasons(op, pass_, key, args)
    if request == "gluon":
        found = [v for v in PASSES[(op, pass_)] if v.name == "gluon"]
        if not found:
            raise ValueError(f"{op} {pass_}: KERNEL='gluon' asked for, but this pass has no Gluon kernel")
        v = found[0]
        usable, reason = v.usable(*args)          # an explicit request tries again after a build failure
        if not usable:
            raise ValueError(f"{op} {pass_}: KERNEL='gluon' asked for the Gluon {v.kernel}, which cannot run here: "
                             f"{reason}")
        return "gluon"
    for v, usable, _ in reasons:
        if usable and not (mode == "triton" and v.name == "gluon"):
            return v.name
    raise RuntimeError(f"{op} {pass_}: no implementation applies")      # the Triton variants always apply


def strict(request: str | None = None) -> bool:
    """Whether a Gluon build failure raises instead of falling back: "gluon" asked for (per call or globally)."""
    return (kernels_mode() if request in (None, "auto") else request) == "gluon"


def mode_index(request: str) -> int:
    """A config's ``KERNEL`` as an int, for custom-op schemas that take ints only (:data:`MODES` order)."""
    if request not in MODES:
        raise ValueError(f"KERNEL must be 'auto', 'gluon' or 'triton', got {request!r}")
    return MODES.index(request)


def explain(op: str, pass_: str, device) -> list[tuple[str, bool, str]]:
    """(name, usable, reason) of each variant of ``op``'s ``pass_`` on ``device`` under the current mode."""
    mode = kernels_mode()
    out = []
    for v in PASSES[(op, pass_)]:
        usable, reason = v.on_device(device)
        if usable and mode == "triton" and v.name == "gluon":
            usable, reason = False, f"{ENV}=triton"
        out.append((v.name, usable, reason))
    return out


def gluon_build_error(exc: Exception) -> bool:
    """Errors that mean "this Triton cannot build the Gluon kernel" (compile, ptxas, resources, MLIR passes)."""
    from triton.runtime.errors import TritonError
    return isinstance(exc, TritonError) or (isinstance(exc, RuntimeError) and "PassManager" in str(exc))


def note_gluon_build_failure(exc: Exception, op: str, pass_: str, key, instead: str) -> None:
    """Called from an ``except`` around a Gluon launch: re-raises ``exc`` unless it is a build failure; otherwise
    records it in :data:`FAILED` (so that "auto" does not try again) and warns once, naming the kernel and the
    installed Triton. Gluon is experimental and changes between Triton releases: a Triton that cannot build a
    kernel gets the Triton path instead."""
    if not gluon_build_error(exc):
        raise exc
    import triton
    FAILED[(op, pass_, key)] = f"{type(exc).__name__}: {exc}"
    kernel = next(v.kernel for v in PASSES[(op, pass_)] if v.name == "gluon")
    shape = f"D={key[0]} {key[1]}" if isinstance(key, tuple) and len(key) == 2 else str(key)
    warnings.warn(f"dsv4attn: the Gluon {kernel} could not be built for {shape} by Triton {triton.__version__} "
                  f"({type(exc).__name__}: {str(exc)[:500]}); {instead}", RuntimeWarning, stacklevel=3)
