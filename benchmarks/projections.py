"""The layer's input projections, forward + backward, formed together (``layers.common.project_together``: d x
accumulated by the products) against each module called alone, in alternating rounds.

    python benchmarks/projections.py [--rows 32768] [--rounds 7]

Per layer kind (CSA and HCA: q_a, kv and the compressor's kv / gate projections; window: q_a and kv), Flash geometry,
bf16: the median ms of each form and the ratio. The backward's d x is where they differ (the modules alone write one
(rows, hidden) product each and autograd sums them in passes of its own).
"""
from __future__ import annotations

import argparse

import torch
from gpu_timing import paired_ms, start_log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    log = start_log("projections.py", None)
    import dsv4attn
    from dsv4attn.layers.common import can_project_together, project_together
    cfg = dsv4attn.AttentionConfig.flash()
    log("| ratio | projections | alone ms | together ms | x alone (per round) |")
    log("|---|---|---|---|---|")
    for ratio in (4, 128, 0):
        layer = dsv4attn.HybridAttention(cfg, ratio).cuda().bfloat16()
        mods = [layer.q_a_proj, layer.kv_proj]
        if layer.compressor is not None:
            mods += [layer.compressor.kv_proj, layer.compressor.gate_proj]
        x = torch.randn(args.rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert can_project_together(x, mods)
        grads = [torch.randn(args.rows, m.out_features, device="cuda", dtype=torch.bfloat16) for m in mods]

        def together():
            torch.autograd.backward(project_together(x, mods), grads)

        def alone():
            torch.autograd.backward([m(x) for m in mods], grads)

        a, b, ratios = paired_ms(alone, together, rounds=args.rounds)
        speed = [1.0 / r for r in ratios]
        log(f"| {ratio} | {len(mods)} | {a:.3f} | {b:.3f} | {a / b:.3f} ({min(speed):.3f} .. {max(speed):.3f}) |")


if __name__ == "__main__":
    main()
