"""Lightning-indexer scores + deterministic top-k on the GPU: Triton vs the reference, one table.

Flash geometry from ``AttentionConfig.flash()`` (index_n_heads 64, index_head_dim 128, index_topk 512, ratio 4),
bf16 inputs, one document of T rows by default (``--doc-len`` packs equal documents instead). FLOPs follow
docs/performance.md: score = 2 * Hi * Di * (visible pairs) = 2 * Hi * Di * sum_t row_visible[t] (~ T^2 / 8 for
one document). ``score ms`` runs only the score kernel over the same query chunks; ``top-k ms`` is the rest
(total - score: the select kernel over the int32 score orders, which also maps the indices). Times are the median
of 10 runs after warm-up (CUDA events); the kernels are called directly (no argument checks). Run (CUDA, Triton):

    python benchmarks/indexer.py --T 8192 32768 131072 262144 [--reference-T 8192 32768] [--check-T 8192]
                                 [--sweep] [--cudnn .peers] [--log out.txt]

``--cudnn .peers`` (one document only) also times cuDNN Frontend 1.32's SM90 indexer on the same inputs, the path
Megatron takes on Hopper: ``indexer_forward_wrapper`` (a dense (T, T/4) fp32 score matrix, causal at ratio 4) then
``indexer_top_k_wrapper`` (radix top-k, ties to the lower index), its wheels under ``.peers/cudnn_b``
(docs/performance.md, "Peers": a first device call stashes ``.peers/cudnn_a``). Ours and cuDNN's alternate over 7
rounds (medians); the row prints the ratio, both peak memories and the share of rows where both select the same
set. Where cuDNN runs out of memory the row says so.
"""
from __future__ import annotations

import argparse

import torch
from gpu_timing import paired_ms, peak_mib, start_log, time_ms

MATMUL_PEAK_TFLOPS = 782.0      # bf16 8192^3 matmul measured on the lent H200 (docs/performance.md)
RATIO = 4


def make_inputs(T: int, doc_len: int, cfg, seed: int = 0):
    import dsv4attn
    from dsv4attn.ops.index_sets import VisibleCompressed
    doc = doc_len or T
    lengths = [doc] * (T // doc) + ([T % doc] if T % doc else [])
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    pack = dsv4attn.pack_batch(cu, T, doc)
    lay = pack.compressed(RATIO)
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, Hi, Di, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(lay.capacity, Di, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(T, Hi, device="cuda", generator=gen) * (Hi * Di) ** -0.5
    pairs = int(lay.row_visible.sum())
    return q, k, w, VisibleCompressed(lay, T), pairs


def chosen_scores(q, k, w, chosen):
    """(T, K) float64 scores of the chosen key rows, -inf at -1 slots (chunked: bounded memory)."""
    parts = []
    for s in range(0, chosen.shape[0], 256):
        rows = k.double()[chosen[s:s + 256].long().clamp(min=0)]
        dots = torch.einsum("thd,tkd->thk", q[s:s + 256].double(), rows)
        parts.append((torch.relu(dots) * w[s:s + 256].double()[..., None]).sum(1))
    return torch.cat(parts).masked_fill(chosen < 0, float("-inf"))


def check(T: int, cfg, doc_len: int, log) -> None:
    """Triton vs reference at T: the -1 pattern, the scores of the chosen sets, how many rows chose differently."""
    from dsv4attn.ops.indexer.reference import indexer_topk_reference
    from dsv4attn.ops.indexer.triton import indexer_topk_triton
    q, k, w, cand, _ = make_inputs(T, doc_len, cfg, seed=1)
    got = indexer_topk_triton(q, k, w, cand, cfg.index_topk)
    want = indexer_topk_reference(q, k, w, cand, cfg.index_topk)
    a = chosen_scores(q, k, w, got).sort(1, descending=True).values
    b = chosen_scores(q, k, w, want).sort(1, descending=True).values
    fin = torch.isfinite(b)
    err = ((a - b).abs()[fin].max() / b[fin].abs().max()).item()
    rows_differ = (got.sort(1).values != want.sort(1).values).any(1).float().mean().item()
    log(f"check T={T} bf16: same -1 pattern {bool(torch.equal(got >= 0, want >= 0))}, chosen-score error "
        f"{err:.2e} of the largest score, rows with another set {rows_differ:.2%}, identical indices "
        f"{bool(torch.equal(got, want))}")
    del q, k, w, got, want, a, b
    torch.cuda.empty_cache()


def bench(T: int, cfg, doc_len: int, log, with_reference: bool, config=None, tag: str | None = None) -> None:
    from dsv4attn.ops.index_sets import contiguous_ranges
    from dsv4attn.ops.indexer import triton as ixt
    from dsv4attn.ops.indexer.reference import indexer_topk_reference
    q, k, w, cand, pairs = make_inputs(T, doc_len, cfg)
    topk, Hi, Di = cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim
    flop = 2.0 * Hi * Di * pairs
    first, visible, _, _ = contiguous_ranges(cand)
    width = cand.width
    config = dict(ixt.CONFIG, **(config or {}))
    chunks = list(ixt.query_chunks(T, width, min(topk, width), ixt.ORDER_BUDGET))

    def full():
        ixt.indexer_topk_triton(q, k, w, cand, topk, config=config)

    def scores_only():
        for s, e in chunks:
            ixt._score_orders(q[s:e], k, w[s:e], first[s:e], visible[s:e], None, 0, width, config)

    ms = time_ms(full)
    score_ms = time_ms(scores_only)
    if tag is None:       # which score kernel ran (after the run: a Gluon build failure has been recorded by then)
        gluon = ixt._use_gluon_scores(q, k, config)
        tag = f"{'gluon' if gluon else 'triton'} scores"
        from dsv4attn import variants
        failed = {k: v for k, v in variants.FAILED.items() if k[:2] == ("indexer_topk", "scores")}
        if failed:
            log(f"  (Gluon score kernel could not be built: {failed})")
    mem = peak_mib(full)
    shape = f"T={T} doc={doc_len or T} Hi={Hi} Di={Di} k={topk} chunks={len(chunks)}"
    log(f"| {tag} | {shape} | {pairs:.3e} | {ms:9.2f} | {score_ms:9.2f} | {ms - score_ms:9.2f} | "
        f"{flop / score_ms / 1e9:7.1f} | {flop / ms / 1e9:7.1f} | {flop / score_ms / 1e9 / MATMUL_PEAK_TFLOPS:6.3f} | "
        f"{mem:9.0f} |")
    if with_reference:
        def ref():
            indexer_topk_reference(q, k, w, cand, topk)
        ref_ms = time_ms(ref, warmup=1, reps=3)
        ref_mem = peak_mib(ref)
        log(f"| reference | {shape} | {pairs:.3e} | {ref_ms:9.2f} | - | - | - | {flop / ref_ms / 1e9:7.1f} | "
            f"{flop / ref_ms / 1e9 / MATMUL_PEAK_TFLOPS:6.3f} | {ref_mem:9.0f} |   (triton {ref_ms / ms:.1f}x faster)")


def bench_cudnn(T: int, cfg, log, cudnn_dir: str) -> None:
    """Ours against cuDNN's SM90 indexer (score matrix + top-k) on one document of T rows (module docstring)."""
    from dsv4attn.ops.indexer import triton as ixt
    q, k, w, cand, pairs = make_inputs(T, 0, cfg)
    topk, flop = cfg.index_topk, 2.0 * cfg.index_n_heads * cfg.index_head_dim * pairs
    forward, top_k = load_cudnn_indexer(cudnn_dir)
    layout = cand.layout
    seq_lens = layout.row_visible.to(torch.int32)
    q4, k4, w3 = q[None], k[None, :, None], w[None].float()

    def ours():
        return ixt.indexer_topk_triton(q, k, w, cand, topk)

    def theirs():
        scores = forward(q4, k4, w3, ratio=RATIO, sm_scale=1.0)["scores"][0]
        return top_k(scores, seq_lens, topk, tie_break=1)["indices"]

    shape = f"T={T} doc={T} Hi={cfg.index_n_heads} Di={cfg.index_head_dim} k={topk}"
    try:
        same = (ours().sort(1).values == theirs().to(torch.int32).sort(1).values).all(1).float().mean().item()
        ours_ms, cudnn_ms, ratios = paired_ms(ours, theirs)
        mine, other = peak_mib(ours), peak_mib(theirs)
    except torch.OutOfMemoryError:
        log(f"| cuDNN 1.32 SM90 indexer | {shape} | {pairs:.3e} | out of memory (its (T, T/4) fp32 score matrix: "
            f"{T * (T // 4) * 4 / 2**30:.1f} GiB) |")
        torch.cuda.empty_cache()
        return
    log(f"| ours vs cuDNN 1.32 SM90 indexer | {shape} | {pairs:.3e} | {ours_ms:9.2f} vs {cudnn_ms:9.2f} | "
        f"x cuDNN {cudnn_ms / ours_ms:5.2f} (per round {min(ratios):.2f} .. {max(ratios):.2f}) | "
        f"{flop / ours_ms / 1e9:7.1f} vs {flop / cudnn_ms / 1e9:7.1f} TFLOP/s | peak MiB {mine:.0f} vs {other:.0f} | "
        f"same set on {same:.2%} of rows |")


def load_cudnn_indexer(folder: str):
    """(indexer_forward_wrapper, indexer_top_k_wrapper) of the cuDNN Frontend wheels under ``folder/cudnn_b``."""
    import sys
    sys.path.insert(0, f"{folder}/cudnn_b")
    from load_cudnn_dsa import load
    load(f"{folder}/cudnn_b")              # installs the wheels (and puts them on the path) on first use
    from cudnn.deepseek_sparse_attention.indexer_forward.api import indexer_forward_wrapper
    from cudnn.deepseek_sparse_attention.indexer_top_k.api import indexer_top_k_wrapper
    return indexer_forward_wrapper, indexer_top_k_wrapper


SWEEP = [dict(BLOCK_T=t, BLOCK_E=e, num_warps=nw, num_stages=ns)
         for t, e, nw, ns in [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3),
                              (128, 128, 8, 2), (64, 256, 8, 2), (32, 128, 4, 3)]]
# Select kernel variants (the score kernel at its default): columns per tile, elements per program tile, warps (at
# every width: the one-warp rule for short rows off).
SWEEP += [dict(SELECT_TILE=c, SELECT_BLOCK=c, SELECT_WARPS=nw, SELECT_SHORT_WIDTH=0)
          for c, nw in [(1024, 8), (2048, 4), (2048, 8)]]
# The Triton score tiles are timed with KERNEL="triton" (on SM90 "auto" takes the Gluon score kernel); the first of
# them is the Triton default, to set beside the Gluon kernel of the main row.
SWEEP = [dict(KERNEL="triton", **c) for c in SWEEP[:7]] + SWEEP[7:]


def sweep(T: int, cfg, doc_len: int, log) -> None:
    for config in SWEEP:
        try:
            bench(T, cfg, doc_len, log, with_reference=False, config=config, tag=f"sweep {config}")
        except Exception as exc:                                           # noqa: BLE001 - report and go on
            log(f"sweep {config}: failed {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072, 262144])
    parser.add_argument("--doc-len", type=int, default=0, help="0: one document spanning the batch")
    parser.add_argument("--reference-T", type=int, nargs="*", default=[8192, 32768],
                        help="T values at which the reference is also timed (slow: it gathers every candidate)")
    parser.add_argument("--check-T", type=int, default=8192, help="0 skips the correctness check")
    parser.add_argument("--sweep", action="store_true", help="also time the tile configurations in SWEEP at T[0]")
    parser.add_argument("--cudnn", default=None, help="folder holding cudnn_b of get_cudnn_dsa.sh, e.g. .peers "
                        "(optional peer: cuDNN's SM90 indexer; one document only)")
    parser.add_argument("--log", default=None, help="also append every line to this file")
    args = parser.parse_args()
    if args.cudnn and args.doc_len:
        parser.error("--cudnn times one document per batch: leave --doc-len out")
    log = start_log("indexer.py", args.log)
    log("bf16 inputs")
    import dsv4attn
    cfg = dsv4attn.AttentionConfig.flash()
    if args.check_T:
        check(args.check_T, cfg, args.doc_len, log)
    log("| impl | shape | visible pairs | ms (median of 10) | score ms | top-k ms | score TFLOP/s | "
        "end-to-end TFLOP/s | / 782 peak (triton: score; reference: end-to-end) | peak MiB |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for T in args.T:
        bench(T, cfg, args.doc_len, log, with_reference=T in args.reference_T)
        torch.cuda.empty_cache()
        if args.cudnn:
            bench_cudnn(T, cfg, log, args.cudnn)
            torch.cuda.empty_cache()
    if args.sweep:
        sweep(args.T[0], cfg, args.doc_len, log)


if __name__ == "__main__":
    main()
