"""Query RMSNorm + RoPE (``qnorm_rope``) and the output inverse RoPE (``inverse_rope``) on the GPU: Triton kernels
vs the PyTorch path the layer used before (``apply_rope(rms_norm_unweighted(x))``, ``apply_rope(.., inverse=True)``).

Shapes: V4-Flash queries / attention output (T, 64 heads, 512), bf16, rope_dim 64 with the ratio-4 YaRN table,
positions of four uneven documents plus 77 rows of capacity padding. Both ops are memory-bound; the table reports
bandwidth over the bytes a single pass must move (N = T * 64 * 512 elements, e bytes each):

    qnorm_rope    fwd: read x, write q = 2 N e        fwd+bwd: + read q, dq, write dx = 5 N e
    inverse_rope  fwd: read x, write out = 2 N e      fwd+bwd: + read dout, write dx = 4 N e

(the fp32 cos / sin table, 1/(8 * 64) of the tensor per op, is not counted) against the device-to-device copy
bandwidth measured on the lent H200, 4.3 TB/s (docs/performance.md). Forward runs with autograd recording (what
training does: the reference then also keeps its saved tensors). "peak MiB" is what a call allocates beyond its
inputs; "x PyTorch" is the PyTorch time over the kernel's. Run (CUDA):

    python benchmarks/qnorm_rope.py [--T 8192 32768] [--check-T 8192] [--sweep] [--log FILE]
"""
from __future__ import annotations

import argparse

import torch
from gpu_timing import peak_mib, start_log, time_ms

HBM_GBPS = 4300.0               # device-to-device copy, 4 GiB, measured on the lent H200 (docs/performance.md)
HEADS, HEAD_DIM, ROPE_DIM = 64, 512, 64
PADDING = 77
EPS = 1e-6
BYTES_PER_ELEMENT_PASS = {("qnorm_rope", "fwd"): 2, ("qnorm_rope", "fwd+bwd"): 5, ("inverse_rope", "fwd"): 2,
                          ("inverse_rope", "fwd+bwd"): 4}
SWEEP = [dict(TILE=t, num_warps=w) for t, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16),
                                                (16384, 16))]


def make_inputs(T: int, dtype=torch.bfloat16, seed: int = 0, device="cuda"):
    import dsv4attn
    from dsv4attn.rope import layer_rope_frequencies
    real = T - PADDING
    lengths = [int(0.37 * real) + 1, int(0.29 * real) + 3, int(0.21 * real) + 2]
    lengths.append(real - sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = dsv4attn.pack_batch(cu, T, max(lengths)).row_position
    inv_freq = layer_rope_frequencies(dsv4attn.AttentionConfig.flash(), 4).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, HEADS, HEAD_DIM, device=device, generator=gen).to(dtype)
    grad = torch.randn(T, HEADS, HEAD_DIM, device=device, generator=gen).to(dtype)
    return x, grad, positions, inv_freq


def implementations():
    """{op: {impl: fn(x, positions, inv_freq)}}."""
    from dsv4attn.ops.qnorm_rope import reference, triton
    return {
        "qnorm_rope": {"triton": lambda x, p, f: triton.qnorm_rope_triton(x, p, f, EPS),
                       "pytorch": lambda x, p, f: reference.qnorm_rope_reference(x, p, f, EPS)},
        "inverse_rope": {"triton": triton.inverse_rope_triton, "pytorch": reference.inverse_rope_reference},
    }


def run_grads(fn, x, grad, positions, inv_freq):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x, positions, inv_freq)
    out.backward(grad.to(out.dtype))
    return [out.detach().double(), x.grad.double()]


def check(T: int, log, device="cuda") -> None:
    """Kernel (bf16) and the PyTorch path in bf16, both against float64 on the same inputs (bound 2x out, 3x dx)."""
    x, grad, positions, inv_freq = make_inputs(T, device=device)
    log(f"correctness at T={T}, H={HEADS}, D={HEAD_DIM}, rope {ROPE_DIM}, bf16 (max abs error vs float64)")
    for op, impls in implementations().items():
        kern = run_grads(impls["triton"], x, grad, positions, inv_freq)
        low = run_grads(impls["pytorch"], x, grad, positions, inv_freq)
        exact = run_grads(impls["pytorch"], x.double(), grad.double(), positions, inv_freq)
        for name, k, r, e in zip(("out", "dx"), kern, low, exact):
            ek, er = (k - e).abs().max().item(), (r - e).abs().max().item()
            log(f"  {op:12s} {name:3s} kernel {ek:.3e}  pytorch-bf16 {er:.3e}  ratio {ek / max(er, 1e-30):5.2f}  "
                f"rel-to-max {ek / max(e.abs().max().item(), 1e-30):.2e}")
        del kern, low, exact
        if device == "cuda":
            torch.cuda.empty_cache()


def bench(T: int, log, impl_names=("triton", "pytorch"), tag: str = "") -> None:
    x, grad, positions, inv_freq = make_inputs(T)
    leaf = x.detach().requires_grad_(True)
    for op, impls in implementations().items():
        times = {}
        for impl in impl_names:
            fn = impls[impl]

            def fwd():
                fn(leaf, positions, inv_freq)

            def fwd_bwd():
                torch.autograd.grad(fn(leaf, positions, inv_freq), leaf, grad)

            for name, call in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                ms = time_ms(call)
                times[(impl, name)] = (ms, peak_mib(call))
        for (impl, name), (ms, mem) in times.items():
            nbytes = BYTES_PER_ELEMENT_PASS[(op, name)] * x.numel() * x.element_size()
            gbps = nbytes / ms / 1e6
            base = times.get(("pytorch", name))
            vs = f"{base[0] / ms:6.2f}" if base and impl != "pytorch" else "   -  "
            log(f"| {op} | {impl}{tag} | {T} | {name} | {ms:8.3f} | {gbps:6.0f} | {gbps / HBM_GBPS:5.2f} | "
                f"{mem:8.0f} | {vs} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--check-T", type=int, default=8192, help="0 skips the correctness check")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels with the tiles of SWEEP")
    parser.add_argument("--log", default=None, help="also append every line to this file")
    args = parser.parse_args()
    log = start_log("qnorm_rope.py", args.log)
    from dsv4attn.ops.qnorm_rope import triton as qt
    log(f"tiles {qt.CONFIGS}")
    if args.check_T:
        check(args.check_T, log)
    log("| op | impl | T | pass | ms (median of 10) | GB/s | / 4300 | peak MiB | x PyTorch |")
    log("|---|---|---|---|---|---|---|---|---|")
    for T in args.T:
        bench(T, log)
        torch.cuda.empty_cache()
    if args.sweep:
        saved = {k: dict(v) for k, v in qt.CONFIGS.items()}
        for i, config in enumerate(SWEEP):
            log(f"sweep #{i}: {config} (forward and backward)")
            qt.CONFIGS["fwd"], qt.CONFIGS["bwd"] = dict(config), dict(config)
            try:
                bench(args.T[-1], log, impl_names=("triton",), tag=f"#{i}")
            except Exception as exc:                                   # noqa: BLE001 - report and go on
                log(f"  failed {type(exc).__name__}: {str(exc)[:200]}")
        qt.CONFIGS.update(saved)


if __name__ == "__main__":
    main()
