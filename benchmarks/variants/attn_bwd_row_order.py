# Backward kernel variants for benchmarks/kernel_variants.py: the order of rows over programs (window-layer dKV
# reductions). WINDOW_ONLY=1 gives every row only its 128 window slots (K = 128, a window layer's attention).
import os
import sys
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper_bwd"
KERNEL = "_sparse_attn_bwd_gluon"


def inputs(T, H, device):
    window_only = os.environ.get("WINDOW_ONLY") == "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    from dsv4attn.ops.sparse_attention import triton as sat
    q, kv, idx, sink, grad_out = make_inputs(T, device, heads=H)
    if window_only:
        idx = idx[:, :128].contiguous()
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, D ** -0.5)
    denom2 = (torch.logaddexp(lse, sink[None, :]) * 1.4426950408889634).contiguous()
    delta = sat._delta_from_out(out, grad_out)
    return dict(q=q, do=grad_out, kv=kv, idx=idx, denom2=denom2, delta=delta, scale=D ** -0.5)


def call(module, inp):
    dq = torch.empty_like(inp["q"])
    dkv = torch.zeros(inp["kv"].shape, dtype=torch.float32, device=inp["kv"].device)
    module.launch(inp["q"], inp["do"], inp["kv"], inp["idx"], inp["denom2"], inp["delta"], dq, dkv, inp["scale"])
    return dq, dkv


# Programs over rows in a strided order: concurrently running programs take rows 256 apart (disjoint windows), so
# their dKV reductions stop landing on the same 128 kv rows at once (a window layer: every kv row gets 128
# consecutive queries' reductions); each region of 256 rows is still walked in order, so the active accumulator
# lines (~132 regions x 128 rows x 2 KiB = 33 MiB) can stay in L2.
_STRIDED = [
    ("        t, hb = program_row(H)\n        dtype: gl.constexpr = Q.dtype.element_ty\n",
     "        pid = gl.program_id(0)\n"
     "        nhb = H // BLOCK_H_C\n"
     "        row = pid // nhb\n"
     "        hb = pid % nhb\n"
     "        rows = gl.num_programs(0) // nhb\n"
     "        regions = rows // 256\n"
     "        t = gl.where(row < regions * 256, (row % gl.maximum(regions, 1)) * 256 + row // gl.maximum(regions, 1),"
     " row).to(gl.int64)\n"
     "        dtype: gl.constexpr = Q.dtype.element_ty\n"),
]
VARIANTS = {"strided_rows": _STRIDED}
