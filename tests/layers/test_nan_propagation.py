"""A NaN reaches the same outputs and gradients through the kernels as through the reference (value checks off).

One NaN in one element of the layer input: the reference's NaN pattern (which output rows and which gradient
entries are NaN) is the contract, since a kernel that drops a NaN (a max that ignores it, a "has keys" test that
is false for it, a ReLU written as a maximum) hides a broken step. Each layer kind and phase runs on the reference
backend and on the Triton kernels under the CPU interpreter (in one subprocess: ``tests/ops/interpreter.py``).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.ops.interpreter import run_worker

CASES = ((0, "sparse"), (4, "dense"), (4, "sparse"), (128, "sparse"))


def _run(ratio: int, phase: str, backend_name: str) -> dict:
    import dsv4attn
    from dsv4attn import backend

    cfg = dsv4attn.AttentionConfig.tiny()
    torch.manual_seed(1)
    layer = dsv4attn.HybridAttention(cfg, compress_ratio=ratio)
    cu = torch.tensor([0, 40, 200], dtype=torch.int32)     # the NaN sits in the second document, row 10 of it
    x = torch.randn(208, cfg.hidden_size)
    x[50, 3] = float("nan")
    x.requires_grad_(True)
    backend.set_backend(backend_name)
    try:
        y = layer(x, cu_seqlens=cu, max_seqlen=160, phase=phase)
        y.square().mean().backward()
    finally:
        backend.set_backend(None)
    grads = {"y": y.detach(), "dx": x.grad}
    grads.update({"d" + n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return {name: torch.isnan(t).flatten().nonzero().flatten().tolist() for name, t in grads.items()}


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    out = {f"{r}-{p}": {"reference": _run(r, p, "reference"), "triton": _run(r, p, "triton")} for r, p in CASES}
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def interpreted():
    return run_worker("tests.layers.test_nan_propagation")


@pytest.mark.parametrize("ratio,phase", CASES, ids=[f"ratio{r}-{p}" for r, p in CASES])
def test_nan_pattern_matches_the_reference(interpreted, ratio, phase):
    case = interpreted[f"{ratio}-{phase}"]
    ref, kern = case["reference"], case["triton"]
    assert ref["y"], "the NaN must reach the output at all"
    assert set(ref) == set(kern), (sorted(ref), sorted(kern))
    for name in ref:
        assert kern[name] == ref[name], (f"{name}: NaN at {len(ref[name])} entries in the reference, "
                                         f"{len(kern[name])} through the kernels")
