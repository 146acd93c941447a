"""Indexer KL loss on the GPU: Triton forward / forward+backward vs the reference, one table.

V4-Flash geometry (H = 64 main heads x D = 512, Hi = 64 index heads x Di = 128), bf16 inputs, one document of T
rows. ``sparse``: the candidates are a (T, 512) top-k (an Explicit index set; random among the visible compressed
entries, -1 filled at the end, as the indexer's top-k is); ``warmup``: every visible compressed entry
(VisibleCompressed, up to T/4 per row). FLOPs count valid slots only: forward = 2 * (H * D + Hi * Di) per
(row, candidate) (teacher logits + student dots; two-pass mode computes both twice, not counted), so TFLOP/s is the
useful rate. Times are the median of 10 runs after warm-up (CUDA events); ``indexer_kl_triton`` is called directly
(no argument checks). "peak MiB" is what a call allocates beyond its inputs. Run (CUDA, Triton):

    python benchmarks/indexer_loss.py [--sparse-T 8192 32768] [--warmup-T 8192] [--reference-T 8192 32768]
                                      [--check-T 4096] [--sweep] [--split] [--from-mass] [--log out.txt]

``--from-mass``: also the sparse phase's KL as the layer runs it since 2026-12-07, from a teacher mass the
attention's backward formed (``kl_grads_from_mass_triton``: the KL kernel with the mass and the top-k's scores
given, then the saved-gradient backward; one call, counted as "fwd+bwd"; the mass itself costs the attention
backward ~0.5 ms at 32K, timed by benchmarks/sparse_attention.py).

Target (issue #5): sparse forward+backward <= 2.5 ms at T = 32K; the warm-up must stream (memory linear in T).
"""
from __future__ import annotations

import argparse

import torch
from gpu_timing import peak_mib, start_log, time_ms

MATMUL_PEAK_TFLOPS = 782.0      # bf16 8192^3 matmul measured on the lent H200 (docs/performance.md)
H, D, HI, DI, TOPK, RATIO = 64, 512, 64, 128, 512, 4


def make_inputs(T: int, mode: str, seed: int = 0):
    """(index_q, index_k, index_w, q, compressed_kv, outside_lse, candidates, grad_kl) for one document of T rows."""
    import dsv4attn
    from dsv4attn.ops.index_sets import Explicit, VisibleCompressed
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pack = dsv4attn.pack_batch(torch.tensor([0, T], dtype=torch.int32, device="cuda"), T, T)
    lay = pack.compressed(RATIO)
    Nc = lay.capacity
    if mode == "sparse":
        score = torch.rand(T, Nc, device="cuda", generator=gen)
        score = score.masked_fill(torch.arange(Nc, device="cuda")[None, :] >= lay.row_visible[:, None], -1.0)
        top = torch.topk(score, min(TOPK, Nc), dim=1)
        cand = Explicit(torch.where(top.values >= 0, top.indices, -1).to(torch.int32))
        del score, top
    else:
        cand = VisibleCompressed(lay, T)

    def randn(*shape, std=1.0):
        return (std * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16)
    index_q, index_k = randn(T, HI, DI), randn(Nc, DI)
    index_w = randn(T, HI, std=HI ** -0.5 * DI ** -0.5)
    q, ckv = randn(T, H, D), randn(Nc, D)
    outside = torch.randn(T, H, device="cuda", generator=gen) + 2.0
    grad_kl = torch.full((T,), 1.0 / T, device="cuda")
    pairs = int(lay.row_visible.clamp(max=TOPK).sum()) if mode == "sparse" else int(lay.row_visible.sum())
    return (index_q, index_k, index_w, q, ckv, outside, cand, grad_kl), pairs


def _calls(fn, inputs, **kwargs):
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
    scale = D ** -0.5

    def fwd():          # leaves require grad, as in training: the forward also saves what the backward needs
        leaves = [t.detach().requires_grad_(True) for t in (index_q, index_k, index_w)]
        fn(*leaves, q, ckv, outside, cand, scale, **kwargs)

    def fwd_bwd():
        leaves = [t.detach().requires_grad_(True) for t in (index_q, index_k, index_w)]
        kl = fn(*leaves, q, ckv, outside, cand, scale, **kwargs)
        kl.backward(grad_kl)
    return fwd, fwd_bwd


def check(T: int, log) -> None:
    """Kernel (bf16) and the reference run in bf16, both against the float64 reference on the same inputs."""
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference
    from dsv4attn.ops.indexer_loss.triton import indexer_kl_triton
    for mode in ("sparse", "warmup"):
        inputs, _ = make_inputs(T, mode)

        def grads(fn, widen=False):
            index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
            leaves = [t.detach().clone() for t in (index_q, index_k, index_w)]
            rest = [q, ckv, outside]
            if widen:
                leaves, rest = [t.double() for t in leaves], [t.double() for t in rest]
            leaves = [t.requires_grad_(True) for t in leaves]
            kl = fn(*leaves, *rest, cand, D ** -0.5)
            kl.backward(grad_kl.to(kl.dtype))
            return [kl.detach().double()] + [t.grad.double() for t in leaves]
        kern, low, exact = grads(indexer_kl_triton), grads(indexer_kl_reference), grads(indexer_kl_reference, True)
        log(f"correctness {mode} T={T} bf16 (max abs error vs float64; kernel / reference-bf16; bound 2x KL, 3x grads)")
        for name, k, r, e in zip(("kl", "d_index_q", "d_index_k", "d_index_w"), kern, low, exact):
            ek, er = (k - e).abs().max().item(), (r - e).abs().max().item()
            log(f"  {name:10s} kernel {ek:.3e}  ref-bf16 {er:.3e}  ratio {ek / max(er, 1e-30):5.2f}  "
                f"rel-to-max {ek / max(e.abs().max().item(), 1e-30):.2e}  finite {bool(torch.isfinite(k).all())}")
        del kern, low, exact
        torch.cuda.empty_cache()


def bench(T: int, mode: str, log, with_reference: bool, config=None, bwd_config=None, tag: str = "",
          full: bool = False) -> None:
    """``full``: time the full_lse form (timing only: the outside mass stands in for the full denominators)."""
    from dsv4attn.ops.indexer_loss.reference import indexer_kl_reference
    from dsv4attn.ops.indexer_loss.triton import indexer_kl_triton
    inputs, pairs = make_inputs(T, mode)
    K = inputs[6].width
    flop = 2.0 * pairs * (H * D + HI * DI)
    fwd, fwd_bwd = _calls(indexer_kl_triton, inputs, config=config, bwd_config=bwd_config, full=full)
    fwd_ms, all_ms = time_ms(fwd), time_ms(fwd_bwd)
    mem = peak_mib(fwd_bwd)
    ref = "-", "-", "-", "-"
    if with_reference:
        rfwd, rall = _calls(indexer_kl_reference, inputs)
        r_fwd_ms, r_all_ms = time_ms(rfwd, warmup=1, reps=3), time_ms(rall, warmup=1, reps=3)
        ref = f"{r_fwd_ms:.1f}", f"{r_all_ms:.1f}", f"{r_all_ms / all_ms:.0f}x", f"{peak_mib(rall):.0f}"
    log(f"| {mode}{tag} | {T} | {K} | {fwd_ms:.3f} | {all_ms:.3f} | {all_ms - fwd_ms:.3f} | "
        f"{flop / fwd_ms / 1e9:.0f} ({flop / fwd_ms / 1e9 / MATMUL_PEAK_TFLOPS:.2f}) | {mem:.0f} | "
        f"{ref[0]} | {ref[1]} | {ref[2]} | {ref[3]} |")


def from_mass(T: int, log) -> None:
    """The sparse KL and its gradients from a given teacher mass and student scores (one call)."""
    from dsv4attn.ops.indexer_loss.triton import kl_grads_from_mass_triton
    inputs, pairs = make_inputs(T, "sparse")
    index_q, index_k, index_w, _, _, _, cand, _ = inputs
    idx = cand.rows(0, T).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(1)
    mass = torch.rand(idx.shape, device="cuda", generator=gen) * (idx >= 0)
    scores = torch.randn(idx.shape, device="cuda", generator=gen)
    weight = torch.tensor(1.0 / T, device="cuda")

    def call():
        kl_grads_from_mass_triton(mass, index_q, index_k, index_w, idx, scores, weight)
    ms = time_ms(call)
    log(f"| sparse from mass | {T} | {idx.shape[1]} | - | {ms:.3f} | - | - | {peak_mib(call):.0f} | - | - | - | - |")


def split(T: int, log) -> None:
    """The warm-up teacher's time by part at ``T`` (one document, every visible entry, outside mass given), each part
    alone over all row chunks, as ``indexer_kl_ranges`` runs them on SM90 (Gluon teacher): materialising the chunks'
    slots, teacher LSE, teacher mass (their range form: one device), the student's logits (the indexer's score
    kernel), the KL forward on that mass (those logits, then the KL terms and dKL/dI), the KL backward kernel on a
    saved dKL/dI (one row a program, and as the op runs it: rows in pairs where wide enough); then the op forward
    and forward + backward (the backward without a saved dKL/dI forms the mass, the logits and the forward kernel
    again). FLOPs: teacher logits 2 H D, student dots 2 Hi Di, KL backward
    3 x 2 Hi Di per valid (row, slot) pair (the score kernel's FLOPs count the valid pairs only, as the others do)."""
    from dsv4attn.ops.index_sets import contiguous_ranges
    from dsv4attn.ops.indexer_loss import triton as klt
    from dsv4attn.ops.sparse_attention import gluon_hopper
    inputs, pairs = make_inputs(T, "warmup")
    index_q, index_k, index_w, q, ckv, outside, cand, grad_kl = inputs
    K, scale, cfg = cand.width, D ** -0.5, dict(klt.FWD_CONFIG)
    if not klt._gluon_teacher(q, K):
        log(f"split T={T}: the Gluon teacher does not apply here (needs SM90); nothing timed")
        return
    qi, ki, w, qm, ck = klt._operands(index_q, index_k, index_w, q, ckv)
    first, visible, table, shift = contiguous_ranges(cand)
    chunks = list(klt._range_chunks(first, visible, table, shift, K))
    ranges = klt._student_ranges(first, visible, table, shift, [])
    orders = torch.empty(max(e - s for s, e, _, _ in chunks), K, dtype=torch.int32, device="cuda")
    full = torch.empty(T, H, device="cuda")
    mass = [None] * len(chunks)
    g = [None] * len(chunks)

    def slots():
        for _ in klt._range_chunks(first, visible, table, shift, K):
            pass

    def lse():
        for s, e, idx, n_end in chunks:
            full[s:e] = torch.logaddexp(outside[s:e], gluon_hopper.teacher_lse(
                qm[s:e], ck, idx, scale, n_end=n_end, first=ranges.rows(s, e).first_rows()))

    def teacher_mass():
        for i, (s, e, idx, n_end) in enumerate(chunks):
            mass[i] = gluon_hopper.teacher_mass(qm[s:e], ck, idx, full[s:e], scale, n_end=n_end,
                                                first=ranges.rows(s, e).first_rows())

    def student():
        for s, e, _, _ in chunks:
            klt._student_orders(qi[s:e], ki, w[s:e], ranges.rows(s, e), K, orders[:e - s])

    def kl_forward():
        for i, (s, e, idx, n_end) in enumerate(chunks):
            rows = (qi[s:e], ki, w[s:e], qm[s:e], ck)
            g[i] = klt._kl_forward(rows, full[s:e], [(0, e - s, idx, n_end)], K, scale, True, cfg, True, mass[i],
                                   ranges=ranges.rows(s, e))

    def kl_backward(pairs: bool):
        for i, (s, e, idx, n_end) in enumerate(chunks):
            rows = (qi[s:e], ki, w[s:e], qm[s:e], ck)
            _, full2, rowstat, g_rows = g[i]
            klt._kl_backward(grad_kl[s:e], rows, full2, rowstat, g_rows, [(0, e - s, idx, n_end)], K, scale,
                             klt._bwd_config(klt._tiles(None, klt.BWD_CONFIG, klt.BWD_KEYS, "bwd_config")),
                             ranges.rows(s, e) if pairs else None)
    fwd, fwd_bwd = _calls(klt.indexer_kl_triton, inputs)
    teacher, student_flop = 2.0 * pairs * H * D, 2.0 * pairs * HI * DI
    log(f"warm-up teacher by part, T={T}, K={K}, {len(chunks)} row chunks, {pairs} valid (row, slot) pairs")
    log("| part | ms | TFLOP | TFLOP/s (/782) |")
    log("|---|---|---|---|")
    for name, fn, flop in (("materialise the slots", slots, 0.0), ("teacher LSE (Gluon)", lse, teacher),
                           ("teacher mass (Gluon)", teacher_mass, teacher),
                           ("student logits (indexer score kernel)", student, student_flop),
                           ("KL forward, mass given (logits + KL kernel)", kl_forward, student_flop),
                           ("KL backward kernel, dKL/dI given, one row a program",
                            lambda: kl_backward(False), 3 * student_flop),
                           (f"KL backward kernel, dKL/dI given, as the op runs it (rows in pairs from "
                            f"{klt.PAIRS_MIN_WIDTH} slots)", lambda: kl_backward(True), 3 * student_flop),
                           ("op forward", fwd, 2 * teacher + student_flop),
                           ("op forward + backward", fwd_bwd, 3 * teacher + 5 * student_flop)):
        ms = time_ms(fn)
        rate = f"{flop / ms / 1e9:.0f} ({flop / ms / 1e9 / MATMUL_PEAK_TFLOPS:.2f})" if flop else "-"
        log(f"| {name} | {ms:.3f} | {flop / 1e12:.2f} | {rate} |")


def _cfg(base: dict, **changes) -> dict:
    return dict(base, **changes)


def sweep(T: int, log) -> None:
    """Forward tile configurations (sparse mode), then backward ones; same table columns."""
    from dsv4attn.ops.indexer_loss import triton as klt
    f, b = klt.FWD_CONFIG, klt.BWD_CONFIG
    for cfg in (_cfg(f, num_warps=16), _cfg(f, BLOCK_HI=32), _cfg(f, BLOCK_HI=32, num_warps=4), _cfg(f, BLOCK_D=32),
                _cfg(f, BLOCK_D=128, num_stages=1), _cfg(f, num_stages=3), _cfg(f, BLOCK_N=128)):
        try:
            bench(T, "sparse", log, False, config=cfg, tag=f" fwd {cfg}")
        except Exception as exc:                                           # noqa: BLE001 - report and go on
            log(f"sweep fwd {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}")
    for cfg in (_cfg(b, BLOCK_N=32), _cfg(b, BLOCK_N=128), _cfg(b, num_warps=4),
                _cfg(b, num_stages=3)):
        try:
            bench(T, "sparse", log, False, bwd_config=cfg, tag=f" bwd {cfg}")
        except Exception as exc:                                           # noqa: BLE001
            log(f"sweep bwd {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sparse-T", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--warmup-T", type=int, nargs="*", default=[8192])
    parser.add_argument("--reference-T", type=int, nargs="*", default=[8192, 32768],
                        help="T at which the reference is also timed (slow: seconds in the warm-up mode)")
    parser.add_argument("--check-T", type=int, default=4096, help="0 skips the correctness check")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations (sparse mode)")
    parser.add_argument("--full-lse", action="store_true",
                        help="also time the sparse mode's full_lse form, teacher mass from Gluon (SM90) and Triton")
    parser.add_argument("--split", action="store_true", help="also time the warm-up teacher's parts at each warmup-T")
    parser.add_argument("--from-mass", action="store_true",
                        help="also time the sparse KL from a given teacher mass (what the layer runs)")
    parser.add_argument("--log", default=None, help="also append every line to this file")
    args = parser.parse_args()
    log = start_log("indexer_loss.py", args.log)
    log(f"H={H} D={D} Hi={HI} Di={DI} bf16")
    if args.check_T:
        check(args.check_T, log)
    log("| mode | T | K | fwd ms | fwd+bwd ms | bwd ms | fwd TFLOP/s (/782) | peak MiB | ref fwd ms | "
        "ref fwd+bwd ms | speed-up | ref peak MiB |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, Ts in (("sparse", args.sparse_T), ("warmup", args.warmup_T)):
        for T in Ts:
            bench(T, mode, log, with_reference=T in args.reference_T)
            torch.cuda.empty_cache()
    if args.full_lse:
        from dsv4attn import variants
        key = ("indexer_kl", "teacher_mass", (D, torch.bfloat16))
        for T in args.sparse_T:
            bench(T, "sparse", log, False, tag=" full_lse, Gluon teacher mass", full=True)
            variants.FAILED[key] = "switched off by the benchmark"
            bench(T, "sparse", log, False, tag=" full_lse, Triton teacher", full=True)
            del variants.FAILED[key]
    if args.from_mass:
        for T in args.sparse_T:
            from_mass(T, log)
            torch.cuda.empty_cache()
    if args.split:
        for T in args.warmup_T:
            split(T, log)
            torch.cuda.empty_cache()
    if args.sweep and args.sparse_T:
        sweep(args.sparse_T[-1], log)


if __name__ == "__main__":
    main()
