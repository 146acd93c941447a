"""Triton sparse attention kernels (forward + backward) vs the float64 reference, on CPU via TRITON_INTERPRET=1.

The interpreter must be switched on before Triton is first imported, and pytest may already have imported it
through other test modules, so every kernel run happens in one subprocess (``_worker`` below) that sets the
variable first and prints its measurements as JSON; the parametrised tests only judge those numbers.

Bound (STYLE.md): kernel error <= 2x (out, lse) / 3x (dq, dkv, d_sink) the error of the reference run in the
same low dtype, both against the float64 reference on the same (rounded) inputs. The kernels' backward forms
Delta = rowsum(dO * out) from the saved output in its own dtype, so the low-dtype reference's backward does too,
from the same saved output and lse (``reference_backward(..., out=)`` given the kernel's forward results): the
gradient bound compares one backward algorithm with itself on the same inputs, not two roundings of the forward; fp32
must be within 1e-5 of the largest magnitude. A small floor (1e-6 of the largest magnitude) absorbs fp32 summation-order
noise where the reference's own error is ~0 (lse, exactly representable cases).

Also checked here: ``deterministic=True`` (atomic-free backward: bitwise repeatable, equal to the atomic backward
up to fp32 summation order, within the same bounds against float64; with several row chunks and head blocks) and
``topk_length`` (identical to masking the indices by hand), ``output_rope`` (the output's inverse RoPE in the
forward's epilogue, the gradient rotated as the backward loads it), and both backward layouts (``LAYOUT``:
``triton.FUSED``, ``triton.SPLIT``) at launcher level: several kv blocks per row, two head blocks,
empty rows, repeated indices, dKV in column chunks, atomic and deterministic. The same checks at V4 shapes on a
GPU are in ``test_sparse_attention_gpu.py``.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.ops.interpreter import run_worker
from tests.ops.kernel_checks import assert_error_within, low_precision_bound

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ("out", "lse", "dq", "dkv", "d_sink")
GRADS = ("dq", "dkv", "d_sink")


def _case(dtype, H, sink="randn", T=16, D=64, K=24, N=48, int32=False):
    return dict(dtype=dtype, H=H, sink=sink, T=T, D=D, K=K, N=N, int32=int32)


CASES = {
    f"{dt}-H{H}": _case(dt, H) for dt in DTYPES for H in (2, 5)
}
CASES.update({
    "bf16-H5-sink-inf": _case("bf16", 5, sink="-inf"),
    "fp32-H2-sink-inf": _case("fp32", 2, sink="-inf"),
    "bf16-H2-sink+30": _case("bf16", 2, sink="large"),
    "fp32-H5-sink+30": _case("fp32", 5, sink="large"),
    "bf16-H5-K70-multiblock": _case("bf16", 5, K=70, N=90),
    "fp32-H2-K70-multiblock-int32": _case("fp32", 2, K=70, N=90, int32=True),
    "fp32-H5-D128": _case("fp32", 5, D=128, K=40),
    # D = 512 runs the V4 default layout (BWD_CONFIGS[512]) with several kv blocks per row.
    "bf16-H5-D512-K70-multiblock": _case("bf16", 5, T=8, D=512, K=70, N=90),
    "fp32-H5-D512": _case("fp32", 5, T=6, D=512, K=40, N=50),
})
# Deterministic backward: (case, rows per buffer chunk or None for the default single chunk). H = 70 gives two head
# blocks of 64, each writing its own buffer plane.
DET_CASES = {
    "bf16-H5": ("bf16-H5", None),
    "fp32-H2-K70-multiblock-int32-chunks-of-3": ("fp32-H2-K70-multiblock-int32", 3),
    "bf16-H70-two-head-blocks-chunks-of-7": ("bf16-H70", 7),
}
CASES["bf16-H70"] = _case("bf16", 70, T=12, K=20, N=30)
TOPK_CASES = ("bf16-H5", "fp32-H2-K70-multiblock-int32")
# Backward layouts at launcher level. BLOCK_N = 16 walks K = 70 in 5 kv blocks (the last one partial); H = 70 gives
# two head blocks, the second with 6 live heads; rows 3 and T-1 are empty, slots 0 and 1 repeat an index. The
# deterministic runs use buffer chunks of LAYOUT_DET_ROWS rows (bitwise repeatability: DET_CASES, default layouts).
LAYOUT_CASES = {
    "bf16-H70-K70": _case("bf16", 70, T=5, K=70, N=90),
    "fp32-H5-D128-K70": _case("fp32", 5, T=6, D=128, K=70, N=90),
}
LAYOUTS = ("FUSED", "SPLIT")
# The output's inverse RoPE fused into the forward (``output_rope``): case -> rotated channel pairs (part of a
# 64-wide head, the V4 32 pairs of 512, every channel of a 128-wide head).
ROPE_CASES = {"bf16-H5": 16, "bf16-H5-D512-K70-multiblock": 32, "fp32-H5-D128": 64}
# query_norm (the norm's backward in the dq epilogue): the FUSED layout at D = 64, SPLIT at D = 512 (V4's 32 pairs).
QUERY_NORM_CASES = {"bf16-H5": 16, "bf16-H5-D512-K70-multiblock": 32}
LAYOUT_DET_ROWS = 3                                                   # rows per deterministic buffer chunk
MASS_SLOTS = (5, 60)                       # (offset, width) of the teacher-mass slots in the layout cases (K = 70)


def _layout_config(sa_triton, layout, D):
    config = dict(LAYOUT=getattr(sa_triton, layout), BLOCK_N=16, num_warps=4, num_stages=1, RELAXED=True)
    if layout == "SPLIT":
        config["DKV"] = dict(BLOCK_N=32, DKV_BLOCK_D=32)              # a per-launch override; dKV in column chunks
    else:
        config["DKV_BLOCK_D"] = 32                                    # the dKV tile in column chunks
    return config


def _inputs(c, seed):
    gen = torch.Generator().manual_seed(seed)
    T, H, D, K, N = c["T"], c["H"], c["D"], c["K"], c["N"]
    dt = DTYPES[c["dtype"]]
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64).to(dt)
    kv = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dt)
    grad_out = torch.randn(T, H, D, generator=gen, dtype=torch.float64).to(dt)
    sink = {"randn": torch.randn(H, generator=gen, dtype=torch.float64),
            "-inf": torch.full((H,), -math.inf, dtype=torch.float64),
            "large": torch.full((H,), 30.0, dtype=torch.float64)}[c["sink"]].float()
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[torch.rand(T, K, generator=gen) < 0.3] = -1                  # holes
    idx[:, 1] = idx[:, 0]                                             # repeated slots: each occurrence counts
    idx[0, 1] = -1
    for t in range(2, T, 5):                # rows ending early (the kernels stop at a row's last valid slot)
        idx[t, (t * 37) % (K + 1):] = -1
    idx[3] = -1                                                       # rows with no valid index
    idx[T - 1] = -1
    return q, kv, idx.to(torch.int32 if c["int32"] else torch.int64), sink, grad_out


def _run(fn, q, kv, idx, sink, grad_out):
    from dsv4attn.ops.index_sets import Explicit
    q, kv, sink = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
    D = q.shape[-1]
    out, lse = fn(q, kv, Explicit(idx), sink, D ** -0.5)
    out.backward(grad_out.to(out.dtype))
    return [x.detach().to(torch.float64) for x in (out, lse, q.grad, kv.grad, sink.grad)]


def _run_reference_low(q, kv, idx, sink, grad_out, saved):
    """The reference in the inputs' dtype: its forward's out and lse, and its backward from the kernel's saved
    ``(out, lse)`` (float64 copies of the kernel's values), forming Delta from that out as the kernels do."""
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.sparse_attention.reference import reference_backward, reference_forward
    scale = q.shape[-1] ** -0.5
    out, lse = reference_forward(q, kv, Explicit(idx), sink, scale)
    k_out, k_lse = saved[0].to(q.dtype), saved[1].float()               # exact: widened from these dtypes
    grads = reference_backward(grad_out.to(q.dtype), q, kv, Explicit(idx), sink, k_lse, scale, out=k_out)
    return [x.detach().to(torch.float64) for x in (out, lse, *grads)]


def _rope_of(c, pairs, seed):
    """(positions, inv_freq) of an output rotation over the last 2 * pairs channels: random positions < 5000."""
    positions = torch.randint(0, 5000, (c["T"],), generator=torch.Generator().manual_seed(seed))
    return positions, 10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / pairs)


def _rotated(fn, positions, inv_freq):
    """``fn`` (a sparse attention) followed by the inverse RoPE of its output, through autograd."""
    from dsv4attn.rope import apply_rope

    def run(q, kv, idx, sink, scale):
        out, lse = fn(q, kv, idx, sink, scale)
        return apply_rope(out, positions, inv_freq, inverse=True), lse
    return run


def _run_reference_low_rotated(q, kv, idx, sink, grad_out, saved, positions, inv_freq):
    """:func:`_run_reference_low` with the output rotation: the reference's output rounded, then rotated; its
    backward takes the gradient rotated forward (rounded, as the kernels do when they load it) and forms Delta from
    the kernel's saved rotated output and the incoming gradient, as the kernels' pre-pass does."""
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.sparse_attention.reference import reference_backward, reference_forward
    from dsv4attn.rope import apply_rope
    scale = q.shape[-1] ** -0.5
    out, lse = reference_forward(q, kv, Explicit(idx), sink, scale)
    out = apply_rope(out, positions, inv_freq, inverse=True)
    k_out, k_lse = saved[0].to(q.dtype), saved[1].float()
    g = grad_out.to(q.dtype)
    grads = reference_backward(apply_rope(g, positions, inv_freq), q, kv, Explicit(idx), sink, k_lse, scale,
                               out=k_out, delta_grad_out=g)
    return [x.detach().to(torch.float64) for x in (out, lse, *grads)]


def _run_public(q, kv, idx, sink, grad_out, **kwargs):
    from dsv4attn.ops import sparse_attention
    q, kv, sink = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
    out, lse = sparse_attention(q, kv, idx, sink, **kwargs)
    out.backward(grad_out.to(out.dtype))
    return [x.detach().to(torch.float64) for x in (out, lse, q.grad, kv.grad, sink.grad)]


QUERY_NORM_NAMES = ("out", "lse", "dx", "dkv", "d_sink")


def _run_query_norm(x, kv, idx, sink, grad_out, positions, inv_freq, norm_in_op, sa_triton=None):
    """(out, lse, dx, dkv, d_sink) of qnorm_rope then sparse_attention (output rotated back by the same angles):
    ``norm_in_op``: through ``query_norm`` (the attention's backward gives dx), else composed through autograd.
    ``sa_triton``: the backward as on SM90 today, the kernel's dq then the norm's backward as a pass of its own (the
    Gluon path, stood in for by the Triton kernel without its QNORM epilogue)."""
    from dsv4attn.ops import sparse_attention
    from dsv4attn.ops.qnorm_rope import qnorm_rope, qnorm_rope_stats
    x, kv, sink = (t.detach().clone().requires_grad_(True) for t in (x, kv, sink))
    rope = (positions, inv_freq)
    saved = None
    if sa_triton is not None:
        saved = sa_triton.backward_kernel, sa_triton._gluon_bwd

        def stand_in(q, kv_, idx_, grad_out_, denom2, delta, dq, dkv, scale, rope_=None, deterministic=False,
                     mass_slots=None):
            cfg = dict(sa_triton.BWD_CONFIGS[q.shape[2]])
            layout = cfg.pop("LAYOUT")
            return True, sa_triton._rows_bwd(q, kv_, idx_, grad_out_, denom2, delta, dq, dkv, scale, cfg,
                                             deterministic, layout, rope_, mass_slots)
        sa_triton.backward_kernel, sa_triton._gluon_bwd = (lambda q: "gluon"), stand_in
    try:
        if norm_in_op:
            q, rstd = qnorm_rope_stats(x, positions, inv_freq, 1e-6)
            out, lse = sparse_attention(q, kv, idx, sink, output_rope=rope, query_norm=(x, rstd))
        else:
            out, lse = sparse_attention(qnorm_rope(x, positions, inv_freq, 1e-6), kv, idx, sink, output_rope=rope)
        out.backward(grad_out.to(out.dtype))
    finally:
        if saved is not None:
            sa_triton.backward_kernel, sa_triton._gluon_bwd = saved
    return [t.detach().to(torch.float64) for t in (out, lse, x.grad, kv.grad, sink.grad)]


def _probe_grad(q, kv, idx, sink, grad_out, offset, width):
    """The gradient a (T, width) probe gets from the public op's backward (the teacher mass of slots offset ..)."""
    from dsv4attn.ops import sparse_attention
    q = q.detach().clone().requires_grad_(True)
    probe = torch.zeros(q.shape[0], width, requires_grad=True)
    out, _ = sparse_attention(q, kv, idx, sink, mass_probe=probe, mass_offset=offset)
    out.backward(grad_out.to(out.dtype))
    return probe.grad.double()


def _lengths(T, K, seed):
    length = torch.randint(0, K + 1, (T,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    length[0], length[1] = 0, K                                       # no slot at all; every slot
    return length


def _compare(kernel, ref_low, exact, names=NAMES):
    result = {}
    for name, k, r, e in zip(names, kernel, ref_low, exact):
        finite = torch.isfinite(e)
        same_pattern = bool((torch.isfinite(k) == finite).all() and (k[~finite] == e[~finite]).all())
        err_k = (k - e)[finite].abs().max().item() if finite.any() else 0.0
        err_r = (r - e)[finite].abs().max().item() if finite.any() else 0.0
        mag = e[finite].abs().max().item() if finite.any() else 0.0
        result[name] = dict(err_kernel=err_k, err_ref=err_r, magnitude=mag, same_pattern=same_pattern)
    return result


def _worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set): every case, printed as one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dsv4attn import backend
    from dsv4attn.ops import sparse_attention
    from dsv4attn.ops.sparse_attention import triton as sa_triton
    from dsv4attn.ops.sparse_attention.reference import reference_backward, sparse_attention_reference

    results, kernel_outputs = {}, {}
    for seed, (case_id, c) in enumerate(CASES.items()):
        q, kv, idx, sink, grad_out = _inputs(c, seed)
        # The reference turns (empty row, sink = -inf) into 0/0; a sink of -1e30 has identical semantics (it adds
        # exactly 0 to every denominator) and keeps the oracle finite. The kernel gets the true -inf.
        ref_sink = sink.masked_fill(sink == -math.inf, -1e30)
        kernel = kernel_outputs[case_id] = _run(sa_triton.sparse_attention_triton, q, kv, idx, sink, grad_out)
        ref_low = _run_reference_low(q, kv, idx, ref_sink, grad_out, kernel[:2])
        exact = _run(sparse_attention_reference, q.double(), kv.double(), idx, ref_sink.double(), grad_out.double())
        results[case_id] = _compare(kernel, ref_low, exact)

    backend.set_backend("triton")
    results["det"] = {}
    for det_id, (case_id, rows) in DET_CASES.items():
        c = CASES[case_id]
        q, kv, idx, sink, grad_out = _inputs(c, list(CASES).index(case_id))
        ref_sink = sink.masked_fill(sink == -math.inf, -1e30)
        saved = sa_triton.DETERMINISTIC_BUFFER_ELEMENTS
        if rows is not None:
            num_hb = -(-c["H"] // sa_triton._block_h(c["H"]))
            sa_triton.DETERMINISTIC_BUFFER_ELEMENTS = rows * num_hb * c["K"] * c["D"]
        first = _run_public(q, kv, idx, sink, grad_out, deterministic=True)
        second = _run_public(q, kv, idx, sink, grad_out, deterministic=True)
        # Launcher level, fp32 dkv before the cast: atomic vs deterministic differ only in summation order.
        scale = c["D"] ** -0.5
        idx32 = idx.to(torch.int32)
        out, lse = first[0].to(q.dtype), first[1].float()             # exactly the forward's (were widened)
        atomic = sa_triton._sparse_attn_bwd(q, kv, idx32, sink, out, lse, grad_out, scale)
        fixed = sa_triton._sparse_attn_bwd(q, kv, idx32, sink, out, lse, grad_out, scale, deterministic=True)
        sa_triton.DETERMINISTIC_BUFFER_ELEMENTS = saved
        ref_low = _run_reference_low(q, kv, idx, ref_sink, grad_out, first[:2])
        exact = _run(sparse_attention_reference, q.double(), kv.double(), idx, ref_sink.double(), grad_out.double())
        results["det"][det_id] = dict(
            bitwise_repeatable=all(torch.equal(a, b) for a, b in zip(first, second)),
            dq_dsink_bitwise_as_atomic=torch.equal(atomic[0], fixed[0]) and torch.equal(atomic[2], fixed[2]),
            dkv_vs_atomic=(fixed[1] - atomic[1]).abs().max().item(),
            dkv_magnitude=atomic[1].abs().max().item(),
            bounds=_compare(first, ref_low, exact),
        )

    results["topk"] = {}
    for case_id in TOPK_CASES:
        q, kv, idx, sink, grad_out = _inputs(CASES[case_id], list(CASES).index(case_id))
        length = _lengths(idx.shape[0], idx.shape[1], 7)
        masked = torch.where(torch.arange(idx.shape[1])[None, :] < length[:, None], idx, -1)
        with_length = _run_public(q, kv, idx, sink, grad_out, topk_length=length)
        by_hand = _run_public(q, kv, masked, sink, grad_out)
        ref_low = _run_reference_low(q, kv, masked, sink, grad_out, with_length[:2])
        exact = _run(sparse_attention_reference, q.double(), kv.double(), masked, sink.double(), grad_out.double())
        results["topk"][case_id] = dict(
            equals_masked_indices=all(torch.equal(a, b) for a, b in zip(with_length, by_hand)),
            bounds=_compare(with_length, ref_low, exact),
        )
    results["rope"] = {}
    for case_id, pairs in ROPE_CASES.items():
        c = CASES[case_id]
        q, kv, idx, sink, grad_out = _inputs(c, list(CASES).index(case_id))
        positions, inv_freq = _rope_of(c, pairs, 3)
        fused = _run_public(q, kv, idx, sink, grad_out, output_rope=(positions, inv_freq))
        fixed = _run_public(q, kv, idx, sink, grad_out, output_rope=(positions, inv_freq), deterministic=True)
        ref_low = _run_reference_low_rotated(q, kv, idx, sink, grad_out, fused[:2], positions, inv_freq)
        exact = _run(_rotated(sparse_attention_reference, positions, inv_freq), q.double(), kv.double(), idx,
                     sink.double(), grad_out.double())
        results["rope"][case_id] = dict(bounds=_compare(fused, ref_low, exact),
                                        deterministic_bounds=_compare(fixed, ref_low, exact))
    results["query_norm"] = {}
    for case_id, pairs in QUERY_NORM_CASES.items():
        c = CASES[case_id]
        x, kv, idx, sink, grad_out = _inputs(c, 50 + list(CASES).index(case_id))
        x = x * 3                                                   # rms 3: the norm matters
        positions, inv_freq = _rope_of(c, pairs, 7)
        fused = _run_query_norm(x, kv, idx, sink, grad_out, positions, inv_freq, True)
        after = _run_query_norm(x, kv, idx, sink, grad_out, positions, inv_freq, True, sa_triton=sa_triton)
        backend.set_backend("reference")
        ref_low = _run_query_norm(x, kv, idx, sink, grad_out, positions, inv_freq, False)
        exact = _run_query_norm(x.double(), kv.double(), idx, sink.double(), grad_out.double(), positions, inv_freq,
                                False)
        backend.set_backend("triton")
        results["query_norm"][case_id] = dict(bounds=_compare(fused, ref_low, exact, names=QUERY_NORM_NAMES),
                                              after_bounds=_compare(after, ref_low, exact, names=QUERY_NORM_NAMES),
                                              out_as_without=torch.equal(fused[0], after[0]))
    # The forward in value-column slices (BLOCK_DV < D, each program rotates its own slice), fp32 against float64.
    from dsv4attn.ops.index_sets import Explicit
    c = CASES["fp32-H5-D128"]
    q, kv, idx, sink, _ = _inputs(c, list(CASES).index("fp32-H5-D128"))
    sliced = dict(BLOCK_N=16, BLOCK_DK=32, BLOCK_DV=32, num_warps=4, num_stages=1)
    results["rope_slices"] = {}
    for pairs in (24, 64):
        positions, inv_freq = _rope_of(c, pairs, 5)
        out, _ = sa_triton._sparse_attn_fwd(q, kv, idx.to(torch.int32), sink, c["D"] ** -0.5, sliced,
                                            rope=sa_triton.rope_tables(positions, inv_freq))
        want = _rotated(sparse_attention_reference, positions, inv_freq)(
            q.double(), kv.double(), Explicit(idx), sink.double(), c["D"] ** -0.5)[0]
        results["rope_slices"][str(pairs)] = (out.double() - want).abs().max().item() / want.abs().max().item()
    backend.set_backend(None)

    results["layouts"], results["mass"] = {}, {}
    saved = sa_triton.DETERMINISTIC_BUFFER_ELEMENTS
    from dsv4attn.ops.sparse_attention.reference import reference_backward, reference_forward
    for case_id, c in LAYOUT_CASES.items():
        q, kv, idx, sink, grad_out = _inputs(c, 100 + list(LAYOUT_CASES).index(case_id))
        idx32, scale = idx.to(torch.int32), c["D"] ** -0.5
        out, lse = sa_triton._sparse_attn_fwd(q, kv, idx32, sink, scale)
        ref_low = _run_reference_low(q, kv, idx, sink, grad_out, (out.double(), lse.double()))[2:]
        exact = _run(sparse_attention_reference, q.double(), kv.double(), idx, sink.double(), grad_out.double())[2:]
        num_hb = -(-c["H"] // sa_triton._block_h(c["H"]))
        for layout in LAYOUTS:
            config = _layout_config(sa_triton, layout, c["D"])

            def grads(deterministic):
                dq, dkv, d_sink = sa_triton._sparse_attn_bwd(q, kv, idx32, sink, out, lse, grad_out, scale,
                                                             dict(config), deterministic=deterministic)
                return [dq.double(), dkv.double(), d_sink.double()], dkv.to(kv.dtype).double()

            atomic, atomic_dkv_cast = grads(False)
            sa_triton.DETERMINISTIC_BUFFER_ELEMENTS = LAYOUT_DET_ROWS * num_hb * c["K"] * c["D"]
            fixed, _ = grads(True)
            sa_triton.DETERMINISTIC_BUFFER_ELEMENTS = saved
            results["layouts"][f"{case_id}-{layout}"] = dict(
                bounds=_compare([atomic[0], atomic_dkv_cast, atomic[2]], ref_low, exact, names=GRADS),
                dq_dsink_bitwise_as_atomic=torch.equal(atomic[0], fixed[0]) and torch.equal(atomic[2], fixed[2]),
                dkv_vs_atomic=(fixed[1] - atomic[1]).abs().max().item(),
                dkv_magnitude=atomic[1].abs().max().item(),
            )
            # The teacher mass of slots MASS_SLOTS (the launch that forms dq stores it): against the reference's
            # in the inputs' dtype (from the kernel's lse) and in float64; the gradients stay those without it.
            for deterministic in (False, True):
                sa_triton.DETERMINISTIC_BUFFER_ELEMENTS = LAYOUT_DET_ROWS * num_hb * c["K"] * c["D"]
                *with_mass, mass = sa_triton._sparse_attn_bwd(q, kv, idx32, sink, out, lse, grad_out, scale,
                                                              dict(config), deterministic=deterministic,
                                                              mass_slots=MASS_SLOTS)
                sa_triton.DETERMINISTIC_BUFFER_ELEMENTS = saved
                low = reference_backward(grad_out, q, kv, Explicit(idx), sink, lse, scale, mass_slots=MASS_SLOTS)
                exact_lse = reference_forward(q.double(), kv.double(), Explicit(idx), sink.double(), scale)[1]
                want = reference_backward(grad_out.double(), q.double(), kv.double(), Explicit(idx), sink.double(),
                                          exact_lse, scale, mass_slots=MASS_SLOTS)
                base = atomic if not deterministic else fixed
                results["mass"][f"{case_id}-{layout}-{'det' if deterministic else 'atomic'}"] = dict(
                    bounds=_compare([mass.double()], [low[3].double()], [want[3]], names=("mass",)),
                    dq_dsink_unchanged=torch.equal(with_mass[0].double(), base[0])
                    and torch.equal(with_mass[2].double(), base[2])
                    # dkv too where it is bitwise repeatable (the deterministic mode's fixed order)
                    and (not deterministic or torch.equal(with_mass[1].double(), base[1])),
                    real=mass.abs().max().item() > 1e-3)

    # Plumbing: registration, dispatch through the public op, and the documented fp64 fallback.
    case_id = "bf16-H5"
    q, kv, idx, sink, grad_out = _inputs(CASES[case_id], list(CASES).index(case_id))
    backend.set_backend("triton")
    public = _run(lambda q_, kv_, ix, s_, sc: sparse_attention(q_, kv_, ix, s_, sc), q, kv, idx, sink, grad_out)
    backend.set_backend(None)
    direct = kernel_outputs[case_id]
    q64, kv64, s64, g64 = q.double(), kv.double(), sink.double(), grad_out.double()
    fb = _run(sa_triton.sparse_attention_triton, q64, kv64, idx, s64, g64)
    ref = _run(sparse_attention_reference, q64, kv64, idx, s64, g64)
    # A lazy index set (window + every visible compressed entry) through the public op on the Triton backend,
    # materialised in several chunks of query rows (tiny chunk budget): equals the one-shot tensor path bitwise.
    from dsv4attn.ops import index_sets
    from tests.packs import build_pack
    pack = build_pack([5, 0, 37, 3, 60], padding=3)
    lay = pack.compressed(4)
    T, H, D = pack.total_rows, 4, 64
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(T, H, D, generator=gen)
    kv = torch.randn(T + lay.capacity, D, generator=gen)
    sink, g = torch.randn(H, generator=gen), torch.randn(T, H, D, generator=gen)
    lazy = index_sets.Concat(index_sets.Window(pack, 8), index_sets.VisibleCompressed(lay, T, offset=T))
    backend.set_backend("triton")
    one_shot = _run_public(q, kv, lazy.materialize().to(torch.int32), sink, g)
    saved_budget = index_sets.CHUNK_BUDGET["cpu"]
    index_sets.CHUNK_BUDGET["cpu"] = 7 * lazy.width                   # 7 query rows per chunk
    try:
        chunked = _run_public(q, kv, lazy, sink, g)
    finally:
        index_sets.CHUNK_BUDGET["cpu"] = saved_budget
    # The same with the output rotation (positions of the pack's rows, 8 of the 32 pairs of a 64-wide head).
    rope = (pack.row_position, 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8))
    one_shot_rope = _run_public(q, kv, lazy.materialize().to(torch.int32), sink, g, output_rope=rope)
    index_sets.CHUNK_BUDGET["cpu"] = 7 * lazy.width
    try:
        chunked_rope = _run_public(q, kv, lazy, sink, g, output_rope=rope)
    finally:
        index_sets.CHUNK_BUDGET["cpu"] = saved_budget
    # The teacher-mass probe through the public op: the top-k part of the set (past the window's 8 slots), one shot
    # and in chunks of 7 rows (the probe split alike), against the float64 reference's mass.
    mass_one_shot = _probe_grad(q, kv, lazy.materialize().to(torch.int32), sink, g, 8, lazy.width - 8)
    index_sets.CHUNK_BUDGET["cpu"] = 7 * lazy.width
    try:
        mass_chunked = _probe_grad(q, kv, lazy, sink, g, 8, lazy.width - 8)
    finally:
        index_sets.CHUNK_BUDGET["cpu"] = saved_budget
    lse64 = sparse_attention_reference(q.double(), kv.double(), lazy, sink.double(), D ** -0.5)[1]
    mass64 = reference_backward(g.double(), q.double(), kv.double(), lazy, sink.double(), lse64, D ** -0.5,
                                mass_slots=(8, lazy.width - 8))[3]
    # Every slot empty and a kv with no rows: zeros, -inf lse, zero gradients (the kernel must not read kv).
    empty = _run_public(q[:5], kv[:0], torch.full((5, 3), -1, dtype=torch.int32), sink, g[:5])
    # The lse alone (sparse_attention_lse: the forward kernel's LSE_ONLY form here, no Gluon on the CPU), lazy and
    # chunked: bit for bit the full forward's lse.
    from dsv4attn.ops import sparse_attention_lse
    index_sets.CHUNK_BUDGET["cpu"] = 7 * lazy.width
    try:
        lse_alone = sparse_attention_lse(q, kv, lazy)
    finally:
        index_sets.CHUNK_BUDGET["cpu"] = saved_budget
    lse_empty = sparse_attention_lse(q[:5], kv[:0], torch.full((5, 3), -1, dtype=torch.int32))
    backend.set_backend(None)
    results["chunked_index_set"] = dict(
        lse_alone_bitwise=torch.equal(lse_alone.double(), one_shot[1]) and bool(torch.isneginf(lse_empty).all()),
        equals_one_shot=all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(chunked, one_shot)),
        out_and_lse_bitwise=torch.equal(chunked[0], one_shot[0]) and torch.equal(chunked[1], one_shot[1]),
        rotated_equals_one_shot=all(torch.allclose(a, b, rtol=1e-6, atol=1e-6)
                                    for a, b in zip(chunked_rope, one_shot_rope)),
        mass_probe=torch.equal(mass_chunked, mass_one_shot) and mass64.abs().max().item() > 0.1
        and (mass_one_shot - mass64).abs().max().item() <= 1e-5 * mass64.abs().max().item(),
        empty_kv_ok=bool((empty[0] == 0).all() and torch.isneginf(empty[1]).all() and (empty[2] == 0).all()
                         and empty[3].shape == (0, D)),
    )
    # The one-pass GPU backward's Delta pre-pass: rowsum(dO * out) in fp32 from bf16 rows, ragged row counts.
    gen = torch.Generator().manual_seed(9)
    deltas = []
    for T_, H_, D_ in ((7, 5, 64), (3, 64, 512), (0, 4, 128)):
        o = torch.randn(T_, H_, D_, generator=gen).to(torch.bfloat16)
        g_ = torch.randn(T_, H_, D_, generator=gen).to(torch.bfloat16)
        got = sa_triton._delta_from_out(o, g_)
        want = (o.double() * g_.double()).sum(-1)
        deltas.append(got.dtype == torch.float32 and got.shape == (T_, H_)
                      and bool(((got.double() - want).abs() <= 1e-5 * (1 + want.abs())).all()))
    results["delta_from_out"] = all(deltas)
    # NaN in one query row (value checks off): that row's out and lse are NaN, as in the reference; others finite.
    q_nan = torch.randn(6, 4, 64, generator=gen).to(torch.bfloat16)
    q_nan[2, 1, 5] = float("nan")
    kv_n = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    idx_n = torch.randint(0, 20, (6, 8), generator=gen, dtype=torch.int32)
    out_n, lse_n = sa_triton._sparse_attn_fwd(q_nan, kv_n, idx_n, torch.zeros(4), 64 ** -0.5)
    rows_ok = torch.ones(6, dtype=torch.bool)
    rows_ok[2] = False
    results["nan_propagates"] = bool(torch.isnan(out_n[2, 1]).all() and torch.isnan(lse_n[2, 1])
                                     and torch.isfinite(out_n[rows_ok]).all() and torch.isfinite(lse_n[rows_ok]).all())
    results["plumbing"] = dict(
        registered="sparse_attention" in backend.registered_kernels()
        and backend.kernel("sparse_attention") is sa_triton.sparse_attention_triton,
        public_matches_direct=all(torch.equal(a, b) for a, b in zip(public, direct)),
        fp64_fallback_is_reference=all(torch.equal(a, b) for a, b in zip(fb, ref)),
    )
    print("RESULTS " + json.dumps(results))


def test_delta_from_out_prepass(interpreted):
    assert interpreted["delta_from_out"]


def test_nan_in_q_propagates_to_out_and_lse(interpreted):
    assert interpreted["nan_propagates"]


@pytest.fixture(scope="module")
def interpreted():
    return run_worker("tests.ops.test_sparse_attention_triton")


def _assert_within_bounds(case_id, measured, low_precision):
    for name, m in measured.items():
        assert m["same_pattern"], f"{case_id} {name}: NaN/inf pattern differs from the float64 reference"
        if low_precision:
            bound = low_precision_bound(m, 3.0 if name in GRADS + ("dx",) else 2.0)
        else:
            bound = 1e-5 * max(m["magnitude"], 1e-30)
        assert_error_within(f"{case_id} {name}", m, bound)


@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_float64_reference(interpreted, case_id):
    _assert_within_bounds(case_id, interpreted[case_id], CASES[case_id]["dtype"] != "fp32")


@pytest.mark.parametrize("det_id", list(DET_CASES))
def test_deterministic_backward(interpreted, det_id):
    m = interpreted["det"][det_id]
    assert m["bitwise_repeatable"], f"{det_id}: two deterministic runs differ"
    assert m["dq_dsink_bitwise_as_atomic"], f"{det_id}: dq / d_sink must not depend on the mode"
    assert m["dkv_vs_atomic"] <= 1e-5 * max(m["dkv_magnitude"], 1e-30), (
        f"{det_id}: fp32 dkv differs from the atomic backward by {m['dkv_vs_atomic']:.3e} "
        f"(magnitude {m['dkv_magnitude']:.3e}): more than summation order")
    case_id = DET_CASES[det_id][0]
    _assert_within_bounds(det_id, m["bounds"], CASES[case_id]["dtype"] != "fp32")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case_id", list(LAYOUT_CASES))
def test_backward_layout(interpreted, case_id, layout):
    m = interpreted["layouts"][f"{case_id}-{layout}"]
    _assert_within_bounds(f"{case_id} {layout}", m["bounds"], LAYOUT_CASES[case_id]["dtype"] != "fp32")
    assert m["dq_dsink_bitwise_as_atomic"], f"{case_id} {layout}: dq / d_sink must not depend on the mode"
    assert m["dkv_vs_atomic"] <= 1e-5 * max(m["dkv_magnitude"], 1e-30), (
        f"{case_id} {layout}: fp32 dkv differs from the atomic backward by {m['dkv_vs_atomic']:.3e} "
        f"(magnitude {m['dkv_magnitude']:.3e}): more than summation order")


@pytest.mark.parametrize("kind", ["atomic", "det"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case_id", list(LAYOUT_CASES))
def test_backward_teacher_mass(interpreted, case_id, layout, kind):
    """The Triton backward's head-summed probabilities of a slot range (``mass_slots``, the sparse indexer KL's
    teacher mass) within 2x the reference's own error in the inputs' dtype against float64; dq and d_sink as without
    it."""
    m = interpreted["mass"][f"{case_id}-{layout}-{kind}"]
    assert m["real"] and m["dq_dsink_unchanged"], m
    _assert_within_bounds(f"{case_id} {layout} {kind} mass", m["bounds"], LAYOUT_CASES[case_id]["dtype"] != "fp32")


def test_backward_teacher_mass_is_checked_and_reaches_the_gluon_launch(monkeypatch):
    """A slot range outside idx raises (as the reference does) before any kernel runs, on the Triton and the Gluon
    path; a valid one reaches the Gluon backward's launch, whose mass is returned (CPU tensors: the launch and the
    Delta pre-pass stubbed)."""
    from dsv4attn.ops.sparse_attention import gluon_hopper_bwd, triton as sa_triton
    T, H, D, K = 3, 2, 64, 8
    q, g = torch.randn(T, H, D), torch.randn(T, H, D)
    kv, idx = torch.randn(5, D), torch.randint(-1, 5, (T, K), dtype=torch.int32)
    args = (q, kv, idx, torch.zeros(H), torch.randn(T, H, D), torch.zeros(T, H), g, D ** -0.5)
    launched = []

    def stub(*a, mass_slots=None, **k):
        launched.append(mass_slots)
        return torch.full((T, mass_slots[1]), 0.5)
    monkeypatch.setattr(gluon_hopper_bwd, "launch", stub)
    monkeypatch.setattr(sa_triton, "_delta_from_out", lambda out, grad: torch.zeros(out.shape[:2]))  # a CPU kernel
    for kernel in ("triton", "gluon"):
        monkeypatch.setattr(sa_triton, "backward_kernel", lambda q_: kernel)
        for slots in ((4, 5), (-1, 3), (0, -1)):
            with pytest.raises(ValueError, match=r"mass_slots \(offset, width\) must lie within the 8 slots of the "
                                                 r"index set, got \(" + ", ".join(map(str, slots)) + r"\)"):
                sa_triton._sparse_attn_bwd(*args, mass_slots=slots)
    assert not launched
    *_, mass = sa_triton._sparse_attn_bwd(*args, mass_slots=(2, 6))
    assert launched == [(2, 6)] and torch.equal(mass, torch.full((T, 6), 0.5))


@pytest.mark.parametrize("case_id", TOPK_CASES)
def test_topk_length(interpreted, case_id):
    m = interpreted["topk"][case_id]
    assert m["equals_masked_indices"], f"{case_id}: topk_length differs from masking the indices by hand"
    _assert_within_bounds(case_id, m["bounds"], CASES[case_id]["dtype"] != "fp32")


@pytest.mark.parametrize("check", ["registered", "public_matches_direct", "fp64_fallback_is_reference"])
def test_plumbing(interpreted, check):
    assert interpreted["plumbing"][check]


@pytest.mark.parametrize("case_id", list(ROPE_CASES))
def test_output_rotation_matches_float64_reference(interpreted, case_id):
    m = interpreted["rope"][case_id]
    _assert_within_bounds(f"{case_id} output_rope", m["bounds"], CASES[case_id]["dtype"] != "fp32")
    _assert_within_bounds(f"{case_id} output_rope deterministic", m["deterministic_bounds"],
                          CASES[case_id]["dtype"] != "fp32")


@pytest.mark.parametrize("case_id", list(QUERY_NORM_CASES))
def test_query_norm_matches_float64_reference(interpreted, case_id):
    """``query_norm``: the gradient of the norm's input from the backward kernel's dq epilogue (and, as on SM90,
    from the norm's backward as a pass after the kernel's dq) within the bounds of the low-precision composition
    qnorm_rope -> sparse_attention; the forward is the plain one."""
    m = interpreted["query_norm"][case_id]
    low = CASES[case_id]["dtype"] != "fp32"
    _assert_within_bounds(f"{case_id} query_norm", m["bounds"], low)
    _assert_within_bounds(f"{case_id} query_norm, norm backward after the kernel", m["after_bounds"], low)
    assert m["out_as_without"]


@pytest.mark.parametrize("pairs", ["24", "64"])
def test_output_rotation_in_value_column_slices(interpreted, pairs):
    assert interpreted["rope_slices"][pairs] <= 1e-5, interpreted["rope_slices"]


@pytest.mark.parametrize("check", ["equals_one_shot", "out_and_lse_bitwise", "rotated_equals_one_shot",
                                   "empty_kv_ok", "lse_alone_bitwise", "mass_probe"])
def test_index_set_chunks_and_empty_kv(interpreted, check):
    assert interpreted["chunked_index_set"][check], interpreted["chunked_index_set"]
