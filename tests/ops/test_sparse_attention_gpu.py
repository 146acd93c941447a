"""sparse_attention on a CUDA GPU (Triton backend): V4 shapes against float64, determinism, CUDA graphs, compile.

Skipped without CUDA. Shapes: V4-Flash attention (H = 64, D = 512, K = 640 = 128 window + 512 top-k), T = 4096,
random *causal* indices (row t picks distinct keys in [0, t], rows shorter than K padded with -1, 5% holes, two
empty rows). Bound (STYLE.md): kernel error <= 2x (out, lse) / 3x (dq, dkv, d_sink) the error of the reference op
run in bf16, both measured against the float64 reference on the same bf16-rounded inputs, plus 1e-6 of the largest
magnitude for fp32 summation-order noise where the reference's own error is ~0. The reference backward forms Delta
from the kernel's saved bf16 output and uses its lse, as the kernels' backwards do.
"""
from __future__ import annotations

import pytest
import torch

import dsv4attn
from dsv4attn import variants
from dsv4attn import backend
from dsv4attn.ops import Explicit, sparse_attention
from dsv4attn.ops.sparse_attention.reference import (reference_backward, reference_forward,
                                                     sparse_attention_reference)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V4 = dict(T=4096, H=64, D=512, K=640)
SMALLER = dict(T=2048, H=64, D=512, K=640)         # capture / compile: same geometry, half the rows
NAMES = ("out", "lse", "dq", "dkv", "d_sink")
GRADS = ("dq", "dkv", "d_sink")


def causal_indices(T: int, K: int, gen: torch.Generator, hole_frac: float = 0.05) -> torch.Tensor:
    """(T, K) int32: distinct random keys in [0, t] per row t; -1 where a row has fewer than K, 5% holes, 2 empty
    rows."""
    row, col = torch.arange(T)[:, None], torch.arange(T)[None, :]
    score = torch.rand(T, T, generator=gen).masked_fill(col > row, -1.0)
    top, idx = score.topk(K, dim=1)
    idx = idx.masked_fill(top < 0, -1)
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < hole_frac, -1)
    idx[[5, T // 2]] = -1
    return idx.to(torch.int32)


def make_inputs(T, H, D, K, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    kv = torch.randn(T, D, generator=gen).to("cuda", dtype)
    sink = torch.randn(H, generator=gen).cuda()
    grad_out = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    idx = causal_indices(T, K, gen).cuda()
    length = torch.randint(0, K + 1, (T,), generator=gen, dtype=torch.int32).cuda()
    return q, kv, idx, sink, grad_out, length


def run(fn, q, kv, sink, grad_out):
    """fn(q, kv, sink) -> (out, lse); returns out, lse, dq, dkv, d_sink (detached, original dtypes)."""
    q, kv, sink = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
    out, lse = fn(q, kv, sink)
    out.backward(grad_out.to(out.dtype))
    torch.cuda.synchronize()
    return [x.detach() for x in (out, lse, q.grad, kv.grad, sink.grad)]


def op(idx, **kwargs):
    return lambda q, kv, sink: sparse_attention(q, kv, idx, sink, **kwargs)


def assert_bitwise(a_list, b_list, what: str, names=NAMES):
    for name, a, b in zip(names, a_list, b_list):
        assert torch.equal(a, b), f"{what}: {name} differs (max {(a.double() - b.double()).abs().max().item():.3e})"


@pytest.fixture(autouse=True)
def _auto_backend():
    backend.set_backend(None)
    yield
    backend.set_backend(None)


@pytest.fixture(scope="module")
def v4_case():
    """V4-shape inputs and the reference in bf16 and float64 (computed once, shared by the parametrised tests)."""
    q, kv, idx, sink, grad_out, _ = make_inputs(**V4)
    scale = V4["D"] ** -0.5
    ref = lambda q_, kv_, s_: sparse_attention_reference(q_, kv_, Explicit(idx), s_, scale)    # noqa: E731
    low_out, low_lse = reference_forward(q, kv, Explicit(idx), sink, scale)
    exact = run(ref, q.double(), kv.double(), sink.double(), grad_out.double())
    return (q, kv, idx, sink, grad_out), (low_out, low_lse), exact


# ---------------------------------------------------------------------------------------------------------------
# Accuracy at V4 shapes

def _assert_backward_ran(kernel: str, q: torch.Tensor) -> None:
    """A "gluon" case is void if the Gluon backward failed to build and the Triton one ran in its place."""
    from dsv4attn.ops.sparse_attention import triton as sat

    if kernel == "gluon":
        assert sat.backward_kernel(q) == "gluon", variants.FAILED


def _forward_kernels() -> list[str]:
    """The forwards this machine runs: Triton always, Gluon where it applies (an SM90 GPU and Triton's Gluon)."""
    from dsv4attn.ops.sparse_attention import gluon_hopper

    sm90 = torch.cuda.is_available() and gluon_hopper.available(
        torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16))
    return ["triton", "gluon"] if sm90 else ["triton"]


@pytest.fixture(params=_forward_kernels())
def forward_impl(request, monkeypatch):
    """Runs a test once per forward kernel this machine has."""
    from dsv4attn.ops.sparse_attention import triton as sat

    monkeypatch.setattr(variants, "_mode", request.param)
    return request.param


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_kernel_matches_float64_reference_v4(v4_case, deterministic, forward_impl):
    (q, kv, idx, sink, grad_out), (low_out, low_lse), exact = v4_case
    assert backend.choose("sparse_attention", q.device) == "triton"
    outs = run(op(idx, deterministic=deterministic), q, kv, sink, grad_out)
    kernel = [x.double() for x in outs]
    # Both backwards form Delta from the saved bf16 output: the bf16 reference backward does the same, from the
    # kernel's own saved out and lse, so the gradient bound compares one algorithm on the same inputs.
    low = [low_out.double(), low_lse.double()] + [x.double() for x in reference_backward(
        grad_out, q, kv, Explicit(idx), sink, outs[1], V4["D"] ** -0.5, out=outs[0])]
    failures = []
    for name, k, r, e in zip(NAMES, kernel, low, exact):
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(k), finite) and torch.equal(k[~finite], e[~finite]), \
            f"{name}: inf pattern differs from float64"
        err_k = (k - e)[finite].abs().max().item()
        err_r = (r - e)[finite].abs().max().item()
        bound = (3.0 if name in GRADS else 2.0) * err_r + 1e-6 * e[finite].abs().max().item()
        if not err_k <= bound:
            failures.append(f"{name}: kernel error {err_k:.3e} > bound {bound:.3e} (reference bf16 {err_r:.3e})")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_query_norm_matches_float64_reference_v4(deterministic, forward_impl):
    """``query_norm``: the gradient of the norm's input (the Triton backward's dq epilogue; after the Gluon backward,
    the norm's backward as a pass of its own) within 3x the bf16 composition qnorm_rope -> attention's own error,
    the output rotated back by the same angles (V4's 32 pairs); out and lse as without ``query_norm``."""
    from dsv4attn.ops.qnorm_rope import qnorm_rope, qnorm_rope_stats
    from dsv4attn.rope import rope_frequencies
    x, kv, idx, sink, grad_out, _ = make_inputs(**SMALLER, seed=3)
    x = x * 3
    rope = (torch.arange(SMALLER["T"], device="cuda") * 7, rope_frequencies(64, 10000.0).cuda())

    def grads(x_, kv_, s_, in_op):
        x_, kv_, s_ = (t.detach().clone().requires_grad_(True) for t in (x_, kv_, s_))
        if in_op:
            q, rstd = qnorm_rope_stats(x_, *rope, 1e-6)
            out, lse = sparse_attention(q, kv_, idx, s_, output_rope=rope, query_norm=(x_, rstd),
                                        deterministic=deterministic)
        else:
            out, lse = sparse_attention(qnorm_rope(x_, *rope, 1e-6), kv_, idx, s_, output_rope=rope)
        out.backward(grad_out.to(out.dtype))
        torch.cuda.synchronize()
        return [t.detach().double() for t in (out, lse, x_.grad, kv_.grad, s_.grad)]

    kernel = grads(x, kv, sink, True)
    _assert_backward_ran(forward_impl, x)
    without = grads(x, kv, sink, False)
    backend.set_backend("reference")
    low = grads(x, kv, sink, False)
    exact = grads(x.double(), kv.double(), sink.double(), False)
    backend.set_backend(None)
    assert torch.equal(kernel[0], without[0]) and torch.equal(kernel[1], without[1])
    failures = []
    for name, k, r, e in zip(("out", "lse", "dx", "dkv", "d_sink"), kernel, low, exact):
        finite = torch.isfinite(e)
        err_k, err_r = (k - e)[finite].abs().max().item(), (r - e)[finite].abs().max().item()
        bound = (2.0 if name in ("out", "lse") else 3.0) * err_r + 1e-6 * e[finite].abs().max().item()
        if not err_k <= bound:
            failures.append(f"{name}: kernel error {err_k:.3e} > bound {bound:.3e} (reference bf16 {err_r:.3e})")
    assert not failures, "; ".join(failures)


# ---------------------------------------------------------------------------------------------------------------
# Determinism

@pytest.mark.parametrize("with_length", [False, True], ids=["indices", "indices+topk_length"])
@pytest.mark.parametrize("kernel", _forward_kernels())
def test_deterministic_backward_is_bitwise_repeatable_v4(with_length, kernel, monkeypatch):
    """Each backward kernel (the Triton passes; on SM90 the one-pass Gluon kernel, which the default mode runs there)
    in its deterministic mode: bitwise repeatable, and equal to its own atomic mode except for dKV's summation order
    (the Gluon and Triton kernels sum dq in different orders, so each is compared with itself)."""
    monkeypatch.setattr(variants, "_mode", "triton" if kernel == "triton" else "auto")
    q, kv, idx, sink, grad_out, length = make_inputs(**V4, seed=1)
    kwargs = dict(deterministic=True, topk_length=length if with_length else None)
    runs = [run(op(idx, **kwargs), q, kv, sink, grad_out) for _ in range(3)]
    _assert_backward_ran(kernel, q)
    assert_bitwise(runs[0], runs[1], "deterministic run 2 vs 1")
    assert_bitwise(runs[0], runs[2], "deterministic run 3 vs 1")
    # The mode changes only where dKV contributions are summed: the forward is the same; dq and d_sink have no
    # atomics in either mode; dkv agrees up to fp32 summation order, i.e. within one bf16 rounding.
    atomic = run(op(idx, deterministic=False, topk_length=kwargs["topk_length"]), q, kv, sink, grad_out)
    assert_bitwise(runs[0][:3], atomic[:3], "deterministic vs atomic", names=NAMES[:3])
    torch.testing.assert_close(runs[0][4], atomic[4], msg=lambda m: f"d_sink deterministic vs atomic: {m}")
    torch.testing.assert_close(runs[0][3].float(), atomic[3].float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("kernel", _forward_kernels())
def test_deterministic_dkv_fp32_equals_atomic_up_to_summation_order(kernel, H, monkeypatch):
    """The fp32 dKV of each kernel's deterministic mode (several row chunks: a small buffer budget; H = 128 puts
    two head blocks in each buffer row) against its atomic mode: equal up to summation order; dq bitwise."""
    from dsv4attn.ops.sparse_attention import triton as sat

    monkeypatch.setattr(variants, "_mode", "triton" if kernel == "triton" else "auto")
    # 5 chunks of rows at H = 64, 9 at H = 128 (the budget counts every head block's rows)
    monkeypatch.setattr(sat, "DETERMINISTIC_BUFFER_ELEMENTS", 1000 * V4["K"] * V4["D"])
    q, kv, idx, sink, grad_out, _ = make_inputs(**{**V4, "H": H}, seed=2)
    scale = V4["D"] ** -0.5
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    atomic = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale)
    fixed = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, deterministic=True)
    _assert_backward_ran(kernel, q)
    assert torch.equal(fixed[0], atomic[0])
    torch.testing.assert_close(fixed[2], atomic[2], rtol=1e-6, atol=1e-6)
    assert (fixed[1] - atomic[1]).abs().max().item() <= 1e-5 * atomic[1].abs().max().item()


@pytest.mark.parametrize("H", [64, 128])
def test_lse_only_triton_form_matches_float64_reference_v4(H, monkeypatch):
    """``sparse_attention_lse`` through the Triton forward kernel's LSE_ONLY form (the Gluon kernels kept out, as
    on a non-SM90 GPU): error <= 2x the reference op's own in bf16 (both against float64) + 1e-6 of the largest
    |lse|; -inf exactly where a row has no valid slot; and within the same bound of the full kernel's lse (equal but
    for the last bits: the two compiled loops contract the row statistics differently)."""
    from dsv4attn.ops import sparse_attention_lse
    from dsv4attn.ops.sparse_attention import triton as sat

    monkeypatch.setattr(variants, "_mode", "triton")
    launched = []
    real_launch = sat._launch
    monkeypatch.setattr(sat, "_launch", lambda kernel, grid, x, meta, *a, **k: launched.append(meta.get("LSE_ONLY"))
                        or real_launch(kernel, grid, x, meta, *a, **k))
    q, kv, idx, sink, _, _ = make_inputs(**{**V4, "H": H}, seed=3)
    scale = V4["D"] ** -0.5
    got = sparse_attention_lse(q, kv, idx).double()
    assert launched == [True]
    full = sat._sparse_attn_fwd(q, kv, idx, sink, scale)[1].double()
    low = sparse_attention_reference(q, kv, Explicit(idx), sink, scale)[1].double()
    exact = sparse_attention_reference(q.double(), kv.double(), Explicit(idx), sink.double(), scale)[1]
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], exact[~finite])
    err_ref = (low - exact)[finite].abs().max().item()
    bound = 2 * err_ref + 1e-6 * exact[finite].abs().max().item()
    assert (got - exact)[finite].abs().max().item() <= bound
    assert (got - full)[finite].abs().max().item() <= bound


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("H", [64, 128])
def test_triton_backward_teacher_mass_v4(H, deterministic):
    """The Triton backward's head-summed probabilities of the top-k slots (``mass_slots = (128, 512)``: the window's
    128 slots first, as the layers lay them out), the sparse indexer KL's teacher: error <= 2x the bf16 reference's
    own (both against float64, the reference given the kernel's lse) + 1e-6 of the largest mass; dq, d_sink (and
    the deterministic mode's dkv) bitwise as without it."""
    from dsv4attn.ops.sparse_attention import triton as sat

    slots = (128, 512)
    q, kv, idx, sink, grad_out, _ = make_inputs(**{**SMALLER, "H": H}, seed=9)
    scale = V4["D"] ** -0.5
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    config = sat.BWD_CONFIGS[V4["D"]]
    base = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, config=config,
                                deterministic=deterministic)
    *grads, mass = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, config=config,
                                        deterministic=deterministic, mass_slots=slots)
    assert torch.equal(grads[0], base[0]) and torch.equal(grads[2], base[2])
    if deterministic:
        assert torch.equal(grads[1], base[1])
    low = reference_backward(grad_out, q, kv, Explicit(idx), sink, lse, scale, out=out, mass_slots=slots)[3]
    exact = reference_backward(grad_out.double(), q.double(), kv.double(), Explicit(idx), sink.double(),
                               lse.double(), scale, out=out.double(), mass_slots=slots)[3]
    assert mass.shape == (SMALLER["T"], slots[1]) and mass.dtype == torch.float32
    assert exact.abs().max().item() > 1e-2
    err_k = (mass.double() - exact).abs().max().item()
    err_r = (low.double() - exact).abs().max().item()
    bound = 2 * err_r + 1e-6 * exact.abs().max().item()
    assert err_k <= bound, f"mass: kernel error {err_k:.3e} > bound {bound:.3e} (reference bf16 {err_r:.3e})"


def test_reference_backend_on_cuda_is_deterministic():
    """The reference scatters dKV with index_put_(accumulate=True) on CUDA (sorted, fixed order), not atomics."""
    backend.set_backend("reference")
    q, kv, idx, sink, grad_out, _ = make_inputs(T=512, H=8, D=64, K=256, seed=3, dtype=torch.float32)
    first, second = (run(op(idx), q, kv, sink, grad_out) for _ in range(2))
    assert_bitwise(first, second, "reference on CUDA")


# ---------------------------------------------------------------------------------------------------------------
# No host syncs, CUDA graphs, torch.compile

@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_forward_backward_has_no_host_sync_with_checks_off(deterministic):
    q, kv, idx, sink, grad_out, length = make_inputs(T=1024, H=64, D=512, K=640, seed=4)
    fn = op(idx, topk_length=length, deterministic=deterministic)
    run(fn, q, kv, sink, grad_out)                                   # compile the kernels outside the check
    q, kv, sink = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
    with dsv4attn.checks.checks(False):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = fn(q, kv, sink)
            out.backward(grad_out)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_cuda_graph_capture_and_replay_equals_eager(deterministic):
    """Forward + backward captured once with static buffers, replayed on new inputs; value checks stay *on*
    (they are skipped while capturing, which would fail on any host sync)."""
    q, kv, idx, sink, grad_out, length = make_inputs(**SMALLER, seed=5)
    static_q, static_kv, static_sink = (x.clone().requires_grad_(True) for x in (q, kv, sink))
    static_idx, static_len, static_g = idx.clone(), length.clone(), grad_out.clone()
    leaves = (static_q, static_kv, static_sink)

    def step():
        out, lse = sparse_attention(static_q, static_kv, static_idx, static_sink, topk_length=static_len,
                                    deterministic=deterministic)
        out.backward(static_g)
        return out, lse

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), dsv4attn.checks.checks(True):
        for _ in range(2):                                           # warm-up: Triton compiles, allocator settles
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with dsv4attn.checks.checks(True), torch.cuda.graph(graph):
        static_out, static_lse = step()

    for seed in (6, 7):
        q, kv, idx, sink, grad_out, length = make_inputs(**SMALLER, seed=seed)
        with torch.no_grad():
            for dst, src in ((static_q, q), (static_kv, kv), (static_sink, sink), (static_idx, idx),
                             (static_len, length), (static_g, grad_out)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_out, static_lse, static_q.grad, static_kv.grad, static_sink.grad]
        eager = run(op(idx, topk_length=length, deterministic=deterministic), q, kv, sink, grad_out)
        if deterministic:
            assert_bitwise(replayed, eager, f"replay (seed {seed}) vs eager")
        else:   # atomics: dkv only up to summation order
            assert_bitwise(replayed[:3] + replayed[4:], eager[:3] + eager[4:], f"replay (seed {seed}) vs eager",
                           names=("out", "lse", "dq", "d_sink"))
            torch.testing.assert_close(replayed[3].float(), eager[3].float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("with_length", [False, True], ids=["indices", "indices+topk_length"])
def test_torch_compile_fullgraph_equals_eager(with_length):
    q, kv, idx, sink, grad_out, length = make_inputs(**SMALLER, seed=8)
    length = length if with_length else None

    def fn(q_, kv_, s_):
        return sparse_attention(q_, kv_, idx, s_, topk_length=length, deterministic=True)

    torch._dynamo.reset()
    compiled = run(torch.compile(fn, fullgraph=True), q, kv, sink, grad_out)
    eager = run(fn, q, kv, sink, grad_out)
    assert_bitwise(compiled, eager, "compiled vs eager")
