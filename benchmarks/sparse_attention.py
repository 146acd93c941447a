"""Triton sparse MQA attention (with sink) on the GPU: correctness at V4 shapes, then one timing table.

Shapes: H = 64 heads, D = 512, K = 640 slots per query = 128 window rows (t-127 .. t, -1 before the start) +
512 random earlier rows (uniform in [0, t-128), -1 where none exist; drawn with replacement, so rare repeats
count once per occurrence, as the op defines). FLOPs follow spec/PERFORMANCE.md: forward = 4*T*H*K*D counting
masked slots, backward = 2.5x forward. Run (CUDA, Triton):

    python benchmarks/sparse_attention.py --T 8192 32768 [--check-T 8192] [--sweep] [--log out.txt]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

MATMUL_PEAK_TFLOPS = 782.0      # bf16 8192^3 matmul measured on the lent H200 (PERFORMANCE.md)
H, D, WINDOW, TOPK = 64, 512, 128, 512


def causal_indices(T: int, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    t = torch.arange(T, device=device)[:, None]
    window = t - torch.arange(WINDOW, device=device)[None, :]
    window = torch.where(window >= 0, window, -1)
    earlier = (t - WINDOW).clamp(min=0)                                            # rows [0, t-128) are eligible
    rand = (torch.rand(T, TOPK, device=device, generator=gen) * earlier).long()
    rand = torch.where(earlier > 0, rand, -1)
    return torch.cat([window, rand], dim=1).to(torch.int32)


def make_inputs(T: int, device, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=gen).to(dtype)
    kv = torch.randn(T, D, device=device, generator=gen).to(dtype)
    sink = torch.randn(H, device=device, generator=gen)
    grad_out = torch.randn(T, H, D, device=device, generator=gen).to(dtype)
    return q, kv, causal_indices(T, device, seed), sink, grad_out


def time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


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


def bench(T: int, log, with_reference: bool, fwd_cfg=None, bwd_cfg=None, tag: str = "") -> None:
    from dsv4attn.ops.sparse_attention import triton as sat
    from dsv4attn.ops.sparse_attention.reference import sparse_attention_reference
    from dsv4attn.ops.index_sets import Explicit
    q, kv, idx, sink, grad_out = make_inputs(T, "cuda")
    scale = D ** -0.5
    K = idx.shape[1]
    fwd_flop = 4.0 * T * H * K * D
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg)

    def fwd():
        sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg)

    def bwd():
        sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, bwd_cfg)

    def fwd_bwd():
        o, _ = sat._sparse_attn_fwd(q, kv, idx, sink, scale, fwd_cfg)
        sat._sparse_attn_bwd(q, kv, idx, sink, o, lse, grad_out, scale, bwd_cfg)

    rows = [("fwd", fwd, fwd_flop), ("bwd", bwd, 2.5 * fwd_flop), ("fwd+bwd", fwd_bwd, 3.5 * fwd_flop)]
    for op, fn, flop in rows:
        ms = time_ms(fn)
        mem = peak_mib(fn)
        tflops = flop / ms / 1e9
        log(f"| triton{tag} {op:8s} | T={T:6d} H={H} D={D} K={K} | {ms:9.3f} | {tflops:7.1f} | "
            f"{tflops / MATMUL_PEAK_TFLOPS:6.3f} | {mem:9.0f} |")
    if with_reference:
        iset = Explicit(idx)

        def ref_fwd():
            sparse_attention_reference(q, kv, iset, sink, scale)

        def ref_fwd_bwd():
            qq, kk, ss = (x.detach().requires_grad_(True) for x in (q, kv, sink))
            o, _ = sparse_attention_reference(qq, kk, iset, ss, scale)
            o.backward(grad_out)

        for op, fn, flop in (("fwd", ref_fwd, fwd_flop), ("fwd+bwd", ref_fwd_bwd, 3.5 * fwd_flop)):
            ms = time_ms(fn, warmup=1, reps=3)
            mem = peak_mib(fn)
            tflops = flop / ms / 1e9
            log(f"| reference {op:8s} | T={T:6d} H={H} D={D} K={K} | {ms:9.3f} | {tflops:7.1f} | "
                f"{tflops / MATMUL_PEAK_TFLOPS:6.3f} | {mem:9.0f} |")


SWEEP_FWD = [dict(BLOCK_N=n, BLOCK_DK=dk, BLOCK_DV=dv, num_warps=w, num_stages=s)
             for n, dk, dv, w, s in [(32, 128, 512, 8, 2), (32, 64, 512, 8, 3), (32, 128, 512, 8, 3),
                                     (16, 128, 512, 8, 2), (32, 128, 512, 4, 2), (64, 64, 512, 8, 1)]]
SWEEP_BWD = [dict(BLOCK_N=n, BLOCK_DK=dk, BLOCK_DV=dv, num_warps=w, num_stages=s)
             for n, dk, dv, w, s in [(32, 64, 128, 4, 2), (32, 64, 256, 8, 2), (32, 64, 128, 4, 3),
                                     (16, 64, 128, 4, 2), (32, 64, 128, 8, 2), (32, 128, 256, 8, 2)]]


def sweep(T: int, log) -> None:
    from dsv4attn.ops.sparse_attention import triton as sat
    q, kv, idx, sink, grad_out = make_inputs(T, "cuda")
    scale, K = D ** -0.5, idx.shape[1]
    fwd_flop = 4.0 * T * H * K * D
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale)
    for cfg in SWEEP_FWD:
        try:
            ms = time_ms(lambda: sat._sparse_attn_fwd(q, kv, idx, sink, scale, cfg))
            log(f"sweep fwd {cfg}: {ms:.3f} ms {fwd_flop / ms / 1e9:.1f} TFLOP/s")
        except Exception as exc:                                           # noqa: BLE001 - report and go on
            log(f"sweep fwd {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}")
    for cfg in SWEEP_BWD:
        try:
            ms = time_ms(lambda: sat._sparse_attn_bwd(q, kv, idx, sink, out, lse, grad_out, scale, cfg))
            log(f"sweep bwd {cfg}: {ms:.3f} ms {2.5 * fwd_flop / ms / 1e9:.1f} TFLOP/s")
        except Exception as exc:                                           # noqa: BLE001
            log(f"sweep bwd {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--check-T", type=int, default=8192, help="0 skips the correctness check")
    parser.add_argument("--reference-T", type=int, default=8192, help="T at which the reference is also timed")
    parser.add_argument("--sweep", action="store_true", help="also time the tile configurations in SWEEP_*")
    parser.add_argument("--log", default=None, help="also append every line to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/sparse_attention.py needs a CUDA device")
    import triton
    sink_file = open(args.log, "a") if args.log else None

    def log(line: str) -> None:
        print(line, flush=True)
        if sink_file:
            sink_file.write(line + "\n")
            sink_file.flush()

    log(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    if args.check_T:
        check(args.check_T, log)
    log("| impl op | shape | ms (median of 10) | TFLOP/s | / 782 peak | peak MiB |")
    log("|---|---|---|---|---|---|")
    for T in args.T:
        bench(T, log, with_reference=(T == args.reference_T))
        torch.cuda.empty_cache()
    if args.sweep:
        sweep(args.T[0], log)


if __name__ == "__main__":
    main()
