"""How much of a small op's measured time is host latency: each op timed three ways, in one process.

    python benchmarks/host_latency.py [--T 8192 16384 32768] [--flashmla .peers/flashmla]

- *synchronised*: ``gpu_timing.time_ms``, the method of the other benchmarks: each call is timed alone after a
  synchronisation, so the host's time before the first kernel (Python, the op's dispatch, small preparation kernels'
  launches) counts;
- *back to back*: 20 calls between two events, the host running ahead of the GPU as in a training step;
- *graph*: the call captured once in a CUDA graph and replayed (no host work at all).

Ops: our attention forward (``_sparse_attn_fwd``, the kernel ``benchmarks/sparse_attention.py`` times), FlashMLA's
sparse prefill forward with ``--flashmla``, and our indexer top-k (``indexer_topk_triton``), on those scripts' inputs.
Where the synchronised figure exceeds the others, the difference is host latency, not kernel time: it inflates the
small-T ratios to a peer by the difference of the two sides' host costs.
"""
from __future__ import annotations

import argparse
import sys

from gpu_timing import back_to_back_ms, graph_ms, start_log, time_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--flashmla", default=None, help="folder made by get_flashmla.sh")
    args = ap.parse_args()
    log = start_log("host_latency.py", None)
    import dsv4attn
    from dsv4attn.ops.indexer import triton as ixt
    from dsv4attn.ops.sparse_attention import triton as sat
    from indexer import make_inputs as indexer_inputs
    from sparse_attention import D, make_inputs
    flashmla = None
    if args.flashmla:
        sys.path.insert(0, args.flashmla)
        from load_flashmla import load
        flashmla = load(args.flashmla)
    cfg = dsv4attn.AttentionConfig.flash()
    log("| T | op | synchronised ms | back to back ms | graph ms | synchronised - graph |")
    log("|---|---|---|---|---|---|")
    for T in args.T:
        q, kv, idx, sink, _ = make_inputs(T, "cuda")
        scale = D ** -0.5
        ops = {"attention forward (ours)": lambda: sat._sparse_attn_fwd(q, kv, idx, sink, scale)}
        if flashmla is not None:
            idx3 = idx[:, None].contiguous()
            ops["attention forward (FlashMLA)"] = lambda: flashmla.flash_mla_sparse_fwd(q, kv[:, None], idx3, scale,
                                                                                       D, sink)
        iq, ik, iw, cand, _ = indexer_inputs(T, 0, cfg)
        ops["indexer top-k (ours)"] = lambda: ixt.indexer_topk_triton(iq, ik, iw, cand, cfg.index_topk)
        for name, fn in ops.items():
            synced, ahead = time_ms(fn), back_to_back_ms(fn)
            try:
                replay = graph_ms(fn)
            except Exception as exc:               # an op a graph cannot capture: say so, keep the others
                log(f"  ({name}: no CUDA graph: {type(exc).__name__}: {str(exc)[:120]})")
                replay = float("nan")
            log(f"| {T} | {name} | {synced:.3f} | {ahead:.3f} | {replay:.3f} | {synced - replay:+.3f} |")


if __name__ == "__main__":
    main()
