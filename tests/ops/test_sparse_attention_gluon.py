"""The Gluon (SM90) sparse-attention forward and one-pass backward against the float64 reference, on the edge cases
of the contract; their refusals and dispatch (on any machine).

Runs only where the kernel applies (an SM90 GPU with Triton's Gluon); the V4-shape accuracy test of
test_sparse_attention_gpu.py runs it too. Bound: error <= 2x the reference op's own error in the same dtype (both
against float64 on the same rounded inputs) plus 1e-6 of the largest magnitude: where the reference's own error is
~0 (lse of a row whose reference rounding happens to be exact) the kernel's different fp32 summation order may
still differ in the last bits. The dispatch tests at the end run on any machine (kernel launches stubbed).
"""
from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import triton

from dsv4attn import variants
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
    for t in range(2, T, 5):                # rows ending early (the kernels stop at a row's last valid slot)
        idx[t, (t * 37) % (K + 1):] = -1
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
    monkeypatch.setattr(variants, "FAILED", {})
    monkeypatch.setattr(variants, "_mode", "auto")
    monkeypatch.setattr(gluon_hopper, "check", lambda q: (True, "stubbed"))
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
    assert launched == [] and variants.FAILED == {}


def test_a_config_without_kernel_is_a_triton_config(monkeypatch):
    """Benchmarks pass Triton tile configs (FWD_CONFIGS keys): they must time the Triton kernel, never Gluon."""
    launched, args = _stub_launches(monkeypatch, AssertionError("Gluon must not run"))
    config = dict(sat.FWD_CONFIGS[128], BLOCK_N=32)
    sat._sparse_attn_fwd(*args, config)
    assert launched == [(sat._sparse_attn_fwd_kernel, config)]


def test_forward_kernel_setting_is_validated(monkeypatch):
    """The kernel mode (DSV4ATTN_KERNELS, variants.set_kernels) picks the forward when no config is passed."""
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(variants, "_mode", "triton")
    assert sat.forward_kernel(q) == "triton"
    monkeypatch.setattr(variants, "_mode", "fast")
    with pytest.raises(ValueError, match="DSV4ATTN_KERNELS.*got 'fast'"):
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


def _teacher_inputs(H, D, K, dtype, seed):
    """(T, q, compressed_kv, candidates, scale, the generator for further draws) on the GPU for the teacher kernels:
    20% of the slots empty, row 5 without any valid slot, row 7 ending halfway (its blocks stop there)."""
    gen = torch.Generator().manual_seed(seed)
    T, N = 40, 700
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    ckv = torch.randn(N, D, generator=gen).to("cuda", dtype)
    idx = torch.randint(0, N, (T, K), generator=gen, dtype=torch.int32)
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.2, -1).cuda()
    idx[5] = -1
    idx[7, K // 2:] = -1
    return T, q, ckv, idx, D ** -0.5, gen


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
    T, q, ckv, idx, scale, gen = _teacher_inputs(H, D, K, dtype, H + D + K)
    idx[9, 3:] = -1
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


@sm90
@pytest.mark.parametrize("H,D,K,dtype,config", [
    (64, 512, 512, torch.bfloat16, None), (128, 512, 300, torch.bfloat16, None), (64, 256, 64, torch.float16, None),
    (64, 128, 7, torch.bfloat16, None), (64, 512, 2000, torch.bfloat16, None),
    (64, 256, 100, torch.bfloat16, dict(BLOCK_N=16, STAGES=4))])
def test_teacher_lse_matches_float64(H, D, K, dtype, config):
    """The teacher's per-head log-sum-exp over its valid candidates (the warm-up's full denominators) from the
    Gluon kernel: error <= 2x that of the same LSE formed by PyTorch from tensor-core logits (bf16 products, fp32
    sums), both against float64 on the same rounded inputs, + 1e-6 of the largest |LSE|; -inf exactly for a row
    without a valid slot; rows that end early, K not a multiple of the block, two head blocks."""
    T, q, ckv, idx, scale, _ = _teacher_inputs(H, D, K, dtype, H + D + K + 1)
    idx[9, 1:] = -1
    idx[9, 0] = 3
    rows = ckv[idx.long().clamp(min=0)]                                           # (T, K, D)

    def lse(logits):
        return torch.where((idx >= 0)[:, None, :], logits.double() * scale, float("-inf")).logsumexp(-1)

    got = gluon_hopper.teacher_lse(q, ckv, idx, scale, config).double()
    exact = lse(torch.bmm(q.double(), rows.double().transpose(1, 2)))
    low = lse(torch.bmm(q, rows.transpose(1, 2), out_dtype=torch.float32))
    assert torch.all(got[5] == float("-inf")) and torch.all(torch.isfinite(got[torch.arange(T) != 5]))
    keep = torch.arange(T, device="cuda") != 5
    err = (got[keep] - exact[keep]).abs().max().item()
    err_ref = (low[keep] - exact[keep]).abs().max().item()
    assert err <= 2 * err_ref + 1e-6 * exact[keep].abs().max().item(), (err, err_ref)


@sm90
@pytest.mark.parametrize("H,N,D,K,dtype,config", [
    (64, 700, 512, 300, torch.bfloat16, None), (128, 700, 512, 300, torch.bfloat16, None),
    (64, 50, 512, 300, torch.bfloat16, None), (64, 700, 256, 100, torch.float16, dict(BLOCK_N=16, STAGES=4)),
    (64, 700, 128, 10, torch.bfloat16, dict(BLOCK_N=32, STAGES=4))])
@pytest.mark.parametrize("starts", ["random", "documents"])
def test_teacher_range_form_equals_gathering(H, N, D, K, dtype, config, starts, monkeypatch):
    """The teacher kernels' range form (row t's candidates the kv rows first[t] + j, loaded by TMA: the warm-up's
    every visible entry on one device; two rows a program) gives the gathering kernels' values bit for bit: ragged
    counts, rows without a candidate (their first at or far past the kv's end, as padding rows have it), blocks that
    run past the kv tensor's end (TMA reads zeros), two head blocks, a kv shorter than one block, fp16, other ring
    depths and blocks, K below one block, an odd number of rows. "random": every pair's rows start apart (each row
    its own blocks of the program's stream); "documents": runs of rows with one start and counts growing along
    the run (the warm-up's layout: pairs share their blocks), runs starting at odd and even rows, and one run
    whose counts shrink (a pair's second row with fewer blocks than its first). The Gluon mode is strict: a range
    form that fails to build raises instead of leaving the gathering kernels to compare with themselves."""
    monkeypatch.setattr(variants, "_mode", "gluon")
    gen = torch.Generator().manual_seed(H + N + D)
    T = 97
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    ckv = torch.randn(N, D, generator=gen).to("cuda", dtype)
    if starts == "random":
        first = torch.randint(0, N, (T,), generator=gen)
        count = torch.minimum(torch.randint(0, K + 1, (T,), generator=gen), N - first)
    else:
        bounds = [0, 5, 6, 30, 31, 32, 61, T]                 # runs of 5, 1, 24, 1, 1, 29, 36 rows
        first = torch.zeros(T, dtype=torch.int64)
        count = torch.zeros(T, dtype=torch.int64)
        for a, b in zip(bounds[:-1], bounds[1:]):
            first[a:b] = int(torch.randint(0, N, (1,), generator=gen))
            count[a:b] = torch.arange(b - a) * max(1, K // (b - a)) + torch.randint(0, 2, (b - a,), generator=gen)
        count[32:61] = count[32:61].flip(0)                   # shrinking along the run
        count = torch.minimum(torch.minimum(count, torch.tensor(K)), N - first)
    count[:3] = 0
    first[0], first[1] = N, N + 5000
    j = torch.arange(K)
    idx = torch.where(j < count[:, None], first[:, None] + j, -1).to("cuda", torch.int32)
    first = first.cuda()
    scale = D ** -0.5
    lse = gluon_hopper.teacher_lse(q, ckv, idx, scale, config)
    assert torch.equal(lse, gluon_hopper.teacher_lse(q, ckv, idx, scale, config, first=first))
    full = torch.logaddexp(lse, torch.zeros_like(lse))                     # finite for every head
    mass = gluon_hopper.teacher_mass(q, ckv, idx, full, scale, config)
    assert torch.equal(mass, gluon_hopper.teacher_mass(q, ckv, idx, full, scale, config, first=first))
    assert torch.all(mass[:3] == 0) and bool((mass[idx >= 0] > 0).all())


class _StubKernel:
    """A jit kernel's launch stand-in: checks that the arguments bind to the ``real`` kernel's parameters, records its
    name, raises ``error`` for the D values in ``failing``."""

    def __init__(self, name, real, calls, error=None, failing=()):
        real = getattr(real, "real", real)                   # stubbed twice in one test: the kernel below
        self.name, self.real, self.calls, self.error, self.failing = name, real, calls, error, failing

    def __getitem__(self, grid):
        def launch(*args, **meta):
            inspect.signature(self.real.fn).bind(*args, **meta)       # the launch the real kernel would get
            self.calls.append(self.name)
            if self.error is not None and meta["D"] in self.failing:
                raise self.error
        return launch


def _stub_teacher_kernels(monkeypatch, error):
    from dsv4attn.ops import gluon_common
    if not gluon_common.IMPORTED:
        pytest.skip("this Triton has no Gluon: the teacher launchers cannot form TMA descriptors")
    calls = []
    monkeypatch.setattr(gluon_hopper, "RANGE_FORM_FAILED", {})
    monkeypatch.setattr(variants, "_mode", "auto")
    for name in ("mass", "lse"):
        gathering, ranges = f"_teacher_{name}_gluon", f"_teacher_{name}_ranges_gluon"
        monkeypatch.setattr(gluon_hopper, gathering,
                            _StubKernel(f"{name} gathering", getattr(gluon_hopper, gathering), calls))
        monkeypatch.setattr(gluon_hopper, ranges, _StubKernel(f"{name} ranges", getattr(gluon_hopper, ranges), calls,
                                                               error, failing=(128,)))
    return calls


def _teacher_calls(D):
    q, ckv = torch.zeros(2, 64, D, dtype=torch.bfloat16), torch.zeros(5, D, dtype=torch.bfloat16)
    idx, first = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32), torch.tensor([0, 1])
    lse = gluon_hopper.teacher_lse(q, ckv, idx, 0.1, first=first)
    gluon_hopper.teacher_mass(q, ckv, idx, torch.zeros_like(lse), 0.1, first=first)


def test_teacher_range_form_build_failure_falls_back_to_gathering_once(monkeypatch):
    """A range form this Triton cannot build: one warning naming it, the shape and the Triton, then the gathering
    kernels for that D and dtype (the range form not tried again); another D still takes the range form."""
    calls = _stub_teacher_kernels(monkeypatch, PTXASError("this Triton cannot build the range form"))
    built = r"range form \(TMA\) could not be built for D=128 torch.bfloat16 by Triton " + re.escape(triton.__version__)
    with pytest.warns(RuntimeWarning, match=built):
        _teacher_calls(128)
    assert calls == ["lse ranges", "lse gathering", "mass gathering"]
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no second warning
        _teacher_calls(128)
        _teacher_calls(256)
    assert calls == ["lse gathering", "mass gathering", "lse ranges", "mass ranges"]
    assert list(gluon_hopper.RANGE_FORM_FAILED) == [(128, torch.bfloat16)]


def test_teacher_range_form_errors_that_are_not_build_failures_propagate(monkeypatch):
    calls = _stub_teacher_kernels(monkeypatch, ValueError("a bug, not a build failure"))
    with pytest.raises(ValueError, match="a bug"):
        _teacher_calls(128)
    assert calls == ["lse ranges"] and gluon_hopper.RANGE_FORM_FAILED == {}
    calls.clear()
    calls = _stub_teacher_kernels(monkeypatch, PTXASError("this Triton cannot build the range form"))
    monkeypatch.setattr(variants, "_mode", "gluon")        # the Gluon kernels asked for: a build failure raises
    with pytest.raises(PTXASError, match="cannot build"):
        _teacher_calls(128)
    assert gluon_hopper.RANGE_FORM_FAILED == {}


@sm90
@pytest.mark.parametrize("T,H,D,K,N,dtype", [
    (64, 64, 512, 128, 300, torch.bfloat16), (40, 128, 512, 130, 1000, torch.bfloat16),
    (33, 64, 256, 64, 64, torch.float16), (9, 64, 512, 0, 10, torch.bfloat16)])
def test_sparse_attention_lse_takes_the_teacher_kernel(T, H, D, K, N, dtype, monkeypatch):
    """``sparse_attention_lse`` on SM90 runs the teacher-LSE kernel (scores only) and gives the attention's lse:
    error <= 2x the reference op's own in the same dtype (both against float64) + 1e-6 of the largest |lse|, -inf
    exactly where a row has no valid slot; the forward kernel is not launched."""
    from dsv4attn.ops import sparse_attention_lse
    monkeypatch.setattr(variants, "_mode", "gluon")
    monkeypatch.setattr(variants, "FAILED", {})
    ran = []
    teacher = gluon_hopper.teacher_lse
    monkeypatch.setattr(gluon_hopper, "teacher_lse", lambda *a, **k: ran.append(1) or teacher(*a, **k))
    monkeypatch.setattr(gluon_hopper, "launch_fwd", None)             # calling it fails the test
    gen = torch.Generator().manual_seed(T + H + K)
    q, kv, idx, sink = inputs(T, H, D, K, N, dtype, gen)
    got = sparse_attention_lse(q, kv, idx).double()
    assert ran == [1] or K == 0
    low = sparse_attention_reference(q, kv, Explicit(idx), sink, D ** -0.5)[1].double()
    exact = sparse_attention_reference(q.double(), kv.double(), Explicit(idx), sink.double(), D ** -0.5)[1]
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], exact[~finite])
    if finite.any():
        err = (got - exact)[finite].abs().max().item()
        err_ref = (low - exact)[finite].abs().max().item()
        assert err <= 2 * err_ref + 1e-6 * exact[finite].abs().max().item(), (err, err_ref)


def test_sparse_attention_lse_build_failure_falls_back_to_the_forward_once(monkeypatch):
    """A teacher-LSE kernel this Triton cannot build: one warning naming it, then the Triton forward kernel's
    LSE_ONLY form for that D and dtype; other errors propagate."""
    launched, (q, kv, idx, _sink, scale) = _stub_launches(monkeypatch, AssertionError("forward: Triton only here"))
    monkeypatch.setattr(variants, "_mode", "auto")

    def broken(*args, **kwargs):
        raise PTXASError("this Triton cannot build the teacher LSE kernel")
    monkeypatch.setattr(gluon_hopper, "teacher_lse", broken)
    built = r"teacher LSE kernel \(_teacher_lse_gluon: scores only\) could not be built for D=128 torch.bfloat16"
    with pytest.warns(RuntimeWarning, match=built):
        sat.triton_lse(q, kv, idx, scale)
    assert [(k, c.get("LSE_ONLY")) for k, c in launched] == [(sat._sparse_attn_fwd_kernel, True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # not tried again, no second warning
        sat.triton_lse(q, kv, idx, scale)
    assert len(launched) == 2
    monkeypatch.setattr(variants, "FAILED", {})
    monkeypatch.setattr(gluon_hopper, "teacher_lse", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        sat.triton_lse(q, kv, idx, scale)


def test_teacher_kernels_refuse_odd_rings():
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    for stages in (1, 3):
        with pytest.raises(ValueError, match=f"teacher_mass config: STAGES must be even and >= 2, got {stages}"):
            gluon_hopper.teacher_mass(q, None, None, None, 0.1, {"STAGES": stages})
        with pytest.raises(ValueError, match=f"teacher_lse config: STAGES must be even and >= 2, got {stages}"):
            gluon_hopper.teacher_lse(q, None, None, 0.1, {"STAGES": stages})


@sm90
@pytest.mark.parametrize("T,H,K,N,dtype,sink_kind", [
    (64, 64, 640, 300, torch.bfloat16, "random"),
    (48, 128, 600, 1000, torch.bfloat16, "random"),     # two head blocks; K not a multiple of the tile
    (40, 64, 100, 50, torch.float16, "-inf"),
    (20, 64, 7, 5, torch.bfloat16, "large"),            # fewer slots than one tile
    (17, 64, 96, 1, torch.float16, "random"),           # one kv row: every valid slot adds to it
    (30, 64, 64, 400, torch.bfloat16, "random"),        # exactly one tile
    (26, 64, 65, 90, torch.bfloat16, "random"),         # one tile and one slot
    (9, 64, 0, 10, torch.bfloat16, "random"),           # no slots at all
])
def test_gluon_backward_matches_float64_reference(T, H, K, N, dtype, sink_kind):
    """The one-pass Gluon backward: dq, dkv and d_sink in the public dtypes within 3x the reference's own error in the
    same dtype with Delta formed the same way (from the low-precision output), both against float64, + 1e-6 of the
    largest magnitude."""
    D = 512
    gen = torch.Generator().manual_seed(T * 11 + K)
    q, kv, idx, sink = inputs(T, H, D, K, N, dtype, gen, sink_kind)
    grad_out = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    scale = D ** -0.5
    assert sat.backward_kernel(q) == "gluon"
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    dq_k, dkv, d_sink = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale)
    got = (dq_k, dkv.to(dtype), d_sink)
    low_out, low_lse = reference_forward(q, kv, Explicit(idx), sink, scale)
    low = reference_backward(grad_out, q, kv, Explicit(idx), sink, low_lse, scale, out=low_out)
    q64, kv64, sink64 = q.double(), kv.double(), sink.double()
    lse64 = reference_forward(q64, kv64, Explicit(idx), sink64, scale)[1]
    exact = reference_backward(grad_out.double(), q64, kv64, Explicit(idx), sink64, lse64, scale)
    failures = []
    for name, k, r, e in zip(("dq", "dkv", "d_sink"), got, low, exact):
        k, r, e = k.double(), r.double(), e.double()
        if not torch.isfinite(k).all():
            failures.append(f"{name}: not finite")
            continue
        err_k, err_r = (k - e).abs().max().item(), (r - e).abs().max().item()
        if not err_k <= 3.0 * err_r + 1e-6 * e.abs().max().item():
            failures.append(f"{name}: kernel error {err_k:.3e}, reference {dtype} error {err_r:.3e}")
    assert not failures, "; ".join(failures)


@sm90
@pytest.mark.parametrize("T,H,D,K,N,pairs", [
    (64, 64, 512, 640, 300, 32),            # V4: the last 64 of 512 channels, all in the second consumer's half
    (48, 128, 512, 600, 1000, 32),          # two head blocks
    (24, 64, 512, 130, 200, 128),           # 256 channels: the backward rotates a 256-wide tail of dO
    (40, 64, 512, 200, 300, 160),           # 320 channels: both forward consumers, the backward's whole dO
    (40, 64, 256, 130, 500, 80),            # 160 rotated channels: both consumers' halves
    (33, 64, 128, 64, 64, 64),              # every channel rotates
])
@pytest.mark.parametrize("kernel,deterministic", [("gluon", False), ("gluon", True), ("triton", True)],
                         ids=["gluon", "gluon-deterministic", "triton-deterministic"])
def test_output_rope_matches_float64_reference(T, H, D, K, N, pairs, kernel, deterministic, monkeypatch):
    """``output_rope``: the forward's epilogue rotates the output back, the backward kernels rotate the gradient
    forward as they load it (the one-pass Gluon backward at D = 512, in both modes, the Triton one elsewhere;
    "triton" runs the Triton forward and the deterministic Triton passes). Bounds as above; the bf16 reference
    rounds its output, then rotates, and its backward takes the rotated-forward gradient rounded and Delta from the
    kernel's saved rotated output."""
    from dsv4attn.rope import apply_rope
    monkeypatch.setattr(variants, "_mode", "triton" if kernel == "triton" else "auto")
    gen = torch.Generator().manual_seed(T * 3 + K)
    q, kv, idx, sink = inputs(T, H, D, K, N, torch.bfloat16, gen)
    grad_out = torch.randn(T, H, D, generator=gen).to("cuda", torch.bfloat16)
    positions = torch.randint(0, 40000, (T,), generator=gen).cuda()
    inv_freq = (10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / pairs)).cuda()
    scale = D ** -0.5
    tables = sat.rope_tables(positions, inv_freq)
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale, dict(KERNEL=kernel), rope=tables)
    grads = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, deterministic=deterministic,
                                 rope=tables)
    assert sat.backward_kernel(q) == ("gluon" if kernel == "gluon" and D == 512 else "triton"), variants.FAILED
    got = (out, lse, grads[0], grads[1].to(q.dtype), grads[2])
    low_out, low_lse = reference_forward(q, kv, Explicit(idx), sink, scale)
    low = (apply_rope(low_out, positions, inv_freq, inverse=True), low_lse,
           *reference_backward(apply_rope(grad_out, positions, inv_freq), q, kv, Explicit(idx), sink, lse, scale,
                               out=out, delta_grad_out=grad_out))
    q64, kv64, sink64 = q.double(), kv.double(), sink.double()
    out64, lse64 = reference_forward(q64, kv64, Explicit(idx), sink64, scale)
    exact = (apply_rope(out64, positions, inv_freq, inverse=True), lse64,
             *reference_backward(apply_rope(grad_out.double(), positions, inv_freq), q64, kv64, Explicit(idx),
                                 sink64, lse64, scale))
    failures = []
    for name, k, r, e in zip(("out", "lse", "dq", "dkv", "d_sink"), got, low, exact):
        k, r, e = k.double(), r.double(), e.double()
        finite = torch.isfinite(e)
        if not (torch.equal(torch.isfinite(k), finite) and torch.equal(k[~finite], e[~finite])):
            failures.append(f"{name}: inf pattern differs from float64")
            continue
        err_k, err_r = (k - e)[finite].abs().max().item(), (r - e)[finite].abs().max().item()
        factor = 2.0 if name in ("out", "lse") else 3.0
        if not err_k <= factor * err_r + 1e-6 * e[finite].abs().max().item():
            failures.append(f"{name}: kernel error {err_k:.3e}, reference bf16 error {err_r:.3e}")
    assert not failures, "; ".join(failures)


@sm90
def test_gluon_backward_rows_without_slots_get_zero_gradients():
    D, H, T, N = 512, 64, 12, 40
    gen = torch.Generator().manual_seed(5)
    q, kv, idx, sink = inputs(T, H, D, 70, N, torch.bfloat16, gen)
    idx[:] = -1
    idx[4, 3] = 7                                            # one valid slot in one row
    grad_out = torch.randn(T, H, D, generator=gen).to("cuda", torch.bfloat16)
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, D ** -0.5)
    dq, dkv, d_sink = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, D ** -0.5)
    others = torch.ones(T, dtype=torch.bool, device="cuda")
    others[4] = False
    assert torch.equal(dq[others], torch.zeros_like(dq[others]))
    rows = torch.ones(N, dtype=torch.bool, device="cuda")
    rows[7] = False
    assert torch.equal(dkv[rows], torch.zeros_like(dkv[rows])) and dkv[7].abs().sum() > 0
    assert torch.isfinite(d_sink).all()


@sm90
@pytest.mark.parametrize("T,H,K,N,offset,deterministic", [
    (64, 64, 640, 300, 128, False),         # V4: the window's 128 slots, then the top-k's 512
    (48, 128, 600, 1000, 100, False),       # two head blocks (two planes); a range not aligned to the tiles
    (64, 64, 640, 300, 128, True),          # the deterministic mode (chunks of rows)
    (26, 64, 65, 90, 1, False),             # one tile and one slot
], ids=["v4", "two-head-blocks", "deterministic", "tile-and-one"])
def test_gluon_backward_teacher_mass_matches_float64(T, H, K, N, offset, deterministic, monkeypatch):
    """The one-pass backward's head-summed probabilities of slots offset .. K (``mass_slots``: the sparse indexer
    KL's teacher) within 2x the bf16 reference's own error (both against float64, the reference given the kernel's
    lse) + 1e-6 of the largest mass, 0 at empty slots; dq and d_sink (and the deterministic mode's dkv) bitwise as
    without it."""
    if deterministic:                       # several chunks of rows
        monkeypatch.setattr(sat, "DETERMINISTIC_BUFFER_ELEMENTS", 20 * K * 512)
    D, scale, slots = 512, 512 ** -0.5, (offset, K - offset)
    gen = torch.Generator().manual_seed(T + K + offset)
    q, kv, idx, sink = inputs(T, H, D, K, N, torch.bfloat16, gen)
    grad_out = torch.randn(T, H, D, generator=gen).to("cuda", torch.bfloat16)
    assert sat.backward_kernel(q) == "gluon"
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    base = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, deterministic=deterministic)
    *grads, mass = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, deterministic=deterministic,
                                        mass_slots=slots)
    assert not variants.FAILED, variants.FAILED
    assert torch.equal(grads[0], base[0]) and torch.equal(grads[2], base[2])
    if deterministic:
        assert torch.equal(grads[1], base[1])
    low = reference_backward(grad_out, q, kv, Explicit(idx), sink, lse, scale, out=out, mass_slots=slots)[3]
    q64, kv64, sink64 = q.double(), kv.double(), sink.double()
    lse64 = reference_forward(q64, kv64, Explicit(idx), sink64, scale)[1]
    exact = reference_backward(grad_out.double(), q64, kv64, Explicit(idx), sink64, lse64, scale,
                               mass_slots=slots)[3]
    assert mass.shape == (T, K - offset) and mass.dtype == torch.float32
    assert torch.equal(mass[idx[:, offset:] < 0], torch.zeros_like(mass[idx[:, offset:] < 0]))
    err_k, err_r = (mass.double() - exact).abs().max().item(), (low.double() - exact).abs().max().item()
    assert exact.abs().max().item() > 1e-2
    assert err_k <= 2.0 * err_r + 1e-6 * exact.abs().max().item(), f"mass: kernel {err_k:.3e}, reference {err_r:.3e}"


def _stub_bwd(monkeypatch, gluon_error=None):
    """Backward dispatch harness: the one-pass Gluon backward looks available; its launch is recorded as "gluon" (or
    raises ``gluon_error``), Triton launches by their parts. Returns the record and _sparse_attn_bwd's arguments."""
    launched = []

    def gluon(*args, deterministic_rows=None, **kwargs):
        launched.append(("gluon" if deterministic_rows is None else f"gluon-det {deterministic_rows}")
                        + ("" if gluon_error is None else " (failed)"))
        if gluon_error is not None:
            raise gluon_error

    def triton_launch(kernel, grid_of, q, c, args):
        launched.append(("DQ" if c.get("DO_DQ") else "") + ("DKV" if c.get("DO_DKV") else "")
                        + ("-det" if c.get("DETERMINISTIC") else ""))

    monkeypatch.setattr(variants, "FAILED", {})
    monkeypatch.setattr(variants, "_mode", "auto")
    monkeypatch.setattr(gluon_hopper_bwd, "check", lambda q: (True, "stubbed"))
    monkeypatch.setattr(gluon_hopper_bwd, "launch", gluon)
    monkeypatch.setattr(sat, "_launch", triton_launch)
    monkeypatch.setattr(sat, "_delta_from_out", lambda out, g: torch.zeros(out.shape[:2]))
    monkeypatch.setattr(sat, "add_rows_by_key", lambda *args: None)
    T, H, D, K = 2, 64, 512, 4
    q, kv = torch.zeros(T, H, D, dtype=torch.bfloat16), torch.zeros(3, D, dtype=torch.bfloat16)
    return launched, (q, kv, torch.zeros(T, K, dtype=torch.int32), torch.zeros(H), q.clone(), torch.zeros(T, H),
                      q.clone(), 0.1)


def test_default_backward_takes_the_one_pass_gluon_kernel_where_it_applies(monkeypatch):
    """SM90 default: the one-pass Gluon backward alone, in the deterministic mode too (in chunks of rows sized as
    the Triton kernel's: all 2 rows here); DSV4ATTN_KERNELS=triton, an explicit Triton config and machines without
    the kernel run the Triton kernel."""
    launched, args = _stub_bwd(monkeypatch)
    sat._sparse_attn_bwd(*args)
    assert launched == ["gluon"]
    launched.clear()
    sat._sparse_attn_bwd(*args, deterministic=True)
    assert launched == ["gluon-det 2"]
    launched.clear()
    monkeypatch.setattr(variants, "_mode", "triton")
    sat._sparse_attn_bwd(*args, deterministic=True)
    monkeypatch.setattr(variants, "_mode", "auto")
    assert launched == ["DQ", "DKV-det"]
    launched.clear()
    sat._sparse_attn_bwd(*args, sat.BWD_CONFIGS[512])
    assert launched == ["DQ", "DKV"]
    launched.clear()
    monkeypatch.setattr(variants, "_mode", "triton")
    sat._sparse_attn_bwd(*args)
    monkeypatch.setattr(variants, "_mode", "auto")
    monkeypatch.setattr(gluon_hopper_bwd, "check", lambda q: (False, "stubbed"))
    sat._sparse_attn_bwd(*args)
    assert launched == ["DQ", "DKV"] * 2


def test_gluon_backward_build_failure_falls_back_to_the_triton_kernel_once(monkeypatch):
    launched, args = _stub_bwd(monkeypatch, PTXASError("this Triton cannot build the Gluon kernel"))
    with pytest.warns(RuntimeWarning, match=r"Gluon sparse-attention backward kernel \(_sparse_attn_bwd_gluon\) "
                                            r"could not be built for D=512"):
        sat._sparse_attn_bwd(*args)
    assert (launched == ["gluon (failed)", "DQ", "DKV"]
            and ("sparse_attention", "backward", (512, torch.bfloat16)) in variants.FAILED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                    # not tried again, no second warning
        sat._sparse_attn_bwd(*args)
    assert launched == ["gluon (failed)", "DQ", "DKV", "DQ", "DKV"]
    assert sat.backward_kernel(args[0]) == "triton"


def test_gluon_backward_does_not_hide_errors_that_are_not_build_failures(monkeypatch):
    launched, args = _stub_bwd(monkeypatch, ValueError("a bug, not a build failure"))
    with pytest.raises(ValueError, match="a bug"):
        sat._sparse_attn_bwd(*args)
    assert launched == ["gluon (failed)"] and variants.FAILED == {}


def test_gluon_backward_config_keys_are_checked():
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"unknown keys \['BLOCK_N'\]"):
        gluon_hopper_bwd.launch(q, None, None, torch.zeros(2, 3), None, None, None, None, 0.1, dict(BLOCK_N=32))
