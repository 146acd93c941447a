"""What one layer's eager forward + backward asks of a GPU, counted on any machine: every aten op's bytes and every
matmul's FLOPs, without running a kernel.

    python benchmarks/layer_traffic.py --preset flash --rows 32768 --ratios 4 128 0 [--phase sparse] [--top 15]

The layer runs on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage) with the Triton backend forced,
so the ops take the CUDA path's dispatch (our kernels as opaque custom ops, their fake kernels run) and the CUDA
chunk budgets (``index_sets.CHUNK_BUDGET``). A dispatch mode logs each op with the bytes of its tensor inputs and
outputs; views, allocations and metadata ops move nothing and are left out. Classes:

- *matmul*: ``mm`` / ``bmm`` / ``addmm``: FLOPs, and the time at the measured bf16 matmul peak (``--peak``);
- *rope*: our q-norm + RoPE and RoPE ops (``dsv4attn::qnorm_rope``, ``rope_rotate`` and their backwards),
  elementwise passes: bytes, and the time at ``--bandwidth``;
- *ours*: our other registered ops (attention, indexer, KL, compressor): bytes of their arguments only (their own
  work is in their benchmarks);
- *other*: everything else (norms, casts, concatenations, gradient sums): bytes, and the time at ``--bandwidth``.

The "other" ops are counted as dispatched for a CPU tensor where PyTorch's CUDA path differs (``F.rms_norm`` is one
fused kernel on CUDA, a few elementwise passes here): an upper bound for those. What the count is for: finding the
passes over large tensors that a fusion or a layout change would remove (BENCHMARKS.md, "One layer"), and the floor
of a layer's "rest" (projections, norms, RoPE, output) in ``benchmarks/layer.py --breakdown``.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dsv4attn
from dsv4attn import backend
from dsv4attn.ops import index_sets

MATMULS = {"aten.mm.default", "aten.mm.out", "aten.bmm.default", "aten.bmm.out", "aten.addmm.default",
           "aten.addmm_.default"}
# Ops that move no data: views, allocations, metadata.
FREE = {"aten.view.default", "aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.slice.Tensor",
        "aten.unsqueeze.default", "aten.expand.default", "aten._unsafe_view.default", "aten.squeeze.dim",
        "aten.squeeze.dims", "aten.as_strided.default", "aten.select.int", "aten.detach.default", "aten.alias.default",
        "aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default", "aten.empty_strided.default",
        "aten.split_with_sizes.default", "aten.split.Tensor", "aten.lift_fresh.default", "aten.unbind.int"}
# Ops that write their output without reading their tensor arguments (those give only a shape, dtype or device).
WRITE_ONLY = {"aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default", "aten.zeros_like.default",
              "aten.ones_like.default", "aten.full_like.default"}


def _bytes(t) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    if 0 in t.stride() and t.numel() > 1:      # an expanded tensor (e.g. layers.common.GradientHandle) holds less
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    return t.numel() * t.element_size()


class OpLog(TorchDispatchMode):
    """Records (direction, op, output shape, bytes read, bytes written, FLOPs) of every op that moves data."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple] = []
        self.direction = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in FREE or name.startswith("prim."):
            return out
        ins = [] if name in WRITE_ONLY else [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        flop = 0
        if name in MATMULS:
            a, b = (args[1], args[2]) if name.startswith("aten.addmm") else (args[0], args[1])
            flop = 2 * a.numel() * b.shape[-1]
        self.rows.append((self.direction, name, tuple(outs[0].shape) if outs else (), sum(map(_bytes, ins)),
                          sum(map(_bytes, outs)), flop))
        return out


def kind(name: str, flop: int) -> str:
    if flop:
        return "matmul"
    if name.startswith("dsv4attn"):
        return "rope" if "rope" in name else "ours"
    return "other"


def count(preset: str, rows: int, ratio: int, phase: str) -> list[tuple]:
    """The op log of one forward + backward of a bf16 ``preset`` layer of ``ratio`` over one document of ``rows``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = getattr(dsv4attn.AttentionConfig, preset)()
    torch.manual_seed(0)
    layer = dsv4attn.HybridAttention(cfg, ratio).to(torch.bfloat16).train()
    pack = dsv4attn.pack_batch(torch.tensor([0, rows], dtype=torch.int32), rows, max_seqlen=rows)
    if ratio:
        pack.compressed(ratio)                  # built from real values, outside the fake mode
    log, saved, forced = OpLog(), dict(index_sets.CHUNK_BUDGET), backend.forced()
    index_sets.CHUNK_BUDGET["cpu"] = index_sets.CHUNK_BUDGET["cuda"]
    dsv4attn.set_backend("triton")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(rows, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(rows, cfg.hidden_size, dtype=torch.bfloat16)
            with log:
                y = layer(x, pack=pack, phase=phase)
                log.direction = "backward"
                y.backward(grad)
    finally:
        dsv4attn.set_backend(forced)
        index_sets.CHUNK_BUDGET.update(saved)
    return log.rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash", choices=("tiny", "flash", "pro"))
    ap.add_argument("--rows", type=int, nargs="+", default=[32768])
    ap.add_argument("--ratios", type=int, nargs="+", default=[4, 128, 0])
    ap.add_argument("--phase", default="sparse", choices=("dense", "warmup", "sparse"))
    ap.add_argument("--top", type=int, default=12, help="list the N 'other' ops that move the most bytes")
    ap.add_argument("--peak", type=float, default=782.0, help="matmul TFLOP/s (the H200's measured bf16 peak)")
    ap.add_argument("--bandwidth", type=float, default=4.0, help="TB/s the elementwise passes reach")
    args = ap.parse_args()
    gib = 2.0 ** 30
    print(f"{args.preset} geometry, bf16, one document, phase {args.phase}; times at {args.peak:.0f} TFLOP/s and "
          f"{args.bandwidth:.1f} TB/s")
    print("| T | ratio | direction | class | ops | TFLOP | GiB read + written | ms at the peak / bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    heavy = []
    for rows in args.rows:
        for ratio in args.ratios:
            totals = defaultdict(lambda: [0, 0, 0])
            for direction, name, shape, read, written, flop in count(args.preset, rows, ratio, args.phase):
                k = kind(name, flop)
                t = totals[(direction, k)]
                t[0], t[1], t[2] = t[0] + 1, t[1] + flop, t[2] + read + written
                if k == "other":
                    heavy.append((read + written, rows, ratio, direction, name, shape))
            for (direction, k), (n, flop, moved) in sorted(totals.items(), key=lambda kv: (kv[0][0] != "forward",
                                                                                            kv[0][1])):
                ms = flop / (args.peak * 1e12) * 1e3 if k == "matmul" else moved / (args.bandwidth * 1e12) * 1e3
                shown = f"{ms:.2f}" if k != "ours" else "-"
                print(f"| {rows} | {ratio} | {direction} | {k} | {n} | {flop / 1e12:.2f} | {moved / gib:.1f} | "
                      f"{shown} |")
    if args.top:
        print(f"\nThe {args.top} 'other' ops that move the most bytes")
        print("| T | ratio | direction | op | output shape | GiB | ms |")
        print("|---|---|---|---|---|---|---|")
        for moved, rows, ratio, direction, name, shape in sorted(heavy, reverse=True)[:args.top]:
            print(f"| {rows} | {ratio} | {direction} | {name} | {shape} | {moved / gib:.2f} | "
                  f"{moved / (args.bandwidth * 1e12) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
