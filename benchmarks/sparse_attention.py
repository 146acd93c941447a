"""Triton sparse MQA attention (with sink) on the GPU: correctness at V4 shapes, then one timing table.

Shapes: H = 64 heads, D = 512, K = 640 slots per query = 128 window rows (t-127 .. t, -1 before the start) +
512 random earlier rows (uniform in [0, t-128), -1 where none exist; drawn with replacement, so rare repeats
count once per occurrence, as the op defines). FLOPs follow docs/performance.md: forward = 4*T*H*K*D counting
masked slots, backward = 2.5x forward. Run (CUDA, Triton):

    python benchmarks/sparse_attention.py --T 8192 32768 65536 --H 64 128 [--check-T 8192] [--sweep]
        [--flashmla .peers/flashmla] [--log out.txt]

``--output-rope`` adds rows for our kernels as the layer runs them (the output's inverse RoPE fused), each paired with
the plain kernel; ``--deterministic`` a row for the backward with ``deterministic=True``, paired with the
default one. ``--cudnn .peers`` times cuDNN Frontend's SM90 DSA backward (its wheels under ``.peers/cudnn_b``;
docs/performance.md) beside ours the same way, fed FlashMLA's out and lse when ``--flashmla`` is given.
``--flashmla`` times FlashMLA's sparse prefill forward (its build under ``.peers/flashmla``; docs/performance.md) on
the same inputs in the same run, alternating with our forward over 7 rounds (medians; the per-round ratios are printed);
the project never depends on it. "peak MiB" is what a call allocates beyond its inputs;
"mem/io" (forward+backward) is that plus q and kv over the bytes of q, kv, out, lse, dq, dkv (target <= 1.3).
"""
from __future__ import annotations

import argparse
import sys

import torch
from gpu_timing import paired_ms, peak_mib, start_log, time_ms

MATMUL_PEAK_TFLOPS = 782.0      # bf16 8192^3 matmul measured on the lent H200 (docs/performance.md)
D, WINDOW, TOPK = 512, 128, 512
H = 64                          # default; --H sets it per table row


def causal_indices(T: int, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    t = torch.arange(T, device=device)[:, None]
    window = t - torch.arange(WINDOW, device=device)[None, :]
    window = torch.where(window >= 0, window, -1)
    earlier = (t - WINDOW).clamp(min=0)                                            # rows [0, t-128) are eligible
    rand = (torch.rand(T, TOPK, device=device, generator=gen) * earlier).long()
    rand = torch.where(earlier > 0, rand, -1)
    return torch.cat([window, rand], dim=1).to(torch.int32)


def make_inputs(T: int, device, dtype=torch.bfloat16, seed: int = 0, heads: int | None = None):
    H = heads or globals()["H"]
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=gen).to(dtype)
    kv = torch.randn(T, D, device=device, generator=gen).to(dtype)
    sink = torch.randn(H, device=device, generator=gen)
    grad_out = torch.randn(T, H, D, device=device, generator=gen).to(dtype)
    return q, kv, causal_indices(T, device, seed), sink, grad_out


def run_grads(fn, q, kv, idx, sink, grad_out):
    from dsv4attn.ops.index_sets import Explicit
    q, kv, sink = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
    out, lse = fn(q, kv, Explicit(idx), sink, D ** -0.5)
    out.backward(grad_out.to(out.dtype))
    return [x.detach().double() for x in (out, lse, q.grad, kv.grad, sink.grad)]


def check(T: int, log) -> None:
    """Kernel (bf16) and the reference run in bf16, both against the float64 reference on the same inputs."""
    from dsv4attn.ops.sparse_attention.reference import sparse_attention_reference
    from dsv4attn.ops.sparse_attention.triton import sparse_attention_triton
    q, kv, idx, sink, grad_out = make_inputs(T, "cuda")
    kern = run_grads(sparse_attention_triton, q, kv, idx, sink, grad_out)
    low = run_grads(sparse_attention_reference, q, kv, idx, sink, grad_out)
    exact = run_grads(sparse_attention_reference, q.double(), kv.double(), idx, sink.double(), grad_out.double())
    # The kernels form Delta from the bf16 output: so does the reference they are measured against.
    from dsv4attn.ops.index_sets import Explicit
    from dsv4attn.ops.sparse_attention.reference import reference_backward, reference_forward
    o_low, l_low = reference_forward(q, kv, Explicit(idx), sink, D ** -0.5)
    low[2:] = [x.double() for x in reference_backward(grad_out, q, kv, Explicit(idx), sink, l_low, D ** -0.5,
                                                      out=o_low)]
    log(f"correctness at T={T} H={H} D={D} K={idx.shape[1]} bf16 (max abs error vs float64; kernel / reference-bf16;"
        f" bound 2x outputs, 3x grads)")
    for name, k, r, e in zip(("out", "lse", "dq", "dkv", "d_sink"), kern, low, exact):
        fin = torch.isfinite(e)
        ek, er = (k - e)[fin].abs().max().item(), (r - e)[fin].abs().max().item()
        rel = ek / max(e[fin].abs().max().item(), 1e-30)
        same = bool((torch.isfinite(k) == fin).all())
        log(f"  {name:7s} kernel {ek:.3e}  ref-bf16 {er:.3e}  ratio {ek / max(er, 1e-30):5.2f}  "
            f"kernel rel-to-max {rel:.2e}  finite-pattern-ok {same}")
    del kern, low, exact
    torch.cuda.empty_cache()


def io_bytes(T: int, H: int, K: int) -> int:
    """q, out, dq (bf16, T*H*D), kv and dkv (bf16, T*D), lse (fp32, T*H): what forward+backward must hold."""
    return 3 * T * H * D * 2 + 2 * T * D * 2 + T * H * 4


def bench(T: int, log, with_reference: bool, fwd_cfg=None, bwd_cfg=None, tag: str = "", heads: int = 64,
          flashmla=None, cudnn=None, output_rope: bool = False, deterministic: bool = False) -> None:
    from dsv4attn.ops.sparse_attention import triton as sat
    from dsv4attn.ops.sparse_attention.reference import sparse_attention_reference
    from dsv4attn.ops.index_sets import Explicit
    q, kv, idx, sink, grad_out = make_inputs(T, "cuda", heads=heads)
    H = heads
    scale = D ** -0.5
    K = idx.shape[1]
    fwd_flop = 4.0 * T * H * K * D
    io = io_bytes(T, H, K)
    inputs = (q.numel() + kv.numel()) * q.element_size()     # held by the caller, part of the io bytes
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg)

    def fwd():
        sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg)

    def bwd():
        sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, bwd_cfg)

    def fwd_bwd():
        o, _ = sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg)
        sat._sparse_attn_bwd(q, kv, idx, sink, o, lse, grad_out, scale, bwd_cfg)

    def row(impl, op, ms, flop, mem, base_ms=None):
        tflops = flop / ms / 1e9
        vs = f"{base_ms / ms:5.2f}" if base_ms else "  -  "
        ratio = f"{(mem * 2**20 + inputs) / io:5.2f}" if op == "fwd+bwd" else "  -  "
        log(f"| {impl}{tag} {op:8s} | T={T:6d} H={H} D={D} K={K} | {ms:9.3f} | {tflops:7.1f} | "
            f"{tflops / MATMUL_PEAK_TFLOPS:6.3f} | {mem:9.0f} | {ratio} | {vs} |")

    fm_ms = None
    if flashmla is not None:
        idx3 = idx[:, None].contiguous()

        def fm_fwd():
            return flashmla.flash_mla_sparse_fwd(q, kv[:, None], idx3, scale, D, sink)

        fm_out = fm_fwd()[0]
        err = ((fm_out.float() - out.float()).abs().max() / out.float().abs().max()).item()
        # The two forwards alternate (FlashMLA's time drifted by up to 10% between the start and the end of one run).
        ours_ms, fm_ms, ratios = paired_ms(fwd, fm_fwd)
        row("flashmla", "fwd", fm_ms, fwd_flop, peak_mib(fm_fwd))
        log(f"  (FlashMLA vs our forward: max |diff| / max |out| = {err:.2e}; {len(ratios)} alternating rounds,"
            f" per-round x FlashMLA {min(ratios):.3f} .. {max(ratios):.3f})")
    cudnn_ms = ours_bwd_ms = None
    if cudnn is not None:
        # cuDNN's backward is fed FlashMLA's out and lse where FlashMLA is loaded (what Megatron pairs), else ours.
        c_out, c_lse = ((fm_fwd()[0], fm_fwd()[2]) if flashmla is not None else (out, lse))
        def cudnn_bwd():
            return cudnn(q, kv, c_out, grad_out, c_lse, sink, idx, softmax_scale=scale)

        res = cudnn_bwd()
        ours = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, bwd_cfg)
        agree = " ".join(f"{name} "
                         f"{((a.float() - res[name].float().reshape(a.shape)).norm() / a.float().norm()).item():.1e}"
                         for name, a in zip(("dq", "dkv", "d_sink"), ours))
        ours_bwd_ms, cudnn_ms, ratios = paired_ms(bwd, cudnn_bwd)
        row("cudnn", "bwd", cudnn_ms, 2.5 * fwd_flop, peak_mib(cudnn_bwd))
        log(f"  (cuDNN vs our backward, relative Frobenius difference: {agree}; {len(ratios)} alternating rounds,"
            f" per-round x cuDNN {min(ratios):.3f} .. {max(ratios):.3f})")
    for op, fn, flop in [("fwd", fwd, fwd_flop), ("bwd", bwd, 2.5 * fwd_flop), ("fwd+bwd", fwd_bwd, 3.5 * fwd_flop)]:
        ms = ours_ms if op == "fwd" and fm_ms is not None else (None if op == "bwd" and cudnn is not None
                                                                 else time_ms(fn))
        # Labelled after the run: a Gluon kernel that could not be built has been replaced by then.
        bwd_kernel = "triton" if bwd_cfg is not None else sat.backward_kernel(q)
        kernels = {"fwd": sat.forward_kernel(q, fwd_cfg), "bwd": bwd_kernel,
                   "fwd+bwd": f"{sat.forward_kernel(q, fwd_cfg)} + {bwd_kernel}"}
        impl = f"ours ({kernels[op]})"
        base = fm_ms if op == "fwd" else None
        if op == "bwd" and cudnn is not None:
            base = cudnn_ms
        row(impl, op, ms if not (op == "bwd" and cudnn is not None) else ours_bwd_ms, flop, peak_mib(fn), base)
    if output_rope:
        # As the layer calls the kernels: the output rotated back over its last 64 channels (positions 0 .. T-1),
        # dO rotated as the backward loads it. Each timed in alternating rounds with the plain kernel above.
        tables = sat.rope_tables(torch.arange(T, device="cuda"),
                                 (10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)).cuda())
        r_out, r_lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg, rope=tables)

        def rope_fwd():
            sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg, rope=tables)

        def rope_bwd():
            sat._sparse_attn_bwd(q, kv, idx, sink, r_out, r_lse, grad_out, scale, bwd_cfg, rope=tables)

        for op, plain, rotated, flop, peer in (("fwd", fwd, rope_fwd, fwd_flop, fm_ms),
                                               ("bwd", bwd, rope_bwd, 2.5 * fwd_flop, cudnn_ms)):
            plain_ms, rope_ms, ratios = paired_ms(plain, rotated)
            row("ours + output_rope", op, rope_ms, flop, peak_mib(rotated), peer)
            log(f"  (output_rope {op}: {rope_ms / plain_ms:.3f}x the plain kernel, {len(ratios)} alternating rounds)")
    if deterministic:
        # deterministic=True (per-slot dKV rows summed in a fixed order) against the default backward, alternated.
        def det_bwd():
            sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, bwd_cfg, deterministic=True)

        plain_ms, det_ms, ratios = paired_ms(bwd, det_bwd)
        kernel = "triton" if bwd_cfg is not None else sat.backward_kernel(q)
        row(f"ours deterministic ({kernel})", "bwd", det_ms, 2.5 * fwd_flop, peak_mib(det_bwd), cudnn_ms)
        log(f"  (deterministic=True: {det_ms / plain_ms:.3f}x the default backward, {len(ratios)} alternating rounds)")
    if with_reference:
        iset = Explicit(idx)

        def ref_fwd():
            sparse_attention_reference(q, kv, iset, sink, scale)

        def ref_fwd_bwd():
            qq, kk, ss = (x.detach().requires_grad_(True) for x in (q, kv, sink))
            o, _ = sparse_attention_reference(qq, kk, iset, ss, scale)
            o.backward(grad_out)

        for op, fn, flop in (("fwd", ref_fwd, fwd_flop), ("fwd+bwd", ref_fwd_bwd, 3.5 * fwd_flop)):
            row("reference", op, time_ms(fn, warmup=1, reps=3), flop, peak_mib(fn))


def _fwd(n, dk, dv, w, s, **extra):
    return dict(BLOCK_N=n, BLOCK_DK=dk, BLOCK_DV=dv, num_warps=w, num_stages=s, **extra)


def _gluon(n, stages, **extra):
    return dict(KERNEL="gluon", BLOCK_N=n, STAGES=stages, **extra)


# The Gluon (SM90) forward: BLOCK_N gathered rows per block, a ring of STAGES shared-memory tiles, REGS registers
# per thread of the worker consumer and the producer.
SWEEP_GLUON = [_gluon(64, 2), _gluon(64, 2, REGS=(232, 24)), _gluon(64, 2, REGS=(200, 56)),
               _gluon(64, 2, REGS=(184, 72)), _gluon(32, 4), _gluon(32, 3)]
SWEEP_FWD = {   # per head count; BLOCK_DK == BLOCK_DV == 512: one kv tile per step for scores and values
    64: [_fwd(32, 128, 512, 8, 2),                                   # split-score layout (first version)
         _fwd(64, 512, 512, 8, 2), _fwd(32, 512, 512, 8, 3)] + SWEEP_GLUON,
    128: [_fwd(64, 512, 512, 8, 2), _fwd(32, 512, 512, 16, 2, BLOCK_H=128), _fwd(64, 512, 512, 16, 1, BLOCK_H=128),
          _fwd(32, 512, 512, 16, 1, BLOCK_H=128)] + SWEEP_GLUON,
}
def _bwd(layout, n, w, s, **extra):
    from dsv4attn.ops.sparse_attention import triton as sat_layouts
    layouts = dict(fused=sat_layouts.FUSED, split=sat_layouts.SPLIT)
    return dict(dict(LAYOUT=layouts[layout], BLOCK_N=n, num_warps=w, num_stages=s, RELAXED=True), **extra)


# Triton backward configurations (triton.BWD_CONFIGS keys; ``_deterministic`` = time deterministic=True instead).
# Per kv tile FUSED does 5 GEMM-tiles in one launch, SPLIT 7 over a dq and a dKV launch (triton.BwdLayout); both add
# the same T * K * D fp32 atomics after the same Delta pre-pass. A config forces the Triton kernel (the one-pass
# Gluon backward is timed by bench()).
SWEEP_BWD = [
    _bwd("split", 64, 8, 1, DKV=dict(BLOCK_N=32, num_warps=4, DKV_BLOCK_D=256)),    # the Triton default at D = 512
    _bwd("split", 32, 8, 2),
    _bwd("split", 32, 8, 2, RELAXED=False),                         # what relaxed atomics buy
    _bwd("split", 64, 8, 1),
    _bwd("split", 64, 8, 1, DKV=dict(BLOCK_N=32, num_stages=2)),
    _bwd("split", 32, 8, 2, DKV=dict(BLOCK_N=16)),
    _bwd("split", 32, 8, 2, DKV=dict(DKV_BLOCK_D=128)),             # dKV tile in 4 column chunks (q, dO re-read)
    _bwd("split", 64, 8, 1, DKV=dict(DKV_BLOCK_D=256)),
    _bwd("fused", 32, 8, 2),
    _bwd("fused", 16, 8, 2),
    _bwd("fused", 32, 16, 2),
    _bwd("fused", 16, 4, 2),
    _bwd("fused", 32, 8, 2, DKV_BLOCK_D=128),
    dict(_bwd("split", 64, 8, 1, DKV=dict(BLOCK_N=32, num_warps=4, DKV_BLOCK_D=256)), _deterministic=True),
    dict(_bwd("fused", 32, 8, 2), _deterministic=True),
]


def sweep(T: int, log, bwd: bool = True, heads: int = 64, fwd: bool = True, picks=None) -> None:
    from dsv4attn.ops.sparse_attention import triton as sat
    q, kv, idx, sink, grad_out = make_inputs(T, "cuda", heads=heads)
    scale, K = D ** -0.5, idx.shape[1]
    fwd_flop = 4.0 * T * heads * K * D
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    for cfg in SWEEP_FWD.get(heads, []) if fwd else ():
        try:
            ms = time_ms(lambda: sat._sparse_attn_fwd(q, kv, idx, sink, scale, cfg))
            o, l_ = sat._sparse_attn_fwd(q, kv, idx, sink, scale, cfg)
            diff = max(((o.float() - out.float()).abs().max() / out.float().abs().max()).item(),
                       (l_ - lse).abs().nan_to_num().max().item())
            log(f"sweep fwd H={heads} {cfg}: {ms:.3f} ms {fwd_flop / ms / 1e9:.1f} TFLOP/s "
                f"(max rel diff vs default {diff:.1e})")
        except Exception as exc:                                           # noqa: BLE001 - report and go on
            log(f"sweep fwd H={heads} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}")
    if not bwd:
        return
    try:        # every variant is compared with the default Triton passes' gradients
        base = sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, sat.BWD_CONFIGS[D])
    except Exception as exc:                                               # noqa: BLE001
        base = None
        log(f"sweep bwd H={heads}: Triton baseline failed {type(exc).__name__}: {str(exc)[:200]}")
    for i, entry in enumerate(SWEEP_BWD):
        if picks is not None and i not in picks:
            continue
        cfg = {k: v for k, v in entry.items() if k != "_deterministic"}
        det = bool(entry.get("_deterministic", False))
        label = f"{cfg}{' deterministic' if det else ''}"
        try:
            def run():
                return sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, cfg, deterministic=det)

            sat.SHRUNK.clear()
            ms = time_ms(run)
            shrunk = "".join(f"; {name} ran as {launched}" for name, (_, launched) in sat.SHRUNK.items())
            diff = "n/a"
            if base is not None:
                diff = " ".join(f"{name} {((a.float() - b.float()).abs().max() / b.float().abs().max()).item():.1e}"
                                for name, a, b in zip(("dq", "dkv", "d_sink"), run(), base))
            log(f"sweep bwd H={heads} {label}: {ms:.3f} ms {2.5 * fwd_flop / ms / 1e9:.1f} TFLOP/s "
                f"(max rel diff vs the Triton default: {diff}){shrunk}")
        except Exception as exc:                                           # noqa: BLE001
            log(f"sweep bwd H={heads} {label}: failed {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--H", type=int, nargs="+", default=[64])
    parser.add_argument("--flashmla", default=None, help="folder made by get_flashmla.sh (optional baseline)")
    parser.add_argument("--cudnn", default=None, help="folder holding cudnn_b of get_cudnn_dsa.sh, e.g. .peers "
                        "(optional backward baseline; its first call stashes cudnn_a)")
    parser.add_argument("--check-T", type=int, default=8192, help="0 skips the correctness check")
    parser.add_argument("--reference-T", type=int, default=8192, help="T at which the reference is also timed")
    parser.add_argument("--sweep", choices=["fwd", "bwd", "both"], default=None,
                        help="also time the tile configurations in SWEEP_FWD and / or SWEEP_BWD")
    parser.add_argument("--bwd-variants", default=None, help="comma-separated SWEEP_BWD indices (default: all)")
    parser.add_argument("--output-rope", action="store_true", help="also time the kernels with the output's inverse "
                        "RoPE fused (what the layer runs), against the plain kernels")
    parser.add_argument("--deterministic", action="store_true", help="also time the backward with "
                        "deterministic=True, against the default one")
    parser.add_argument("--log", default=None, help="also append every line to this file")
    args = parser.parse_args()
    log = start_log("sparse_attention.py", args.log)
    if args.check_T:
        check(args.check_T, log)
    flashmla = None
    if args.flashmla:
        sys.path.insert(0, args.flashmla)
        from load_flashmla import load
        flashmla = load(args.flashmla)
    cudnn = None
    if args.cudnn:
        sys.path.insert(0, f"{args.cudnn}/cudnn_b")
        from load_cudnn_dsa import load as load_cudnn
        cudnn = load_cudnn(f"{args.cudnn}/cudnn_b")
    log("| impl op | shape | ms (median) | TFLOP/s | / 782 peak | peak MiB | mem/io "
        "| x peer (FlashMLA fwd, cuDNN bwd) |")
    log("|---|---|---|---|---|---|---|---|")
    for heads in args.H:
        for T in args.T:
            bench(T, log, with_reference=(T == args.reference_T and heads == 64), heads=heads, flashmla=flashmla,
                  cudnn=cudnn, output_rope=args.output_rope, deterministic=args.deterministic)
            torch.cuda.empty_cache()
    if args.sweep:
        for heads in args.H:
            picks = None if args.bwd_variants is None else {int(i) for i in args.bwd_variants.split(",")}
            sweep(args.T[0], log, bwd=args.sweep in ("bwd", "both"), heads=heads, fwd=args.sweep in ("fwd", "both"),
                  picks=picks)


if __name__ == "__main__":
    main()
