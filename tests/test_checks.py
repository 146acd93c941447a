"""Value checks: on by default, raise with the argument's name, and never read device values while compiling."""
import pytest
import torch

from dsv4attn import checks


def test_value_checks_raise_eagerly():
    with checks.checks(True):
        with pytest.raises(ValueError, match="x contains NaN"):
            checks.check_finite("x", torch.tensor([1.0, float("nan")]))
        with pytest.raises(ValueError, match="idx must hold row numbers"):
            checks.check_index_range("idx", torch.tensor([0, 5]), 3)


def test_value_checks_are_skipped_inside_torch_compile():
    def f(x, idx):
        checks.check_finite("x", x)               # would need a device->host read: a graph break
        checks.check_index_range("idx", idx, 3)
        return x * 2
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with checks.checks(True):
        x, idx = torch.tensor([1.0, float("nan")]), torch.tensor([0, 5])
        out = compiled(x, idx)                    # no graph break, no error: the checks stand aside
        assert torch.equal(out[:1], torch.tensor([2.0]))
        assert checks.values_readable()
