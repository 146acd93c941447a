"""Triton compressor pooling (docs/semantics.md, decision 4) on the GPU: correctness at V4-Flash shapes,
then one timing table.

Shapes (V4-Flash, hidden 4096): ratio 4 pools kv / gate of width 2 x 512, ratio 128 of width 512, bf16, fp32
position bias; T packed rows in four documents of uneven lengths (every one leaves a tail) and 77 rows of capacity
padding. The op is memory-bound, so the table reports bandwidth:

    forward bytes  = kv + gate read + out written
    backward bytes = kv + gate + d_out read + d_kv + d_gate written

(the ratio-128 forward also writes, and its backward reads, 8 bytes per entry-channel of softmax statistics, 1/64 of
the inputs: not counted), over the device-to-device copy bandwidth measured on the lent H200, 4.3 TB/s
(docs/performance.md; target >= 50%). "peak MiB" is what a call allocates beyond its inputs. "x reference" is the
reference op's time (PyTorch, same inputs; backward = autograd of its graph) over the kernel's. Run (CUDA):

    python benchmarks/compressor.py [--T 8192 32768 131072] [--ratio 4 128] [--check-T 32768] [--sweep] [--log f]
"""
from __future__ import annotations

import argparse

import torch
from gpu_timing import peak_mib, start_log, time_ms

HBM_GBPS = 4300.0               # device-to-device copy, 4 GiB, measured on the lent H200 (docs/performance.md)
HEAD_DIM = 512
PADDING = 77


def make_layout(T: int, ratio: int, device):
    import dsv4attn
    real = T - PADDING
    lengths = [int(0.37 * real) + 1, int(0.29 * real) + 3, int(0.21 * real) + 2]
    lengths.append(real - sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dsv4attn.pack_batch(cu, T, max(lengths)).compressed(ratio)


def make_inputs(T: int, ratio: int, device, dtype=torch.bfloat16, seed: int = 0):
    layout = make_layout(T, ratio, device)
    width = (2 if ratio == 4 else 1) * HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(T, width, device=device, generator=gen).to(dtype)
    gate = (2.0 * torch.randn(T, width, device=device, generator=gen)).to(dtype)
    bias = torch.randn(ratio, width, device=device, generator=gen)
    grad_out = torch.randn(layout.capacity, HEAD_DIM, device=device, generator=gen).to(dtype)
    return kv, gate, bias, grad_out, layout


def run_grads(fn, kv, gate, bias, grad_out, layout):
    kv, gate, bias = (x.detach().clone().requires_grad_(True) for x in (kv, gate, bias))
    out = fn(kv, gate, bias, layout)
    out.backward(grad_out.to(out.dtype))
    return [x.detach().double() for x in (out, kv.grad, gate.grad, bias.grad)]


def check(T: int, ratio: int, log) -> None:
    """Kernel (bf16) and the reference run in bf16, both against the float64 reference on the same inputs."""
    from dsv4attn.ops.compressor.reference import compress_pool_reference
    from dsv4attn.ops.compressor.triton import compress_pool_triton
    kv, gate, bias, grad_out, layout = make_inputs(T, ratio, "cuda")
    kern = run_grads(compress_pool_triton, kv, gate, bias, grad_out, layout)
    low = run_grads(compress_pool_reference, kv, gate, bias, grad_out, layout)
    exact = run_grads(compress_pool_reference, kv.double(), gate.double(), bias.double(), grad_out.double(), layout)
    log(f"correctness at T={T} ratio {ratio} d={HEAD_DIM} bf16 (max abs error vs float64; kernel / reference-bf16; "
        f"bound 2x out, 3x grads)")
    for name, k, r, e in zip(("out", "dkv", "dgate", "d_bias"), kern, low, exact):
        ek, er = (k - e).abs().max().item(), (r - e).abs().max().item()
        log(f"  {name:7s} kernel {ek:.3e}  ref-bf16 {er:.3e}  ratio {ek / max(er, 1e-30):5.2f}  "
            f"rel-to-max {ek / max(e.abs().max().item(), 1e-30):.2e}  zeros-exact {bool((k[e == 0] == 0).all())}")
    del kern, low, exact
    torch.cuda.empty_cache()


def bench(T: int, ratio: int, log, with_reference: bool = True, config=None, tag: str = "") -> None:
    from dsv4attn.ops.compressor import triton as ct
    from dsv4attn.ops.compressor.reference import compress_pool_reference
    kv, gate, bias, grad_out, layout = make_inputs(T, ratio, "cuda")
    fields = (layout.entry_first_row, layout.entry_index, layout.entry_is_real)
    elt = kv.element_size()
    io = 2 * kv.numel() * elt
    fwd_bytes = io + grad_out.numel() * elt
    bwd_bytes = 2 * io + grad_out.numel() * elt
    out, lse, pooled = ct._compress_pool_fwd(kv, gate, bias, *fields, ratio, config)

    def fwd():
        ct._compress_pool_fwd(kv, gate, bias, *fields, ratio, config)

    def bwd():
        ct._compress_pool_bwd(grad_out, kv, gate, bias, *fields, lse, pooled, ratio, config)

    def row(impl, op, ms, nbytes, mem, base_ms=None):
        gbps = nbytes / ms / 1e6
        vs = f"{base_ms / ms:6.1f}" if base_ms else "   -  "
        log(f"| {impl}{tag} {op:3s} | T={T:6d} r={ratio:3d} width={kv.shape[1]} | {ms:8.4f} | {gbps:7.0f} | "
            f"{gbps / HBM_GBPS:5.2f} | {mem:8.1f} | {vs} |")

    ref = {}
    if with_reference:
        def ref_fwd():
            compress_pool_reference(kv, gate, bias, layout)

        leaves = [x.detach().requires_grad_(True) for x in (kv, gate, bias)]
        ref_out = compress_pool_reference(*leaves, layout)

        def ref_bwd():
            torch.autograd.grad(ref_out, leaves, grad_out, retain_graph=True)

        ref = {"fwd": (time_ms(ref_fwd, 1, 5), peak_mib(ref_fwd)), "bwd": (time_ms(ref_bwd, 1, 5), peak_mib(ref_bwd))}
    for op, fn, nbytes in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes)):
        row("triton", op, time_ms(fn), nbytes, peak_mib(fn), ref[op][0] if ref else None)
    for op, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes)) if ref else ():
        row("reference", op, ref[op][0], nbytes, ref[op][1])


def sweep_configs(ratio: int):
    """Tile variants around the defaults, one dict per forward+backward pair (``CHANNELS_FIRST``: neighbouring
    programs take neighbouring channel blocks; BLOCK_D = 512 reads whole rows in one program)."""
    if ratio == 4:
        fwd = [dict(BLOCK_E=e, CHUNK=8, BLOCK_D=bd, num_warps=w, CHANNELS_FIRST=cf) for e, bd, w, cf in
               [(2, 512, 4, False), (4, 512, 8, False), (4, 512, 4, False), (2, 256, 4, True), (2, 512, 2, False),
                (1, 512, 2, False), (8, 64, 4, True), (8, 64, 4, False)]]
        bwd = [dict(BLOCK_E=e, CHUNK=8, BLOCK_D=bd, MAX_GROUPS=g, num_warps=w) for e, bd, g, w in
               [(2, 512, 4096, 4), (2, 512, 8192, 4), (1, 512, 8192, 4), (1, 512, 16384, 4), (2, 256, 4096, 4),
                (4, 512, 2048, 8), (1, 512, 4096, 4), (8, 64, 256, 4)]]
    else:
        fwd = [dict(BLOCK_E=e, CHUNK=c, BLOCK_D=bd, num_warps=w, CHANNELS_FIRST=cf) for e, c, bd, w, cf in
               [(1, 128, 64, 8, False), (1, 128, 32, 4, False), (1, 64, 32, 4, False), (1, 32, 64, 4, False),
                (1, 64, 64, 8, False), (2, 64, 64, 8, False), (1, 128, 64, 4, False), (1, 64, 64, 4, False)]]
        bwd = [dict(BLOCK_E=e, CHUNK=c, BLOCK_D=bd, MAX_GROUPS=g, num_warps=w) for e, c, bd, g, w in
               [(1, 8, 256, 64, 4), (1, 8, 512, 64, 4), (1, 16, 256, 64, 4), (2, 8, 256, 32, 4),
                (1, 8, 128, 64, 4), (1, 8, 256, 32, 4), (1, 4, 512, 64, 4), (2, 16, 64, 16, 4)]]
    return [dict(fwd=f, bwd=b) for f, b in zip(fwd, bwd)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--ratio", type=int, nargs="+", default=[4, 128])
    parser.add_argument("--check-T", type=int, default=32768, help="0 skips the correctness check")
    parser.add_argument("--no-reference", action="store_true", help="time the kernels only")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the tile variants of sweep_configs at every --T")
    parser.add_argument("--log", default=None, help="also append every line to this file")
    args = parser.parse_args()
    log = start_log("compressor.py", args.log)
    if args.check_T:
        for ratio in args.ratio:
            check(args.check_T, ratio, log)
    log(f"| impl op | shape | ms (median of 10) | GB/s | / {HBM_GBPS:.0f} | peak MiB | x reference |")
    log("|---|---|---|---|---|---|---|")
    for ratio in args.ratio:
        for T in args.T:
            bench(T, ratio, log, with_reference=not args.no_reference)
            torch.cuda.empty_cache()
    if args.sweep:
        for ratio in args.ratio:
            for i, config in enumerate(sweep_configs(ratio)):
                log(f"sweep {i} ratio {ratio}: {config}")
                for T in args.T:
                    try:
                        bench(T, ratio, log, with_reference=False, config=config, tag=f"#{i}")
                    except Exception as exc:                               # noqa: BLE001 - report and go on
                        log(f"  failed {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
