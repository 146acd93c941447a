"""One HybridAttention layer, forward + backward: time and peak memory per ratio and phase (one table).

    python benchmarks/layer.py --preset flash --rows 8192 32768 65536 --ratios 0 4 128 --phases sparse

Each case runs once to warm up, then once timed. ``live before`` is the memory still allocated when the case
starts (after garbage collection): anything but the inputs there means the previous case leaked.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

import dsv4attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--ratios", type=int, nargs="+", default=[0, 4, 128])
    ap.add_argument("--phases", nargs="+", default=["sparse"])
    ap.add_argument("--doc-len", type=int, default=0, help="0: one document spanning the batch")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = getattr(dsv4attn.AttentionConfig, args.preset)()
    dsv4attn.set_checks(False)
    gib = 2.0 ** 30
    print(f"{args.preset} geometry, {dtype}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    print("| T | ratio | phase | fwd ms | fwd+bwd ms | peak GiB | live before GiB |")
    print("|---|---|---|---|---|---|---|")
    for T in args.rows:
        doc = args.doc_len or T
        cu = torch.tensor([0] + [doc] * (T // doc), dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
        for ratio in args.ratios:
            layer = dsv4attn.HybridAttention(cfg, ratio).to(device=device, dtype=dtype).train()
            for phase in args.phases:
                x = torch.randn(T, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
                for timed in (False, True):
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    live = torch.cuda.memory_allocated() / gib if device.type == "cuda" else float("nan")
                    start = time.perf_counter()
                    y = layer(x, cu_seqlens=cu, max_seqlen=doc, phase=phase)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    fwd = (time.perf_counter() - start) * 1e3
                    y.float().square().mean().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    total = (time.perf_counter() - start) * 1e3
                    del y
                    x.grad = None
                    layer.zero_grad(set_to_none=True)
                peak = torch.cuda.max_memory_allocated() / gib if device.type == "cuda" else float("nan")
                print(f"| {T} | {ratio} | {phase} | {fwd:.1f} | {total:.1f} | {peak:.1f} | {live:.2f} |", flush=True)
            del layer


if __name__ == "__main__":
    main()
