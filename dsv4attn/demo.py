"""``python -m dsv4attn.demo``: one layer of each kind, every phase, forward + backward on a ragged pack.

A short tour on the CPU (tiny config, a few seconds): documents of 1 to 300 tokens with an empty document and
capacity padding, packed THD; prints output norm, indexer loss, that padding rows stay 0, and the time of each
run. Use ``--preset flash --device cuda`` on a GPU for the real geometry.
"""
from __future__ import annotations

import argparse
import time

import torch

from . import AttentionConfig, HybridAttention

LENGTHS = (1, 3, 4, 5, 0, 17, 131, 42, 300, 9)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "flash", "pro"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--padding", type=int, default=8, help="capacity-padding rows after the documents")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = getattr(AttentionConfig, args.preset)()
    torch.manual_seed(0)
    cu = torch.tensor((0,) + LENGTHS, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)
    real = int(cu[-1])
    x = torch.randn(real + args.padding, cfg.hidden_size, device=device)
    print(f"dsv4attn demo: {args.preset} config on {device}; documents {LENGTHS} + {args.padding} padding rows")
    print(f"{'layer':<8} {'phase':<7} {'|y|':>9} {'indexer loss':>13} {'pad rows 0':>10} {'fwd+bwd ms':>11}")
    for ratio, name in ((0, "window"), (4, "CSA"), (128, "HCA")):
        layer = HybridAttention(cfg, ratio).to(device).train()
        for phase in ("dense", "warmup", "sparse"):
            xi = x.clone().requires_grad_(True)
            start = time.perf_counter()
            y = layer(xi, cu_seqlens=cu, max_seqlen=max(LENGTHS), phase=phase)
            y.square().mean().backward()
            ms = (time.perf_counter() - start) * 1e3
            loss = "-" if layer.indexer_loss is None else f"{float(layer.indexer_loss):.3e}"
            padding_zero = bool((y[real:] == 0).all() and (xi.grad[real:] == 0).all())
            print(f"{name:<8} {phase:<7} {float(y.detach().norm()):>9.3f} {loss:>13} {str(padding_zero):>10} "
                  f"{ms:>11.1f}")


if __name__ == "__main__":
    main()
