"""``python -m dsv4attn.env``: versions, devices and which backend each op uses."""
from __future__ import annotations

import platform

import torch

from . import __version__, backend, checks, variants

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
    lines.append(f"kernels: {variants.kernels_mode()!r} ({variants.ENV}=auto|triton|gluon)")
    for op in OPS:
        lines.append(f"op {op:<17} -> {backend.choose(op, device)} on {device.type}")
        lines.extend(_passes(op, device))
    lines.append(f"checks: {checks.checks_mode()!r} (batch metadata validated per batch; NaN/Inf scans "
                 f"{'on' if checks.checks_enabled() else 'off: DSV4ATTN_CHECKS=values turns them on'})")
    return "\n".join(lines)


def _passes(op: str, device: torch.device) -> list[str]:
    """One line per pass of ``op``: what runs on ``device`` and why the others do not."""
    passes = [p for o, p in variants.PASSES if o == op]
    if backend.choose(op, device) == "reference":
        why = ("DSV4ATTN_BACKEND=reference" if backend.forced() == "reference" else
               "Triton not installed" if not backend.triton_available() else "no CUDA device")
        return [f"  {p:<15} reference ({why})" for p in passes]
    out = []
    for p in passes:
        found = variants.explain(op, p, device)
        runs = next(name for name, usable, _ in found if usable)
        if runs == "triton" and device.type != "cuda":
            runs = "triton (interpreter)"
        others = "; ".join(f"{name}: {reason}" for name, usable, reason in found if not usable)
        out.append(f"  {p:<15} {runs}" + (f" ({others})" if others else ""))
    return out


if __name__ == "__main__":
    print(report())
