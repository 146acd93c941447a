"""qnorm_rope (query RMSNorm + RoPE), rope_rotate (plain RoPE) and inverse_rope (output inverse RoPE): Triton
kernels vs the reference.

The reference is the layer's former code (``apply_rope(rms_norm_unweighted(x))``, ``apply_rope(x)``,
``apply_rope(.., inverse=True)``).
Kernel runs happen on the CPU through the Triton interpreter in one subprocess (``_worker``; the interpreter must be
switched on before Triton is first imported, see test_sparse_attention_triton.py), which prints its measurements as
JSON for the parametrised tests to judge. Bounds: bf16 / fp16 kernel error <= 2x (outputs) / 3x (gradients) the
error of the reference run in the same dtype, both against the float64 reference on the same rounded inputs (plus
1e-6 of the largest magnitude where the reference is exact); fp32 kernel within 1e-6 of the largest magnitude of
the fp32 reference (the current layer path). Positions come from a ragged pack (tests/packs.py) or, for the
``long`` cases, are spread up to ~10^5 with YaRN frequencies (large angles: float64 angles matter).

In-process tests cover the argument checks, the float64 fallback and the no-alias invariant
(docs/semantics.md, invariant 9.1) on the reference path; GPU tests (skipped without CUDA) run the Flash geometry:
T = 8192, H = 64, D = 512, rope_dim 64.
"""
from __future__ import annotations

import re
import json
import os

import pytest
import torch

from tests.ops.interpreter import run_worker
from tests.packs import RAGGED_R4, build_pack

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6
YARN = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0,
        "beta_slow": 1.0}


def _case(dtype, D, rope_dim, H=3, positions="pack", int32=False):
    return dict(dtype=dtype, D=D, rope_dim=rope_dim, H=H, positions=positions, int32=int32)


CASES = {f"{dt}-D{D}-rope{r}": _case(dt, D, r) for dt in ("fp32", "bf16") for D in (64, 128, 512)
         for r in (0, 16, 64)}
CASES.update({
    "fp16-D128-rope64": _case("fp16", 128, 64),
    "bf16-D512-rope64-long-int32": _case("bf16", 512, 64, H=5, positions="long", int32=True),
    "fp32-D512-rope64-long": _case("fp32", 512, 64, H=2, positions="long"),
    "bf16-D96-rope32-H1": _case("bf16", 96, 32, H=1),                 # head_dim not a power of two: masked tile
    "bf16-D512-rope64-H1-long": _case("bf16", 512, 64, H=1, positions="long"),   # the KV head's rows (rope_rows)
})
OPS = ("qnorm_rope", "rope_rotate", "inverse_rope")
NAMES = ("out", "dx")
# Tiny layers (ratio, phase, dtype) run with only these two ops on the kernels: every ratio in fp32, and float64
# (where the kernel path falls back to the reference: bitwise equal) once.
LAYER_RUNS = ((0, "sparse", torch.float32), (4, "sparse", torch.float32), (128, "sparse", torch.float32),
              (4, "sparse", torch.float64))


def _frequencies(c):
    from dsv4attn.rope import rope_frequencies
    if c["positions"] == "long":
        return rope_frequencies(c["rope_dim"], 160000.0, YARN)
    return rope_frequencies(c["rope_dim"], 10000.0)


def _inputs(c, seed):
    """x (T, H, D) with rows of very different scales, the output gradient, positions (T,) and inv_freq."""
    gen = torch.Generator().manual_seed(seed)
    pack = build_pack(RAGGED_R4, padding=3)
    T, H, D = pack.total_rows, c["H"], c["D"]
    positions = pack.row_position
    if c["positions"] == "long":
        positions = positions * 7919 + torch.randint(0, 100_000, (T,), generator=gen)
    scale = torch.exp(torch.randn(T, H, 1, generator=gen, dtype=torch.float64))
    x = (torch.randn(T, H, D, generator=gen, dtype=torch.float64) * scale).to(DTYPES[c["dtype"]])
    grad = torch.randn(T, H, D, generator=gen, dtype=torch.float64).to(DTYPES[c["dtype"]])
    return x, grad, positions.to(torch.int32 if c["int32"] else torch.int64), _frequencies(c)


def _run(fn, x, grad, positions, inv_freq):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x, positions, inv_freq)
    out.backward(grad.to(out.dtype))
    return [out.detach().to(torch.float64), x.grad.to(torch.float64)]


def _fns():
    from dsv4attn.ops.qnorm_rope import reference, triton
    return {"qnorm_rope": (lambda x, p, f: triton.qnorm_rope_triton(x, p, f, EPS),
                           lambda x, p, f: reference.qnorm_rope_reference(x, p, f, EPS)),
            "rope_rotate": (triton.rope_rotate_triton, reference.rope_rotate_reference),
            "inverse_rope": (triton.inverse_rope_triton, reference.inverse_rope_reference)}


def _public():
    """The public ops, each as ``fn(x, positions, inv_freq)``."""
    from dsv4attn.ops import inverse_rope, qnorm_rope, rope_rotate
    return {"qnorm_rope": lambda x, p, f: qnorm_rope(x, p, f, EPS), "rope_rotate": rope_rotate,
            "inverse_rope": inverse_rope}


def _compare(kernel, ref_low, exact):
    result = {}
    for name, k, r, e in zip(NAMES, kernel, ref_low, exact):
        result[name] = dict(err_kernel=(k - e).abs().max().item(), err_ref=(r - e).abs().max().item(),
                            vs_ref_low=(k - r).abs().max().item(), magnitude=e.abs().max().item(),
                            finite=bool(torch.isfinite(k).all()))
    return result


def _layer_key(ratio, phase, dtype):
    return f"r{ratio}-{phase}-{str(dtype).split('.')[-1]}"


def _layer_run(layer, x, cu, T, max_seqlen, phase):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, cu_seqlens=cu, max_seqlen=max_seqlen, phase=phase)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def _layer_checks(backend):
    """A tiny layer of each ratio with only the OPS on the (interpreted) kernels vs all reference."""
    import dsv4attn
    from tests.layers.layer_helpers import ragged_pack, randomize_

    cu, T, max_seqlen = ragged_pack()
    results = {}
    original = backend.choose
    for ratio, phase, dtype in LAYER_RUNS:
        layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio), seed=ratio).to(dtype)
        layer.train()
        x = torch.randn(T, layer.config.hidden_size, generator=torch.Generator().manual_seed(5), dtype=dtype)
        want = _layer_run(layer, x, cu, T, max_seqlen, phase)
        backend.choose = lambda op, device: ("triton" if op in OPS else original(op, device))
        try:
            got = _layer_run(layer, x, cu, T, max_seqlen, phase)
        finally:
            backend.choose = original
        results[_layer_key(ratio, phase, dtype)] = dict(
            bitwise=all(torch.equal(a, b) for a, b in zip(got, want)),
            rel_diff=max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(got, want)),
            tensors=len(want))
    return results


def _worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set): every case, printed as one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dsv4attn import backend
    from dsv4attn.ops.qnorm_rope import triton as qt

    fns = _fns()
    results = {}
    for seed, (case_id, c) in enumerate(CASES.items()):
        x, grad, positions, inv_freq = _inputs(c, seed)
        for op, (kernel, reference) in fns.items():
            results[f"{op}/{case_id}"] = _compare(
                _run(kernel, x, grad, positions, inv_freq), _run(reference, x, grad, positions, inv_freq),
                _run(reference, x.double(), grad.double(), positions, inv_freq))

    # Plumbing: registration, dispatch through the public ops, float64 fallback, no aliasing, edge shapes.
    x, grad, positions, inv_freq = _inputs(CASES["bf16-D128-rope16"], 0)
    public = _public()
    plumbing = dict(registered=all(backend.kernel(op) is getattr(qt, f"{op}_triton") for op in OPS))
    backend.set_backend("triton")
    try:
        for op in OPS:
            direct = _run(fns[op][0], x, grad, positions, inv_freq)
            plumbing[f"{op}_public_matches_direct"] = all(
                torch.equal(a, b) for a, b in zip(_run(public[op], x, grad, positions, inv_freq), direct))
            x64, g64 = x.double(), grad.double()
            plumbing[f"{op}_fp64_is_reference"] = all(torch.equal(a, b) for a, b in zip(
                _run(public[op], x64, g64, positions, inv_freq), _run(fns[op][1], x64, g64, positions, inv_freq)))
            # A strided view (heads and rows transposed twice) gives the contiguous result.
            strided = x.transpose(0, 1).contiguous().transpose(0, 1)
            plumbing[f"{op}_strided_input"] = torch.equal(public[op](strided, positions, inv_freq),
                                                          public[op](x, positions, inv_freq))
            empty = public[op](x[:0], positions[:0], inv_freq)
            plumbing[f"{op}_zero_rows"] = empty.shape == (0,) + x.shape[1:]
        for rope_dim in (0, 16):
            for op in ("rope_rotate", "inverse_rope"):
                out = public[op](x, positions, inv_freq[: rope_dim // 2])
                plumbing[f"{op}_rope{rope_dim}_new_storage"] = (
                    out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr())
        # qnorm_rope keeps its output (and a per-row rstd) for the backward, never its input: the layer's
        # q_b_proj output is then freed after the forward.
        leaf = x.detach().clone().requires_grad_(True)
        source = leaf * 1.0                                     # a non-leaf input, as q_b_proj's output is
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = public["qnorm_rope"](source, positions, inv_freq)
        storages = {t.untyped_storage().data_ptr() for t in saved}
        plumbing["qnorm_rope_saves_output_not_input"] = (
            source.untyped_storage().data_ptr() not in storages and out.untyped_storage().data_ptr() in storages)
        cos, sin = qt.rope_table(positions, inv_freq)
        opcheck = {}
        for name, op, args in (("qnorm_rope", qt.qnorm_rope_op, (x.float(), cos, sin, EPS)),
                               ("rope_rotate", qt.rope_rotate_op, (x.float(), cos, sin, True)),
                               ("rope_rotate_forward", qt.rope_rotate_op, (x.float(), cos, sin, False))):
            args = (args[0].requires_grad_(True),) + args[1:]
            try:
                torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration",
                                                             "test_faketensor"))
                opcheck[name] = "ok"
            except Exception as exc:                                   # noqa: BLE001 - reported to the test
                opcheck[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
        plumbing["opcheck"] = opcheck
    finally:
        backend.set_backend(None)
    results["plumbing"] = plumbing
    results["layer"] = _layer_checks(backend)
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    return run_worker("tests.ops.test_qnorm_rope")


def _assert_within_bounds(label, measured, dtype):
    for name, m in measured.items():
        assert m["finite"], f"{label} {name}: non-finite values"
        if dtype == "fp32":   # the current layer path, to 1e-6 of the largest magnitude
            bound = 1e-6 * m["magnitude"]
            assert m["vs_ref_low"] <= bound, (
                f"{label} {name}: differs from the fp32 reference by {m['vs_ref_low']:.3e} > {bound:.3e}")
        else:
            bound = (3.0 if name == "dx" else 2.0) * m["err_ref"] + 1e-6 * m["magnitude"]
            assert m["err_kernel"] <= bound, (
                f"{label} {name}: kernel error {m['err_kernel']:.3e} > bound {bound:.3e} (reference in "
                f"{dtype}: {m['err_ref']:.3e}, magnitude {m['magnitude']:.3e})")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_reference(interpreted, op, case_id):
    _assert_within_bounds(f"{op} {case_id}", interpreted[f"{op}/{case_id}"], CASES[case_id]["dtype"])


PLUMBING = ["registered"] + [f"{op}_{what}" for op in OPS for what in
                             ("public_matches_direct", "fp64_is_reference", "strided_input", "zero_rows")] + [
    "inverse_rope_rope0_new_storage", "inverse_rope_rope16_new_storage", "rope_rotate_rope0_new_storage",
    "rope_rotate_rope16_new_storage", "qnorm_rope_saves_output_not_input"]


@pytest.mark.parametrize("check", PLUMBING)
def test_plumbing(interpreted, check):
    assert interpreted["plumbing"][check]


@pytest.mark.parametrize("op", ["qnorm_rope", "rope_rotate", "rope_rotate_forward"])
def test_custom_op_opcheck(interpreted, op):
    assert interpreted["plumbing"]["opcheck"][op] == "ok", interpreted["plumbing"]["opcheck"][op]


@pytest.mark.parametrize("run", [_layer_key(*run) for run in LAYER_RUNS])
def test_layer_with_kernels_equals_reference_layer(interpreted, run):
    """Output, input gradient and every parameter gradient of a tiny layer: fp64 bitwise (the kernel path falls back
    to the reference), fp32 within 2e-6 of each tensor's largest magnitude (measured: <= 6.2e-7)."""
    m = interpreted["layer"][run]
    if run.endswith("float64"):
        assert m["bitwise"], m
    else:
        assert m["rel_diff"] <= 2e-6, m


# ---------------------------------------------------------------- in-process: reference path and arguments


def _former_layer_code(x, positions, inv_freq, op):
    from dsv4attn.layers.common import rms_norm_unweighted
    from dsv4attn.rope import apply_rope
    if op == "inverse_rope":
        return apply_rope(x, positions, inv_freq, inverse=True)
    if op == "rope_rotate":
        return apply_rope(x, positions, inv_freq)
    return apply_rope(rms_norm_unweighted(x, EPS), positions, inv_freq)


# Forced "triton" only for float64: other CPU tensors would reach the kernels, which need the interpreter (above).
@pytest.mark.parametrize("dtype, forced", [("fp64", "reference"), ("fp64", "triton"), ("fp32", "reference"),
                                           ("bf16", "reference")])
@pytest.mark.parametrize("op", OPS)
def test_reference_path_is_the_former_layer_code(dtype, op, forced):
    """On the CPU (and for float64 on any backend) the ops are exactly the code the layer used to run."""
    from dsv4attn import backend
    dt = {"fp64": torch.float64, **DTYPES}[dtype]
    x, grad, positions, inv_freq = _inputs(CASES["fp32-D128-rope64"], 3)
    x, grad = x.to(dt), grad.to(dt)
    backend.set_backend(forced)
    try:
        got = _run(_public()[op], x, grad, positions, inv_freq)
    finally:
        backend.set_backend(None)
    want = _run(lambda x_, p, f: _former_layer_code(x_, p, f, op), x, grad, positions, inv_freq)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("rope_dim", [0, 16])
def test_inverse_rope_never_aliases_its_input(rope_dim):
    """Invariant 9.1: a new tensor, also when no channel rotates."""
    from dsv4attn.ops import inverse_rope
    from dsv4attn.rope import rope_frequencies
    x = torch.randn(5, 2, 32)
    out = inverse_rope(x, torch.arange(5), rope_frequencies(rope_dim, 10000.0))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    out.zero_()
    assert x.abs().sum() > 0


@pytest.mark.parametrize("op", OPS)
def test_float64_gradcheck(op):
    from dsv4attn.ops import qnorm_rope
    from dsv4attn.rope import rope_frequencies
    x = torch.randn(4, 2, 12, dtype=torch.float64, requires_grad=True)
    positions, inv_freq = torch.tensor([0, 3, 1, 700]), rope_frequencies(8, 10000.0)
    fn = (lambda t: qnorm_rope(t, positions, inv_freq, 1e-3)) if op == "qnorm_rope" else (
        lambda t: _public()[op](t, positions, inv_freq))
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.randn(6, 64)), "x must be 3-D"),
    (dict(x=torch.zeros(6, 2, 64, dtype=torch.int32)), "x must have dtype"),
    (dict(positions=torch.arange(5)), r"positions must have shape \(6,\)"),
    (dict(positions=torch.arange(6.0)), "positions must have dtype"),
    (dict(inv_freq=torch.ones(2, 4, dtype=torch.float64)), "inv_freq must be 1-D"),
    (dict(inv_freq=torch.ones(40, dtype=torch.float64)), "rotates 80 channels, more than x's last dimension 64"),
], ids=["x-2d", "x-int", "positions-length", "positions-float", "inv_freq-2d", "rope-wider-than-head"])
@pytest.mark.parametrize("op", OPS)
def test_bad_arguments_name_the_argument(op, bad, message):
    args = dict(x=torch.randn(6, 2, 64), positions=torch.arange(6), inv_freq=torch.ones(8, dtype=torch.float64))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        _public()[op](args["x"], args["positions"], args["inv_freq"])


# ---------------------------------------------------------------- GPU: the Flash geometry

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FLASH = dict(T=8192, H=64, D=512, rope_dim=64)


def _flash_inputs(dtype, seed=0):
    """Flash-size x / grad on the GPU, positions of a pack of uneven documents plus capacity padding."""
    from dsv4attn.rope import rope_frequencies
    T, H, D = FLASH["T"], FLASH["H"], FLASH["D"]
    gen = torch.Generator().manual_seed(seed)
    real = T - 77
    lengths = [1, 4000, real - 4001 - 1500, 1500]
    pack = build_pack(lengths, padding=T - sum(lengths))
    scale = torch.exp(torch.randn(T, H, 1, generator=gen))
    x = (torch.randn(T, H, D, generator=gen) * scale).to("cuda", dtype)
    grad = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    return x, grad, pack.row_position.cuda(), rope_frequencies(FLASH["rope_dim"], 160000.0, YARN).cuda()


@cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("op", OPS)
def test_gpu_flash_geometry(op, dtype):
    kernel, reference = _fns()[op]
    x, grad, positions, inv_freq = _flash_inputs(DTYPES[dtype])
    got = _run(kernel, x, grad, positions, inv_freq)
    low = _run(reference, x, grad, positions, inv_freq)
    exact = _run(reference, x.double(), grad.double(), positions, inv_freq)
    measured = _compare(got, low, exact)
    del got, low, exact
    torch.cuda.empty_cache()
    _assert_within_bounds(f"{op} {dtype} T={FLASH['T']}", measured, dtype)


def _both(x, positions, inv_freq):
    from dsv4attn.ops import inverse_rope, qnorm_rope
    return inverse_rope(qnorm_rope(x, positions, inv_freq, EPS), positions, inv_freq)


@cuda
def test_gpu_no_alias_and_no_host_sync():
    """A fresh output storage; forward + backward never wait for the device (no value checks in these ops)."""
    from dsv4attn.ops import inverse_rope
    x, grad, positions, inv_freq = _flash_inputs(torch.bfloat16)
    x, grad, positions = x[:1024], grad[:1024], positions[:1024]
    out = inverse_rope(x, positions, inv_freq)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    _run(_both, x, grad, positions, inv_freq)                        # compile the kernels outside the check
    leaf = x.detach().clone().requires_grad_(True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _both(leaf, positions, inv_freq).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
def test_gpu_cuda_graph_replay_equals_eager():
    """Forward + backward captured once with static buffers, replayed on new inputs: bitwise the eager result."""
    x, grad, positions, inv_freq = _flash_inputs(torch.bfloat16)
    rows = 2048
    static_x, static_g = x[:rows].clone().requires_grad_(True), grad[:rows].clone()
    static_pos = positions[:rows].clone()

    def step():
        out = _both(static_x, static_pos, inv_freq)
        out.backward(static_g)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):                                           # warm-up: Triton compiles, allocator settles
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (1, 2):
        x, grad, _, _ = _flash_inputs(torch.bfloat16, seed=seed)
        new_pos = positions[rows:2 * rows]                           # other positions, same shape
        with torch.no_grad():
            static_x.copy_(x[:rows])
            static_g.copy_(grad[:rows])
            static_pos.copy_(new_pos)
        graph.replay()
        torch.cuda.synchronize()
        eager = _run(_both, x[:rows], grad[:rows], new_pos, inv_freq)
        assert torch.equal(static_out.double(), eager[0]) and torch.equal(static_x.grad.double(), eager[1])


@cuda
def test_gpu_torch_compile_fullgraph_equals_eager():
    """Under torch.compile the cos / sin table is generated code (float64 cos may differ in its last bit, which
    can move an fp32 rounding): equal to eager up to one bf16 rounding step."""
    x, grad, positions, inv_freq = _flash_inputs(torch.bfloat16)
    x, grad, positions = x[:512], grad[:512], positions[:512]
    torch._dynamo.reset()
    compiled = _run(torch.compile(_both, fullgraph=True), x, grad, positions, inv_freq)
    eager = _run(_both, x, grad, positions, inv_freq)
    for name, a, b in zip(NAMES, compiled, eager):
        diff = (a - b).abs().max().item()
        assert diff <= 2.0 ** -7 * b.abs().max().item(), f"{name}: compiled differs from eager by {diff:.3e}"


@pytest.mark.parametrize("eps, shown", [("small", "'small'"), (None, "None"), (-1.0, "-1.0"),
                                        (float("nan"), "nan"), (torch.tensor([1e-6, 1e-6]), "tensor")],
                         ids=["str", "none", "negative", "nan", "two-elements"])
def test_bad_eps_names_it(eps, shown):
    """float(eps) raised its own message before ('could not convert string to float'), and a negative eps gave
    NaN for every row of zeros without an error."""
    from dsv4attn.ops import qnorm_rope
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got " + re.escape(shown)):
        qnorm_rope(torch.zeros(6, 2, 64), torch.arange(6), torch.ones(8, dtype=torch.float64), eps)


@pytest.mark.parametrize("rope_dim", [0, 4])
def test_stats_and_input_grad_match_autograd_in_float64(rope_dim):
    """``qnorm_rope_stats``: qnorm_rope's output and its per-(row, head) rstd, without a graph;
    ``qnorm_rope_input_grad``: qnorm_rope's input gradient from its output and rstd (what sparse_attention's
    ``query_norm`` applies), equal to autograd's in float64."""
    from dsv4attn.ops.qnorm_rope import qnorm_rope, qnorm_rope_input_grad, qnorm_rope_stats
    from dsv4attn.rope import rope_frequencies
    pack = build_pack(RAGGED_R4, padding=2)
    T, H, D = pack.total_rows, 3, 16
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(T, H, D, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    inv_freq = rope_frequencies(rope_dim, 10000.0) if rope_dim else torch.zeros(0, dtype=torch.float64)
    q = qnorm_rope(x, pack.row_position, inv_freq, EPS)
    grad = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    q.backward(grad)
    got, rstd = qnorm_rope_stats(x, pack.row_position, inv_freq, EPS)
    assert not got.requires_grad and rstd.shape == (T, H) and rstd.dtype == torch.float64
    torch.testing.assert_close(got, q.detach(), rtol=0, atol=0)
    torch.testing.assert_close(rstd, torch.rsqrt(x.detach().pow(2).mean(-1) + EPS), rtol=1e-15, atol=0)
    dx = qnorm_rope_input_grad(grad, got, rstd, pack.row_position, inv_freq)
    torch.testing.assert_close(dx, x.grad, rtol=1e-10, atol=1e-12)
