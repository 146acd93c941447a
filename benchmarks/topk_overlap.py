"""Probe, to be measured and then adopted into the top-k op or deleted: each query chunk's select on a second CUDA
stream, beside the shipped op (one stream), in alternating rounds.

    python benchmarks/topk_overlap.py --T 8192 32768 65536 [--budget-log2 27 26 25 23] [--rounds 7]

Why: the Gluon score kernel's program takes an SM's shared memory (164 KB) and 128 registers x 416 threads; the
select kernel's four-warp program needs 4 KB and 94 registers a thread (96 as allocated: 12,288, what the score
program leaves of the SM's 65,536; offline, sm_90, Triton 3.6.0 and 3.9.0). So one select program can share each
SM with a score program. The select is instruction-bound on integer work and the score kernel leaves issue slots
free (0.61 of the matmul peak at 32K); on a second stream the select of chunk i may run while the scores of chunk
i + 1 are formed. At 32K (three chunks of the default budget) the select is 1.75 of the 6.3 ms top-k, and the
top-k trails cuDNN's SM90 indexer by 1.0 ms (H100, Triton 3.6.0, BENCHMARKS.md, fortieth session). A smaller
budget makes more chunks (more of the select overlapped, each score launch shorter). At 8K the default budget
makes one chunk (nothing to overlap); the score kernel's 408 programs there take 3.09 waves of 132, so chunks of
about a wave each (2^23 words: four chunks of 2048 rows) would cost the score kernel little and let three of the
four selects run beside it.

The overlapped form: two orders buffers of the largest chunk, allocated once; the scores of chunk i go into buffer
i % 2 on the current stream (after the select of chunk i - 2, which read that buffer, is done: an event of the
side stream), an event, the side stream waits for it and selects the chunk; the current stream waits for the side
stream at the end. So two chunks' orders are live at once (the shipped op: one); a buffer freed with
``record_stream`` instead would not come back to the allocator before the side stream passed it, and the host
queues every chunk long before that: every chunk's buffer would be live. Outputs must equal the shipped op's bit
for bit (the same kernels on the same chunks). Prints, per T and budget: ms of each form (medians of alternating
rounds), the ratio, peak MiB of each, and whether the outputs are equal.
"""
from __future__ import annotations

import argparse

import torch
from gpu_timing import paired_ms, peak_mib
from indexer import make_inputs


def overlapped_topk(q, k, w, cand, topk: int, budget: int, side: torch.cuda.Stream):
    """The shipped op's chunk loop (``indexer_topk_ranges_op``) with each chunk's select on ``side``."""
    from dsv4attn import backend
    from dsv4attn.ops.index_sets import contiguous_ranges
    from dsv4attn.ops.indexer import triton as ixt
    first, visible, table, shift = contiguous_ranges(cand)
    width = cand.width
    T, out_width = q.shape[0], min(topk, width)
    out = torch.empty((T, out_width), dtype=torch.int32, device=q.device)
    scores = torch.empty((T, out_width), dtype=torch.float32, device=q.device)
    w = w.float().contiguous()
    config = dict(ixt.CONFIG)
    main = torch.cuda.current_stream()
    chunks = list(ixt.query_chunks(T, width, out_width, budget))
    rows = max(e - s for s, e in chunks)
    buffers = [torch.empty(rows, width, dtype=torch.int32, device=q.device) for _ in range(min(2, len(chunks)))]
    done = [torch.cuda.Event() for _ in buffers]
    with backend.exact_math(q.device):
        for i, (s, e) in enumerate(chunks):
            if i >= 2:
                main.wait_event(done[i % 2])           # chunk i - 2's select has read this buffer
            orders = ixt._score_orders(q[s:e], k, w[s:e], first[s:e], visible[s:e], table, shift, width, config,
                                       out=buffers[i % 2][:e - s])
            formed = torch.cuda.Event()
            formed.record(main)
            side.wait_event(formed)
            with torch.cuda.stream(side):
                ixt._select(orders, first[s:e], visible[s:e], table, shift, out[s:e], scores[s:e], config)
            done[i % 2].record(side)
    main.wait_stream(side)
    return out, scores


def main() -> None:
    import dsv4attn
    from dsv4attn.ops.indexer import triton as ixt
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--budget-log2", type=int, nargs="+", default=[27, 26, 25, 23],
                    help="int32 words per chunk, as log2 (27: the op's default, ORDER_BUDGET)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cfg = dsv4attn.AttentionConfig.flash()
    side = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {__import__('triton').__version__}")
    print("| T | budget | chunks | shipped ms | overlapped ms | x shipped (per round) | peak MiB shipped / overlapped "
          "| outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.T:
        q, k, w, cand, _ = make_inputs(T, 0, cfg)
        topk = cfg.index_topk
        for b in args.budget_log2:
            budget = 1 << b
            chunks = len(list(ixt.query_chunks(T, cand.width, min(topk, cand.width), budget)))

            def shipped():
                return ixt.indexer_topk_triton(q, k, w, cand, topk, budget=budget, return_scores=True)

            def overlapped():
                return overlapped_topk(q, k, w, cand, topk, budget, side)

            a, c = shipped(), overlapped()
            torch.cuda.synchronize()
            same = torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
            ms_a, ms_b, ratios = paired_ms(shipped, overlapped, rounds=args.rounds)
            speed = [1.0 / r for r in ratios]
            print(f"| {T} | 2^{b} | {chunks} | {ms_a:.3f} | {ms_b:.3f} | {ms_a / ms_b:.3f} ({min(speed):.3f} .. "
                  f"{max(speed):.3f}) | {peak_mib(shipped):.0f} / {peak_mib(overlapped):.0f} | "
                  f"{'bitwise' if same else 'DIFFERENT'} |", flush=True)


if __name__ == "__main__":
    main()
