"""Helpers shared by the kernel tests: the error bound against the float64 reference, and an op-call log."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


def low_precision_bound(m: dict, factor: float, floor: float = 1e-6) -> float:
    """``factor`` x the reference's own error in the same dtype (both against float64) + ``floor`` x the largest
    float64 magnitude: the bound for a kernel result ``m`` (keys err_ref, magnitude)."""
    return factor * m["err_ref"] + floor * m["magnitude"]


def assert_error_within(label: str, m: dict, bound: float) -> None:
    """Fails, naming ``label`` and both errors, if the kernel's error ``m["err_kernel"]`` exceeds ``bound``."""
    assert m["err_kernel"] <= bound, (
        f"{label}: kernel error {m['err_kernel']:.3e} > bound {bound:.3e} "
        f"(reference in low precision: {m['err_ref']:.3e}, magnitude {m['magnitude']:.3e})")


class OpLog(TorchDispatchMode):
    """Records the names of the ops dispatched while active (a custom op shows as one call, its body unseen)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))
