"""``python -m dsv4attn.env``: versions, devices and which backend each op uses."""
from __future__ import annotations

import platform

import torch

from . import __version__, backend, checks

OPS = ("sparse_attention", "compress_pool", "indexer_topk", "indexer_kl", "qnorm_rope", "rope_rotate", "inverse_rope")


def report() -> str:
    lines = [f"dsv4attn {__version__}", f"python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        import triton
        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton not installed (reference backend only)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    else:
        lines.append("no CUDA device")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for op in OPS:
        lines.append(f"op {op:<17} -> {backend.choose(op, device)} on {device.type}")
    lines.append(f"checks: {checks.checks_mode()!r} (batch metadata validated per batch; NaN/Inf scans "
                 f"{'on' if checks.checks_enabled() else 'off: DSV4ATTN_CHECKS=values turns them on'})")
    if device.type == "cuda" and backend.choose("sparse_attention", device) == "triton":
        from .ops.sparse_attention import triton as sparse_triton
        q = torch.empty(1, 64, 512, device=device, dtype=torch.bfloat16)
        lines.append(f"sparse_attention forward kernel (bf16, 64 heads, D = 512) -> "
                     f"{sparse_triton.forward_kernel(q)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
