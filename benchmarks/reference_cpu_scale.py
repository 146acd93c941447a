"""How large a packed batch the plain-PyTorch reference trains on the CPU (tiny() config).

For each T, a child process builds a pack of documents of ``--doc-len`` tokens (the last one shorter, plus 7 rows
of capacity padding), runs one forward + backward of one layer of each kind (window, CSA, HCA) in the given
phase, and reports wall time and the process's peak resident memory. Run:

    python benchmarks/reference_cpu_scale.py --rows 16384 65536 262144 --phase sparse
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(rows: int, doc_len: int, phase: str, ratio: int) -> dict:
    import torch

    import dsv4attn

    torch.manual_seed(0)
    real = rows - 7
    lengths = [doc_len] * (real // doc_len) + ([real % doc_len] if real % doc_len else [])
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio).train()
    x = torch.randn(rows, layer.config.hidden_size, requires_grad=True)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    y = layer(x, cu_seqlens=cu, max_seqlen=max(lengths), phase=phase)
    y.square().mean().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rows": rows, "ratio": ratio, "phase": phase, "seconds": round(seconds, 2),
            "peak_rss_mib": round(peak / 1024, 1), "rss_before_mib": round(base / 1024, 1),
            "finite": bool(torch.isfinite(x.grad).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16384, 65536, 262144])
    ap.add_argument("--doc-len", type=int, default=4096)
    ap.add_argument("--phase", default="sparse")
    ap.add_argument("--ratios", type=int, nargs="+", default=[0, 4, 128])
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--child", nargs=4, metavar=("ROWS", "DOC_LEN", "PHASE", "RATIO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rows, doc_len, phase, ratio = args.child
        print(json.dumps(child(int(rows), int(doc_len), phase, int(ratio))))
        return
    print(f"{'rows':>9} {'ratio':>5} {'phase':>7} {'fwd+bwd s':>10} {'peak RSS MiB':>13}")
    for rows in args.rows:
        for ratio in args.ratios:
            cmd = [sys.executable, __file__, "--child", str(rows), str(args.doc_len), args.phase, str(ratio)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                r = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
            except subprocess.TimeoutExpired:
                r = None
            if r is None:
                print(f"{rows:>9} {ratio:>5} {args.phase:>7} {'failed/timeout':>10}")
                continue
            print(f"{r['rows']:>9} {r['ratio']:>5} {r['phase']:>7} {r['seconds']:>10} {r['peak_rss_mib']:>13}")


if __name__ == "__main__":
    main()
