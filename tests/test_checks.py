"""Check modes: the default reads nothing, ``"values"`` (debug) scans and raises with the argument's name, neither
reads device values while compiling; ``set_checks`` / ``DSV4ATTN_CHECKS`` map onto the two modes."""
import pytest
import torch

from dsv4attn import checks


def test_value_checks_raise_eagerly():
    with checks.checks("values"):
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


def test_default_mode_does_not_scan():
    with checks.checks("default"):
        checks.check_finite("x", torch.tensor([1.0, float("nan")]))
        checks.check_index_range("idx", torch.tensor([0, 5]), 3)
        assert not checks.values_readable() and checks.reads_possible()


@pytest.mark.parametrize("given, mode", [(True, "values"), (False, "default"), ("values", "values"),
                                         ("default", "default")])
def test_set_checks_modes(given, mode):
    before = checks.checks_mode()
    try:
        checks.set_checks(given)
        assert checks.checks_mode() == mode and checks.checks_enabled() == (mode == "values")
    finally:
        checks.set_checks(before)


@pytest.mark.parametrize("bad", ["on", "Values", 1, None])
def test_set_checks_rejects_other_modes(bad):
    before = checks.checks_mode()
    with pytest.raises(ValueError, match=r"set_checks mode must be one of \['default', 'values'\] \(or True = "
                                         r"'values', False = 'default'\), got"):
        checks.set_checks(bad)
    assert checks.checks_mode() == before


@pytest.mark.parametrize("raw, mode", [(None, "default"), ("0", "default"), ("off", "default"), ("False", "default"),
                                       ("default", "default"), ("values", "values"), ("1", "values"),
                                       (" TRUE ", "values")])
def test_environment_variable(monkeypatch, raw, mode):
    if raw is None:
        monkeypatch.delenv("DSV4ATTN_CHECKS", raising=False)
    else:
        monkeypatch.setenv("DSV4ATTN_CHECKS", raw)
    assert checks._mode_from_env() == mode


def test_environment_variable_typo_is_named(monkeypatch):
    monkeypatch.setenv("DSV4ATTN_CHECKS", "vales")
    with pytest.raises(ValueError, match=r"environment variable DSV4ATTN_CHECKS must be 'values' .* got 'vales'"):
        checks._mode_from_env()


def test_mask_out_of_range_keeps_dtype_and_reads_nothing():
    idx = torch.tensor([[-1, 0, 2, 3, 7, -4]], dtype=torch.int32)
    out = checks.mask_out_of_range(idx, 3)
    assert out.dtype == torch.int32 and out.tolist() == [[-1, 0, 2, -1, -1, -4]]
