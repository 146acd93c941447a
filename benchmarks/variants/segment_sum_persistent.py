"""The deterministic sparse-attention backward's reduction (``segment_sum.add_rows_by_key``) with a fixed grid of
programs that loop over the keys, instead of one program per (key row, 128 columns) per chunk of query rows.

Why: the deterministic mode costs 2.5-3.1x the default backward (BENCHMARKS.md, twenty-seventh and twenty-eighth
sessions). At T = 32K, K = 640 it runs 80 chunks of 409 query rows; each chunk launches N x D / 128 programs (N =
40960 kv rows: 163840 programs), of which a chunk's rows touch at most ~0.5K window rows and 8K compressed rows:
~10M programs in all that load two bounds and exit. A grid of a few programs per SM looping over the keys spends two
loads on an untouched key instead of a launch slot. Each key's run is still added in sorted order by one program:
the result stays bitwise repeatable and equal to the shipped form's.

- ``persistent``: ``PROGRAMS`` (8 per SM of an H100/H200: 1056) programs per column block, keys ``pid, pid + P, ...``.

GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/segment_sum_persistent.py --T 32768 8192 --H 64``
(the deterministic Gluon backward at the benchmark's inputs, K = 640; outputs must be bitwise equal). No offline
build row: the kernel is Triton, not Gluon (``--build-only`` lists Gluon kernels only).
"""
import importlib.util
import textwrap
from pathlib import Path

import torch

MODULE = "dsv4attn.ops.sparse_attention.segment_sum"
KERNEL = "_segment_sum_kernel"

# The shipped kernel's body (from its source: not repeated here), indented one level into a loop over the keys.
_SOURCE = Path(importlib.util.find_spec(MODULE).origin).read_text()
_FIRST = "    key = tl.program_id(0).to(tl.int64)\n    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)\n"
_LAST = "        tl.store(row, tl.load(row) + acc)\n"
_BODY = _SOURCE[_SOURCE.index(_FIRST):_SOURCE.index(_LAST) + len(_LAST)]
_LOOP = ("    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)\n"
         "    for k in range(tl.program_id(0), N, tl.num_programs(0)):\n"
         "        key = k + tl.zeros([], tl.int64)          # int64 row offsets, as the shipped kernel\n"
         + textwrap.indent(_BODY[len(_FIRST):], "    "))
_LAUNCH = ("    grid = (N, triton.cdiv(D, block_d))\n"
           "    _segment_sum_kernel[grid](buf, order, bounds, dkv, keys.numel(), D=D,")

VARIANTS = {"persistent": [
    ("DKV, M, D: tl.constexpr", "DKV, M, N, D: tl.constexpr"),
    (_BODY, _LOOP),
    (_LAUNCH, _LAUNCH.replace("(N, triton", "(min(N, 1056), triton").replace("keys.numel(), D=D",
                                                                          "keys.numel(), N, D=D")),
]}


def inputs(T, H, device):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sparse_attention import D, make_inputs
    q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    gen = torch.Generator(device=device).manual_seed(1)
    do = torch.randn(q.shape, device=device, generator=gen).to(q.dtype)
    return dict(q=q, kv=kv, idx=idx, sink=sink.float(), do=do, scale=D ** -0.5)


def call(module, inp):
    """The deterministic backward (``triton._sparse_attn_bwd``) with ``module``'s reduction in place of the shipped
    one (in the Gluon launcher and the Triton passes alike): (dq, dkv, d_sink)."""
    from dsv4attn.ops.sparse_attention import gluon_hopper_bwd, triton as sat
    saved = gluon_hopper_bwd.add_rows_by_key, sat.add_rows_by_key
    gluon_hopper_bwd.add_rows_by_key = sat.add_rows_by_key = module.add_rows_by_key
    try:
        if "out" not in inp:
            inp["out"], inp["lse"] = sat._sparse_attn_fwd(inp["q"], inp["kv"], inp["idx"], inp["sink"], inp["scale"])
        return sat._sparse_attn_bwd(inp["q"], inp["kv"], inp["idx"], inp["sink"], inp["out"], inp["lse"], inp["do"],
                                    inp["scale"], deterministic=True)
    finally:
        gluon_hopper_bwd.add_rows_by_key, sat.add_rows_by_key = saved
