"""The Gluon (SM90) sparse-attention forward and backward dKV pass against the float64 reference, on the edge cases
of the contract; their refusals and dispatch (on any machine).

Runs only where the kernel applies (an SM90 GPU with Triton's Gluon); the V4-shape accuracy test of
test_sparse_attention_gpu.py runs it too. Bound: error <= 2x the reference op's own error in the same dtype (both
against float64 on the same rounded inputs) plus 1e-6 of the largest magnitude: where the reference's own error is
~0 (lse of a row whose reference rounding happens to be exact) the kernel's different fp32 summation order may
still differ in the last bits. The dispatch tests at the end run on any machine (kernel launches stubbed).
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import triton

from dsv4attn.ops.index_sets import Explicit
from dsv4attn.ops.sparse_attention import gluon_hopper, gluon_hopper_bwd
from dsv4attn.ops.sparse_attention import triton as sat
from dsv4attn.ops.sparse_attention.reference import (reference_backward, reference_forward,
                                                     sparse_attention_reference)
from triton.runtime.errors import PTXASError

ON_SM90 = torch.cuda.is_available() and gluon_hopper.available(
    torch.empty(1, 64, 128, device="cuda", dtype=torch.bfloat16))
sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an SM90 GPU and Triton's Gluon")


def inputs(T, H, D, K, N, dtype, gen, sink_kind="random"):
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    kv = torch.randn(N, D, generator=gen).to("cuda", dtype)
    idx = torch.randint(0, N, (T, K), generator=gen, dtype=torch.int32)
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.2, -1)       # holes
    if K > 1:
        idx[:, 1] = idx[:, 0]                                              # duplicates count once per occurrence
    if K > 0:
        idx[3] = -1                                                        # a row with no valid slot
    if T > 8 and K > 0:
        idx[7, 0], idx[7, 1:] = min(2, N - 1), -1                          # a row with one valid slot
    sink = {"random": torch.randn(H, generator=gen), "-inf": torch.full((H,), float("-inf")),
            "large": torch.full((H,), 30.0)}[sink_kind]
    return q, kv, idx.cuda(), sink.cuda()


@sm90
@pytest.mark.parametrize("T,H,D,K,N,dtype,sink_kind", [
    (64, 64, 512, 640, 300, torch.bfloat16, "random"),
    (48, 128, 512, 600, 1000, torch.bfloat16, "random"),     # two head blocks; K not a multiple of the block
    (40, 64, 512, 100, 50, torch.float16, "-inf"),
    (40, 64, 256, 130, 500, torch.bfloat16, "large"),
    (33, 64, 128, 64, 64, torch.bfloat16, "random"),
    (20, 64, 512, 7, 5, torch.bfloat16, "random"),           # fewer slots than one block
    (24, 128, 256, 200, 300, torch.float16, "random"),       # two head blocks at D = 256, fp16
    (17, 64, 128, 96, 1, torch.float16, "large"),            # one kv row, every valid slot repeats it
    (9, 64, 512, 0, 10, torch.bfloat16, "random"),           # no slots at all: every row is empty
])
@pytest.mark.parametrize("config", [dict(), dict(BLOCK_N=32, STAGES=4), dict(BLOCK_N=32, STAGES=3),
                                    dict(BLOCK_N=16, STAGES=4)],
                         ids=["default", "32x4", "32x3", "16x4"])
def test_gluon_forward_matches_float64_reference(T, H, D, K, N, dtype, sink_kind, config):
    gen = torch.Generator().manual_seed(T * 7 + K)
    q, kv, idx, sink = inputs(T, H, D, K, N, dtype, gen, sink_kind)
    scale = D ** -0.5
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale, dict(config, KERNEL="gluon"))
    low = sparse_attention_reference(q, kv, Explicit(idx), sink, scale)
    exact = sparse_attention_reference(q.double(), kv.double(), Explicit(idx), sink.double(), scale)
    for name, k, r, e in zip(("out", "lse"), (out, lse), low, exact):
        k, r, e = k.double(), r.double(), e.double()
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(k), finite) and torch.equal(k[~finite], e[~finite]), \
            f"{name}: inf pattern differs from float64"
        if not finite.any():                     # K == 0: every lse is -inf, checked exactly above
            continue
        err_k = (k - e)[finite].abs().max().item()
        err_r = (r - e)[finite].abs().max().item()
        assert err_k <= 2.0 * err_r + 1e-6 * e[finite].abs().max().item(), \
            f"{name}: kernel error {err_k:.3e}, reference {dtype} error {err_r:.3e}"
    assert torch.all(out[3] == 0) and torch.all(lse[3] == float("-inf"))      # K > 0: row 3 is empty; K == 0: all


@pytest.mark.parametrize("shape,dtype", [((4, 48, 512), torch.bfloat16), ((4, 64, 512), torch.float32)])
def test_gluon_forward_refuses_what_it_cannot_run(shape, dtype):
    """H not a multiple of 64, fp32 (and, without an SM90 GPU, every input): a clear error; "auto" picks Triton."""
    q = torch.randn(*shape, device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype)
    with pytest.raises(ValueError, match="KERNEL='gluon'"):
        sat.forward_kernel(q, {"KERNEL": "gluon"})
    assert sat.forward_kernel(q, {"KERNEL": "auto"}) == "triton"
    with pytest.raises(ValueError, match="must be 'auto', 'gluon' or 'triton', got 'cuda'"):
        sat.forward_kernel(q, {"KERNEL": "cuda"})


def _stub_launches(monkeypatch, gluon_error):
    """Dispatch-logic harness: Gluon looks available and its launch raises ``gluon_error``; Triton launches are
    recorded instead of run."""
    def broken(*args, **kwargs):
        raise gluon_error

    launched = []
    monkeypatch.setattr(sat, "GLUON_FAILED", {})
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "auto")
    monkeypatch.setattr(gluon_hopper, "available", lambda q: True)
    monkeypatch.setattr(gluon_hopper, "launch_fwd", broken)
    monkeypatch.setattr(sat, "_launch", lambda kernel, grid_of, q, config, args: launched.append((kernel, config)))
    q, kv = torch.zeros(2, 64, 128, dtype=torch.bfloat16), torch.zeros(3, 128, dtype=torch.bfloat16)
    return launched, (q, kv, torch.zeros(2, 4, dtype=torch.int32), torch.zeros(64), 0.1)


def test_auto_falls_back_to_triton_once_when_gluon_cannot_build(monkeypatch):
    """"auto" where the Gluon kernel fails to build: one warning, then the Triton kernel (with its own tiles) for
    that D and dtype; other shapes still try Gluon; an explicit KERNEL="gluon" raises the build error."""
    launched, args = _stub_launches(monkeypatch, PTXASError("this Triton cannot build the Gluon kernel"))
    built = r"forward kernel \(_sparse_attn_fwd_gluon\) could not be built for D=128 torch.bfloat16 by Triton "
    with pytest.warns(RuntimeWarning, match=built + re.escape(triton.__version__)):
        sat._sparse_attn_fwd(*args)
    assert launched == [(sat._sparse_attn_fwd_kernel, sat.FWD_CONFIGS[128])]
    assert sat.forward_kernel(args[0]) == "triton"
    assert sat.forward_kernel(torch.zeros(2, 64, 256, dtype=torch.bfloat16)) == "gluon"   # another D: not marked
    sat._sparse_attn_fwd(*args)                                         # no second attempt, no second warning
    assert len(launched) == 2
    with pytest.raises(PTXASError, match="cannot build"):
        sat._sparse_attn_fwd(*args, {"KERNEL": "gluon"})


def test_auto_does_not_hide_errors_that_are_not_build_failures(monkeypatch):
    launched, args = _stub_launches(monkeypatch, ValueError("a bug, not a build failure"))
    with pytest.raises(ValueError, match="a bug"):
        sat._sparse_attn_fwd(*args)
    assert launched == [] and sat.GLUON_FAILED == {}


def test_a_config_without_kernel_is_a_triton_config(monkeypatch):
    """Benchmarks pass Triton tile configs (FWD_CONFIGS keys): they must time the Triton kernel, never Gluon."""
    launched, args = _stub_launches(monkeypatch, AssertionError("Gluon must not run"))
    config = dict(sat.FWD_CONFIGS[128], BLOCK_N=32)
    sat._sparse_attn_fwd(*args, config)
    assert launched == [(sat._sparse_attn_fwd_kernel, config)]


def test_forward_kernel_setting_is_validated(monkeypatch):
    """FORWARD_KERNEL (from DSV4ATTN_FORWARD_KERNEL) picks the forward when no config is passed."""
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "triton")
    assert sat.forward_kernel(q) == "triton"
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "fast")
    with pytest.raises(ValueError, match="DSV4ATTN_FORWARD_KERNEL.*got 'fast'"):
        sat.forward_kernel(q)


def test_gluon_config_keys_are_checked():
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"unknown keys \['BLOCK_DK'\]"):
        gluon_hopper.launch_fwd(q, None, None, None, None, None, 0.1, {"BLOCK_DK": 64})
    for block_n in (8, 48, 128):
        with pytest.raises(ValueError, match=f"BLOCK_N must be 16, 32 or 64 .*got {block_n}"):
            gluon_hopper.launch_fwd(q, None, None, None, None, None, 0.1, {"BLOCK_N": block_n})
        with pytest.raises(ValueError, match=f"teacher_mass config: BLOCK_N must be 16, 32 or 64 .*got {block_n}"):
            gluon_hopper.teacher_mass(q, None, None, None, 0.1, {"BLOCK_N": block_n})


@sm90
@pytest.mark.parametrize("H,D,K,dtype,config", [
    (64, 512, 512, torch.bfloat16, None), (128, 512, 300, torch.bfloat16, None), (64, 256, 64, torch.float16, None),
    (64, 128, 7, torch.bfloat16, None), (64, 512, 200, torch.bfloat16, dict(BLOCK_N=32, STAGES=4)),
    (64, 256, 100, torch.bfloat16, dict(BLOCK_N=16, STAGES=4))])
def test_teacher_mass_matches_float64(H, D, K, dtype, config):
    """The indexer-KL teacher mass m(t, j) = sum_h exp(scale q.C_j - L_h) from the Gluon kernel: error <= 2x that of
    the same sum formed by PyTorch in the same arithmetic (bf16 products accumulated in fp32 on the tensor cores:
    cuBLAS's bf16 GEMM with an fp32 result), both against float64 on the same rounded inputs, + 1e-6 of the largest
    mass. (An fp32 SIMT GEMM accumulates with round-to-nearest: ~7x more precise than any tensor-core product at
    D = 512, which is why it is not the yardstick here; the end-to-end KL tests do compare with it.)"""
    gen = torch.Generator().manual_seed(H + D + K)
    T, N = 40, 700
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    ckv = torch.randn(N, D, generator=gen).to("cuda", dtype)
    idx = torch.randint(0, N, (T, K), generator=gen, dtype=torch.int32)
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.2, -1).cuda()
    idx[5] = -1
    scale = D ** -0.5
    full = (torch.randn(T, H, generator=gen) + 8.0)
    full[5, :3] = float("-inf")                          # heads of a row without valid slots: L = -inf allowed
    full = full.cuda()
    rows = ckv[idx.long().clamp(min=0)]                                           # (T, K, D)

    def mass(logits, dt):
        return torch.where(idx >= 0, torch.exp(logits.to(dt) * scale - full.to(dt)[..., None]).sum(1), 0.0).double()

    got = gluon_hopper.teacher_mass(q, ckv, idx, full, scale, config).double()
    exact = mass(torch.bmm(q.double(), rows.double().transpose(1, 2)), torch.float64)
    low = mass(torch.bmm(q, rows.transpose(1, 2), out_dtype=torch.float32), torch.float32)
    err, err_ref = (got - exact).abs().max().item(), (low - exact).abs().max().item()
    assert torch.all(got[5] == 0) and torch.all(got[idx < 0] == 0)
    assert err <= 2 * err_ref + 1e-6 * exact.abs().max().item(), (err, err_ref)


def test_teacher_mass_refuses_odd_rings():
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    for stages in (1, 3):
        with pytest.raises(ValueError, match=f"STAGES must be even and >= 2, got {stages}"):
            gluon_hopper.teacher_mass(q, None, None, None, 0.1, {"STAGES": stages})


def _dkv_config(kernel, gluon=None):
    """The D = 512 default backward config with its dKV pass's KERNEL (and Gluon tiles) replaced."""
    base = sat.BWD_CONFIGS[512]
    return dict(base, DKV=dict(base["DKV"], KERNEL=kernel, GLUON=gluon))


@sm90
@pytest.mark.parametrize("T,H,K,N,dtype,sink_kind,config", [
    (64, 64, 640, 300, torch.bfloat16, "random", None),
    (48, 128, 600, 1000, torch.bfloat16, "random", None),     # two head blocks; K not a multiple of the tile
    (40, 64, 100, 50, torch.float16, "-inf", None),
    (20, 64, 7, 5, torch.bfloat16, "large", None),            # fewer slots than one tile
    (17, 64, 96, 1, torch.float16, "random", None),           # one kv row: every valid slot adds to it
    (30, 64, 200, 400, torch.bfloat16, "random", dict(BLOCK_N=16)),
    (26, 64, 130, 90, torch.bfloat16, "random", dict(BLOCK_N=16, STAGES=4)),
    (9, 64, 0, 10, torch.bfloat16, "random", None),           # no slots at all
])
def test_gluon_dkv_matches_float64_reference(T, H, K, N, dtype, sink_kind, config):
    """The backward with the Gluon dKV pass (Delta and dq in Triton): dq, dkv and d_sink in the public dtypes within
    3x the reference op's own error in the same dtype, both against float64, + 1e-6 of the largest magnitude."""
    D = 512
    gen = torch.Generator().manual_seed(T * 11 + K)
    q, kv, idx, sink = inputs(T, H, D, K, N, dtype, gen, sink_kind)
    grad_out = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    scale = D ** -0.5
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    dq, dkv, d_sink = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, _dkv_config("gluon", config))
    got = (dq, dkv.to(dtype), d_sink)
    low_lse = reference_forward(q, kv, Explicit(idx), sink, scale)[1]
    low = reference_backward(grad_out, q, kv, Explicit(idx), sink, low_lse, scale)
    q64, kv64, sink64 = q.double(), kv.double(), sink.double()
    lse64 = reference_forward(q64, kv64, Explicit(idx), sink64, scale)[1]
    exact = reference_backward(grad_out.double(), q64, kv64, Explicit(idx), sink64, lse64, scale)
    for name, k, r, e in zip(("dq", "dkv", "d_sink"), got, low, exact):
        k, r, e = k.double(), r.double(), e.double()
        assert torch.isfinite(k).all(), f"{name}: not finite"
        err_k, err_r = (k - e).abs().max().item(), (r - e).abs().max().item()
        assert err_k <= 3.0 * err_r + 1e-6 * e.abs().max().item(), \
            f"{name}: kernel error {err_k:.3e}, reference {dtype} error {err_r:.3e}"


def _stub_bwd(monkeypatch, gluon_error=None):
    """Backward dispatch harness: the Gluon dKV pass looks available; its launch is recorded as "gluon" (or raises
    ``gluon_error``), Triton launches are recorded by their parts. Returns the record and _rows_bwd's arguments up
    to the config."""
    launched = []

    def gluon(*args, **kwargs):
        launched.append("gluon" if gluon_error is None else "gluon (failed)")
        if gluon_error is not None:
            raise gluon_error

    def triton_launch(kernel, grid_of, q, c, args):
        launched.append(("DELTA" if c["DELTA_PASS"] else "") + ("DQ" if c["DO_DQ"] else "")
                        + ("DKV" if c["DO_DKV"] else "") + ("-det" if c["DETERMINISTIC"] else ""))

    monkeypatch.setattr(sat, "GLUON_BWD_FAILED", {})
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "auto")
    monkeypatch.setattr(gluon_hopper_bwd, "available", lambda q: True)
    monkeypatch.setattr(gluon_hopper_bwd, "launch_dkv", gluon)
    monkeypatch.setattr(sat, "_launch", triton_launch)
    monkeypatch.setattr(sat, "add_rows_by_key", lambda *args: None)
    T, H, D, K = 2, 64, 512, 4
    q, kv = torch.zeros(T, H, D, dtype=torch.bfloat16), torch.zeros(3, D, dtype=torch.bfloat16)
    f32 = torch.zeros(T, H)
    return launched, (q, kv, torch.zeros(T, K, dtype=torch.int32), q, f32, f32, q.clone(), torch.zeros(3, D), 0.1)


def _run(args, config, deterministic=False):
    config = dict(config)
    sat._rows_bwd(*args, config, deterministic, sat.BWD_PASSES[config.pop("LAYOUT")])


def test_default_backward_takes_the_gluon_dkv_pass_where_it_applies(monkeypatch):
    """D = 512 default: Delta and dq in Triton, dKV by Gluon; the deterministic mode, DSV4ATTN_FORWARD_KERNEL=triton
    and machines without the kernel run the Triton dKV pass after the same Delta and dq launches."""
    launched, args = _stub_bwd(monkeypatch)
    _run(args, sat.BWD_CONFIGS[512])
    assert launched == ["DELTA", "DQ", "gluon"]
    launched.clear()
    _run(args, sat.BWD_CONFIGS[512], deterministic=True)
    assert launched == ["DELTA", "DQ", "DKV-det"]
    launched.clear()
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "triton")
    _run(args, sat.BWD_CONFIGS[512])
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "auto")
    monkeypatch.setattr(gluon_hopper_bwd, "available", lambda q: False)
    _run(args, sat.BWD_CONFIGS[512])
    assert launched == ["DELTA", "DQ", "DKV"] * 2


def test_gluon_dkv_build_failure_falls_back_to_the_triton_pass_once(monkeypatch):
    launched, args = _stub_bwd(monkeypatch, PTXASError("this Triton cannot build the Gluon kernel"))
    built = r"Gluon dKV kernel \(_sparse_attn_dkv_gluon\) could not be built for D=512"
    with pytest.warns(RuntimeWarning, match=built):
        _run(args, sat.BWD_CONFIGS[512])
    assert launched == ["DELTA", "DQ", "gluon (failed)", "DKV"] and (512, torch.bfloat16) in sat.GLUON_BWD_FAILED
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                    # not tried again, no second warning
        _run(args, sat.BWD_CONFIGS[512])
    assert launched == ["DELTA", "DQ", "gluon (failed)", "DKV", "DELTA", "DQ", "DKV"]
    with pytest.raises(PTXASError, match="cannot build"):                 # an explicit request raises
        _run(args, _dkv_config("gluon"))


def test_gluon_dkv_does_not_hide_errors_that_are_not_build_failures(monkeypatch):
    launched, args = _stub_bwd(monkeypatch, ValueError("a bug, not a build failure"))
    with pytest.raises(ValueError, match="a bug"):
        _run(args, sat.BWD_CONFIGS[512])
    assert launched == ["DELTA", "DQ", "gluon (failed)"] and sat.GLUON_BWD_FAILED == {}


def test_gluon_dkv_refusals(monkeypatch):
    _, args = _stub_bwd(monkeypatch, AssertionError("must not run"))
    with pytest.raises(ValueError, match="no deterministic mode"):
        _run(args, _dkv_config("gluon"), deterministic=True)
    with pytest.raises(ValueError, match="KERNEL of pass 'DELTA' must be .* 'triton' for the others, got 'gluon'"):
        _run(args, dict(_dkv_config("gluon"), DELTA=dict(KERNEL="gluon")))
    with pytest.raises(ValueError, match="must be 'auto', 'gluon' or 'triton' for the dKV pass.*got 'cuda'"):
        _run(args, _dkv_config("cuda"))
    monkeypatch.setattr(gluon_hopper_bwd, "available", lambda q: False)
    with pytest.raises(ValueError, match="needs Gluon, an SM90 GPU"):
        _run(args, _dkv_config("gluon"))


def test_gluon_dkv_config_keys_are_checked():
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    for bad, match in ((dict(BLOCK_DV=64), r"unknown keys \['BLOCK_DV'\]"),
                       (dict(BLOCK_N=64), "BLOCK_N must be 16 or 32"),
                       (dict(STAGES=3), "STAGES must be even and >= 2, got 3"),
                       (dict(STAGES=4), "STAGES=4 x BLOCK_N=32 needs 278528 bytes of shared memory at D=512")):
        with pytest.raises(ValueError, match=match):
            gluon_hopper_bwd.launch_dkv(q, None, None, None, None, None, None, 0.1, bad)
