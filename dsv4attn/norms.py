"""The unweighted RMSNorm of the queries, shared by the layers and the ops' references (neither imports the other)."""
from __future__ import annotations

import torch


# Elements of one chunk of rows. A module constant, not a class attribute: torch.compile (dynamo) cannot read
# attributes of an autograd.Function class inside its forward.
CHUNK_ELEMENTS = 1 << 24


def row_chunks(x: torch.Tensor):
    """(start, end) row ranges of ``x`` holding at most ``CHUNK_ELEMENTS`` elements each (at least one row)."""
    per_row = max(x[0].numel(), 1) if x.shape[0] else 1
    step = max(1, CHUNK_ELEMENTS // per_row)
    return [(s, min(s + step, x.shape[0])) for s in range(0, x.shape[0], step)]


class _UnweightedRMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps), computed in fp32 and rounded once. Saves only x and the (rows, ..., 1) rstd
    (plain autograd would also keep an fp32 copy of x, the largest activation of the layer: T x H x head_dim), and
    works in chunks of rows so that its fp32 temporaries stay bounded (``CHUNK_ELEMENTS``) instead of several
    fp32 copies of (T, H, head_dim) at once, which were the layer's peak memory in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        cd = torch.promote_types(x.dtype, torch.float32)
        out = torch.empty_like(x)
        rstd = torch.empty(x.shape[:-1] + (1,), dtype=cd, device=x.device)
        for s, e in row_chunks(x):
            xf = x[s:e].to(cd)
            rstd[s:e] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            out[s:e] = xf * rstd[s:e]
        ctx.save_for_backward(x, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd = ctx.saved_tensors
        dx = torch.empty_like(x)
        for s, e in row_chunks(x):
            xf, gf, r = x[s:e].to(rstd.dtype), grad[s:e].to(rstd.dtype), rstd[s:e]
            # d/dx_j of x_i * r with r = (mean(x^2) + eps)^-1/2:  r * g_j - r^3 * x_j * mean(g * x)
            dx[s:e] = r * gf - r.pow(3) * xf * (gf * xf).mean(-1, keepdim=True)
        return dx, None


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head unweighted RMSNorm of the queries (docs/semantics.md, "Query path" step 4), statistics in fp32."""
    return _UnweightedRMSNorm.apply(x, eps)
