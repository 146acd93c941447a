"""The deterministic Gluon backward (``_bwd_dkv`` with ``DETERMINISTIC``): what its dKV stores cost.

Why: offline, ptxas (sm_90a) reports for the deterministic form "wgmma.mma_async instructions are serialized due to
insufficient register resources" (C7512) and 168 bytes of spills (Triton 3.6.0); the default form has neither
(44 bytes). Built offline (``--build-only``, Triton 3.6.0), the stores are what does it: without them (below) 44
bytes and no serialization; the forms tried all stay serialized: int32 offsets from a per-program base pointer (172
bytes), no idx mask, row pointers, one chunk's products in flight instead of two, CHUNK 32 (104), REGS (240, 24)
(280), the reduction layout's 16-byte stores (340); a store through a blocked layout (shared-memory conversion) is
not serialized (164 bytes) but needs 245824 bytes of shared memory, more than an SM has (232448).

- ``no_store`` (wrong dkv on purpose): the chunks' products formed, nothing stored. The time it saves is what the
  serialized products and the stores cost together: the most any store form can win.
- ``reduced_into_zeroed``: the default form's 16-byte reductions (``add_reduced``) into the per-slot buffer, which
  the launcher zeroes before each chunk: one writer per element, so the reduction stores the value exactly and the
  result stays repeatable (dq and dkv must be bitwise the shipped form's: the same values, summed in the same
  order; `red.add.f32` flushes subnormal values to zero, which the plain stores keep). The memset costs ~0.16 ms
  per 0.5 GiB chunk at 32K (81 chunks).
- ``zero_then_reduce``: the same reductions without the memset: each thread first stores zeros at exactly the
  addresses its own reductions add to (add_reduced's layout and offsets), at the start of each tile, before its
  products. Relies on one thread's store and later reduction to one address landing in that order.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/bwd_deterministic_stores.py --T 32768 8192 --H 64``
(the deterministic backward, ``triton._sparse_attn_bwd(..., deterministic=True)``, at K = 640). Offline: ``...
--build-only`` (builds the deterministic form: ``BUILD_CONSTEXPRS``).
"""
import sys
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"

_STORE_OLD = "                    gl.store(DKV + rows[:, None] + cols[None, :], acc, mask=valid[:, None])\n"

# reduced_into_zeroed: the default form's 16-byte reductions (add_reduced) into the per-slot buffer, zeroed per
# chunk by the launcher; each element has one writer, so 0 + x = x: exact and repeatable. The buffer's columns come
# permuted as the default's dKV accumulator's: the segment sums go into a zeroed accumulator, unpermuted at the end.
_ROWS_OLD = ("                n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, c_layout))\n"
             "                idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)\n"
             "                valid = idx >= 0\n"
             "                rows = (row_base_out + n).to(gl.int64) * D\n")
_ROWS_NEW = ("                n = b * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, red_layout))\n"
             "                idx = gl.load(IDX + row_base + n, mask=n < K, other=-1)\n"
             "                valid = idx >= 0\n"
             "                rows = (row_base_out + n).to(gl.int64) * D\n")
_LAUNCH_OLD = ("    buf = torch.empty(num_hb * step * K * D, dtype=torch.float32, device=q.device)"
               "     # columns in natural order\n") + """    for s in range(0, T, step):
        e = min(s + step, T)
        rows(s, e, buf, True)
        add_rows_by_key(dkv, idx[s:e], buf, num_hb)"""
_LAUNCH_NEW = """    buf = torch.empty(num_hb * step * K * D, dtype=torch.float32, device=q.device)
    acc = torch.zeros_like(dkv)
    for s in range(0, T, step):
        e = min(s + step, T)
        buf.zero_()
        rows(s, e, buf, True)
        add_rows_by_key(acc, idx[s:e], buf, num_hb)
    add_unpermuted(dkv, acc)"""

# zero_then_reduce: no memset; each thread first stores zeros at exactly the addresses its own reductions then add
# to (the same layout and offsets as add_reduced's), so the zero lands before the add (one thread, one address).
_ZERO = ("                for c0 in gl.static_range(CHUNKS):\n"
         "                    zc = c0 * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, red_layout))\n"
         "                    gl.store(DKV + rows[:, None] + zc[None, :],\n"
         "                             gl.zeros([BLOCK_N, CHUNK], gl.float32, layout=red_layout),\n"
         "                             mask=valid[:, None])\n")
_REDUCE = "                    add_reduced(acc, DKV, rows, valid, c * CHUNK)\n"
_LAUNCH_NO_MEMSET = _LAUNCH_NEW.replace("        buf.zero_()\n", "")

VARIANTS = {
    "no_store": [(_STORE_OLD, "                    pass\n")],
    "zero_then_reduce": [(_ROWS_OLD, _ROWS_NEW + _ZERO), (_STORE_OLD, _REDUCE), (_LAUNCH_OLD, _LAUNCH_NO_MEMSET)],
    "reduced_into_zeroed": [(_ROWS_OLD, _ROWS_NEW), (_STORE_OLD, _REDUCE), (_LAUNCH_OLD, _LAUNCH_NEW)],
}
# The offline build compiles the deterministic form (the shipped kernels' build table lists the default one first).
BUILD_CONSTEXPRS = {"DETERMINISTIC": True}


def inputs(T, H, device):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(q.shape, device=device, generator=gen).to(q.dtype)
    return dict(q=q, kv=kv, idx=idx, sink=sink.float(), do=do, scale=D ** -0.5)


def call(module, inp):
    """The deterministic backward (``triton._sparse_attn_bwd``) with ``module`` as its Gluon kernel: (dq, dkv,
    d_sink)."""
    from dsv4attn.ops.sparse_attention import triton as sat
    saved = sat.gluon_hopper_bwd
    sat.gluon_hopper_bwd = module
    try:
        if "out" not in inp:
            inp["out"], inp["lse"] = sat._sparse_attn_fwd(inp["q"], inp["kv"], inp["idx"], inp["sink"], inp["scale"])
        return sat._sparse_attn_bwd(inp["q"], inp["kv"], inp["idx"], inp["sink"], inp["out"], inp["lse"], inp["do"],
                                    inp["scale"], deterministic=True)
    finally:
        sat.gluon_hopper_bwd = saved
