"""Triton compressor pooling (forward + backward) vs the float64 reference: CPU interpreter and, with CUDA, V4 shapes.

The interpreter (TRITON_INTERPRET=1) must be on before Triton is first imported, and pytest may already have
imported Triton through other test modules, so every interpreted kernel run happens in one subprocess
(``_worker``) that prints its measurements as JSON; the parametrised tests only judge those numbers.

Bounds, every tensor (out, dkv, dgate, d_bias) measured as the max abs error against the float64 reference run on
the same rounded inputs:
* fp32 inputs: error <= 2e-6 x the largest magnitude (fp32 rounding of O(1) sums over <= 128 slots is ~1e-7);
* bf16 / fp16 inputs: error <= 2x (out) / 3x (grads) the error of the reference run in the same dtype, plus a
  floor of 1e-6 x the largest magnitude (1e-5 on the GPU, where d_bias sums 8192 entries). The floor matters for
  d_bias only: both compute it in fp32, in different orders, so its error is fp32 summation noise.
Packs are random and ragged (tests/packs.py: a length-1 and an empty document, tails shorter than the ratio,
capacity padding); ratio 4 at d in {16, 64} (the tiny config's head_dim is 64), ratio 128 at d = 16.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from tests.ops.interpreter import run_worker
from tests.ops.kernel_checks import assert_error_within, low_precision_bound

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ("out", "dkv", "dgate", "d_bias")

# Small tiles that exercise the loops the default tiles skip at these sizes: several entry blocks per backward
# group and several groups (ratio 4), 16 slot chunks of 8 (ratio 128), and ratio 128 without saved statistics.
SMALL_TILES = {
    "r4-blocks-of-2-3-groups": (4, dict(fwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=16, num_warps=1),
                                        bwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=16, MAX_GROUPS=3, num_warps=1))),
    "r128-chunks-of-8": (128, dict(fwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=16, num_warps=1),
                                   bwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=16, MAX_GROUPS=2, num_warps=1))),
    "r128-recompute-one-chunk": (128, dict(fwd=dict(BLOCK_E=1, CHUNK=32, BLOCK_D=16, num_warps=1),
                                           bwd=dict(BLOCK_E=1, CHUNK=128, BLOCK_D=16, MAX_GROUPS=4, num_warps=1))),
    # four channel blocks per entry block, the grid in channels-first order
    "r4-channels-first": (4, dict(fwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=16, num_warps=1, CHANNELS_FIRST=True),
                                  bwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=16, MAX_GROUPS=3, num_warps=1))),
}


def _case(ratio, d, dtype, seed, docs=6, max_len=None, padding=5, tiles=None, shuffle=False):
    return dict(ratio=ratio, d=d, dtype=dtype, seed=seed, docs=docs, max_len=max_len or 3 * ratio + 3,
                padding=padding, tiles=tiles, shuffle=shuffle)


CASES = {
    "r4-d16-fp32": _case(4, 16, "fp32", 1),
    "r4-d16-bf16": _case(4, 16, "bf16", 2),
    "r4-d64-fp32": _case(4, 64, "fp32", 3),
    "r4-d64-bf16": _case(4, 64, "bf16", 4),
    "r4-d16-fp16": _case(4, 16, "fp16", 5),
    "r4-d16-bf16-no-padding": _case(4, 16, "bf16", 6, padding=0),
    "r128-d16-fp32": _case(128, 16, "fp32", 7, docs=4, max_len=300),
    "r128-d16-bf16": _case(128, 16, "bf16", 8, docs=4, max_len=300),
    "r4-d16-bf16-shuffled-entries": _case(4, 16, "bf16", 9, shuffle=True),
    "r128-d16-fp32-shuffled-entries": _case(128, 16, "fp32", 10, docs=4, max_len=300, shuffle=True),
    "r4-d16-bf16-small-tiles": _case(4, 16, "bf16", 11, docs=10, tiles="r4-blocks-of-2-3-groups"),
    "r4-d16-fp32-small-tiles": _case(4, 16, "fp32", 12, docs=10, tiles="r4-blocks-of-2-3-groups"),
    "r128-d16-bf16-chunks-of-8": _case(128, 16, "bf16", 13, docs=5, max_len=400, tiles="r128-chunks-of-8"),
    "r128-d16-fp32-recompute": _case(128, 16, "fp32", 14, docs=4, max_len=300, tiles="r128-recompute-one-chunk"),
    "r4-d64-bf16-channels-first": _case(4, 64, "bf16", 15, docs=8, tiles="r4-channels-first"),
}


def _pack_and_layout(c):
    from tests.packs import build_pack, random_lengths
    gen = torch.Generator().manual_seed(c["seed"])
    r = c["ratio"]
    # Always: a length-1 and an empty document, a tail shorter than the ratio, exactly one group, one group + 1.
    lengths = random_lengths(gen, c["docs"], c["max_len"], must=(1, 0, r - 1, r, r + 1))
    layout = build_pack(lengths, c["padding"]).compressed(r)
    if c["shuffle"]:
        # Entries in a random order with the padding entries interleaved (context-parallel layouts do that): the
        # kernels must not assume document order. The reference takes any order, too.
        perm = torch.randperm(layout.capacity, generator=gen)
        layout = dataclasses.replace(layout, entry_doc=layout.entry_doc[perm], entry_index=layout.entry_index[perm],
                                     entry_first_row=layout.entry_first_row[perm],
                                     entry_is_real=layout.entry_is_real[perm])
    return lengths, layout


def _inputs(c, layout, T):
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    dt = DTYPES[c["dtype"]]
    width = (2 if c["ratio"] == 4 else 1) * c["d"]
    kv = torch.randn(T, width, generator=gen, dtype=torch.float64).to(dt)
    gate = (2.0 * torch.randn(T, width, generator=gen, dtype=torch.float64)).to(dt)
    bias = torch.randn(c["ratio"], width, generator=gen, dtype=torch.float64).float()
    grad_out = torch.randn(layout.capacity, c["d"], generator=gen, dtype=torch.float64).to(dt)
    return kv, gate, bias, grad_out


def _run(fn, kv, gate, bias, grad_out, layout):
    kv, gate, bias = (x.detach().clone().requires_grad_(True) for x in (kv, gate, bias))
    out = fn(kv, gate, bias, layout)
    out.backward(grad_out.to(out.dtype))
    return [x.detach().to(torch.float64) for x in (out, kv.grad, gate.grad, bias.grad)]


def _compare(kernel, ref_low, exact):
    result = {}
    for name, k, r, e in zip(NAMES, kernel, ref_low, exact):
        result[name] = dict(err_kernel=(k - e).abs().max().item() if e.numel() else 0.0,
                            err_ref=(r - e).abs().max().item() if e.numel() else 0.0,
                            magnitude=e.abs().max().item() if e.numel() else 0.0,
                            finite=bool(torch.isfinite(k).all()),
                            zeros_exact=bool((k[e == 0] == 0).all()))
    return result


def _worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set): every case, printed as one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dsv4attn import backend
    from dsv4attn.ops import compress_pool
    from dsv4attn.ops.compressor import triton as ct
    from dsv4attn.ops.compressor.reference import compress_pool_reference

    # Poison fresh buffers (outputs, gradients, partial sums): every element the kernels leave unwritten would
    # show up as NaN (the CPU allocator often hands out zeroed pages).
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(make):
        def make_poisoned(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(math.nan) if t.is_floating_point() else t
        return make_poisoned

    torch.empty, torch.empty_like = poisoned(empty), poisoned(empty_like)
    results, kernel_outputs = {}, {}
    for case_id, c in CASES.items():
        lengths, layout = _pack_and_layout(c)
        kv, gate, bias, grad_out = _inputs(c, layout, sum(lengths) + c["padding"])
        saved = dict(ct.CONFIGS)
        if c["tiles"]:
            ratio, tiles = SMALL_TILES[c["tiles"]]
            ct.CONFIGS[ratio] = tiles
        kernel = kernel_outputs[case_id] = _run(ct.compress_pool_triton, kv, gate, bias, grad_out, layout)
        ct.CONFIGS.clear()
        ct.CONFIGS.update(saved)
        ref_low = _run(compress_pool_reference, kv, gate, bias, grad_out, layout)
        exact = _run(compress_pool_reference, kv.double(), gate.double(), bias.double(), grad_out.double(), layout)
        results[case_id] = _compare(kernel, ref_low, exact)
        results[case_id]["real_entries"] = int(layout.entry_is_real.sum())

    # Repeatability (d_bias is a two-stage reduction in a fixed order) and dispatch through the public op.
    case_id = "r4-d16-bf16"
    lengths, layout = _pack_and_layout(CASES[case_id])
    kv, gate, bias, grad_out = _inputs(CASES[case_id], layout, sum(lengths) + CASES[case_id]["padding"])
    again = _run(ct.compress_pool_triton, kv, gate, bias, grad_out, layout)
    backend.set_backend("triton")
    public = _run(compress_pool, kv, gate, bias, grad_out, layout)
    backend.set_backend(None)
    args64 = (kv.double(), gate.double(), bias.double(), grad_out.double(), layout)
    results["plumbing"] = dict(
        registered=backend.kernel("compress_pool") is ct.compress_pool_triton,
        bitwise_repeatable=all(torch.equal(a, b) for a, b in zip(again, kernel_outputs[case_id])),
        public_matches_direct=all(torch.equal(a, b) for a, b in zip(public, kernel_outputs[case_id])),
        fp64_fallback_is_reference=all(torch.equal(a, b) for a, b in zip(_run(ct.compress_pool_triton, *args64),
                                                                         _run(compress_pool_reference, *args64))),
    )
    torch.empty, torch.empty_like = empty, empty_like

    # torch.library's own checks of the registered ops: schema, fake (meta) kernels, autograd registration.
    fields = ct._layout_args(layout)
    leaves = [x.detach().float().requires_grad_(True) for x in (kv, gate, bias)]
    _, lse, pooled = ct.compress_pool_op(*leaves, *fields, 4)
    checks = [torch.library.opcheck(ct.compress_pool_op, (*leaves, *fields, 4)),
              torch.library.opcheck(ct.compress_pool_backward_op, (grad_out.float(), *(x.detach() for x in leaves),
                                                                   *fields, lse, pooled, 4))]
    results["plumbing"]["opcheck"] = all(v == "SUCCESS" for c in checks for v in c.values())
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    return run_worker("tests.ops.test_compressor_triton")


def _assert_within_bounds(case_id, measured, low_precision, floor=1e-6):
    for name in NAMES:
        m = measured[name]
        assert m["finite"], f"{case_id} {name}: NaN/inf in the kernel result (an element left unwritten?)"
        assert m["zeros_exact"], f"{case_id} {name}: nonzero where the float64 reference is exactly 0"
        if low_precision:
            bound = low_precision_bound(m, 2.0 if name == "out" else 3.0, floor)
        else:
            bound = 2e-6 * max(m["magnitude"], 1e-30)
        assert_error_within(f"{case_id} {name}", m, bound)


@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_float64_reference(interpreted, case_id):
    assert interpreted[case_id]["real_entries"] > 0, "the random pack must make entries"
    _assert_within_bounds(case_id, interpreted[case_id], CASES[case_id]["dtype"] != "fp32")


@pytest.mark.parametrize("check", ["registered", "bitwise_repeatable", "public_matches_direct",
                                   "fp64_fallback_is_reference", "opcheck"])
def test_plumbing(interpreted, check):
    assert interpreted["plumbing"][check]


# --- V4-Flash shapes on a GPU: hidden 4096 -> ratio 4 width 2 x 512, ratio 128 width 512; T = 32768 ---------------

GPU_LENGTHS = (9000, 1, 130, 0, 4099, 15000, 3000)       # 31230 rows, then 1538 rows of capacity padding
GPU_T = 32768


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ratio", [4, 128], ids=["r4-d512", "r128-d512"])
def test_gpu_flash_shapes(ratio):
    from dsv4attn.ops.compressor import triton as ct
    from dsv4attn.ops.compressor.reference import compress_pool_reference
    from tests.packs import cu_seqlens_of
    import dsv4attn

    device = torch.device("cuda")
    layout = dsv4attn.pack_batch(cu_seqlens_of(GPU_LENGTHS).to(device), GPU_T, max(GPU_LENGTHS)).compressed(ratio)
    c = dict(ratio=ratio, d=512, dtype="bf16", seed=0)
    kv, gate, bias, grad_out = (t.to(device) for t in _inputs(c, layout, GPU_T))
    kernel = _run(ct.compress_pool_triton, kv, gate, bias, grad_out, layout)
    ref_low = _run(compress_pool_reference, kv, gate, bias, grad_out, layout)
    exact = _run(compress_pool_reference, kv.double(), gate.double(), bias.double(), grad_out.double(), layout)
    # Floor 1e-5 of the largest magnitude: d_bias sums up to 8192 entries in fp32 in another order than PyTorch.
    _assert_within_bounds(f"gpu-r{ratio}", _compare(kernel, ref_low, exact), low_precision=True, floor=1e-5)
    again = _run(ct.compress_pool_triton, kv, gate, bias, grad_out, layout)
    assert all(torch.equal(a, b) for a, b in zip(again, kernel)), "two runs differ"
