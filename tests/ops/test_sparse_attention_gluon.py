"""The Gluon (SM90) sparse-attention forward against the float64 reference, on the edge cases of the contract; its
refusals (on any machine).

Runs only where the kernel applies (an SM90 GPU with Triton's Gluon); the V4-shape accuracy test of
test_sparse_attention_gpu.py runs it too. Bound: error <= 2x the reference op's own error in the same dtype (both
against float64 on the same rounded inputs) plus 1e-6 of the largest magnitude.
"""
from __future__ import annotations

import pytest
import torch

from dsv4attn.ops.index_sets import Explicit
from dsv4attn.ops.sparse_attention import gluon_hopper
from dsv4attn.ops.sparse_attention import triton as sat
from dsv4attn.ops.sparse_attention.reference import sparse_attention_reference

ON_SM90 = torch.cuda.is_available() and gluon_hopper.available(
    torch.empty(1, 64, 128, device="cuda", dtype=torch.bfloat16))
sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an SM90 GPU and Triton's Gluon")


def inputs(T, H, D, K, N, dtype, gen, sink_kind="random"):
    q = torch.randn(T, H, D, generator=gen).to("cuda", dtype)
    kv = torch.randn(N, D, generator=gen).to("cuda", dtype)
    idx = torch.randint(0, N, (T, K), generator=gen, dtype=torch.int32)
    idx = idx.masked_fill(torch.rand(T, K, generator=gen) < 0.2, -1)       # holes
    idx[:, 1] = idx[:, 0]                                                  # duplicates count once per occurrence
    idx[3] = -1                                                            # a row with no valid slot
    if T > 8:
        idx[7, 1:] = -1                                                    # a row with one valid slot
    sink = {"random": torch.randn(H, generator=gen), "-inf": torch.full((H,), float("-inf")),
            "large": torch.full((H,), 30.0)}[sink_kind]
    return q, kv, idx.cuda(), sink.cuda()


@sm90
@pytest.mark.parametrize("T,H,D,K,N,dtype,sink_kind", [
    (64, 64, 512, 640, 300, torch.bfloat16, "random"),
    (48, 128, 512, 600, 1000, torch.bfloat16, "random"),     # two head blocks; K not a multiple of the block
    (40, 64, 512, 100, 50, torch.float16, "-inf"),
    (40, 64, 256, 130, 500, torch.bfloat16, "large"),
    (33, 64, 128, 64, 64, torch.bfloat16, "random"),
    (20, 64, 512, 7, 5, torch.bfloat16, "random"),           # fewer slots than one block
])
@pytest.mark.parametrize("config", [dict(), dict(BLOCK_N=32, STAGES=4), dict(BLOCK_N=32, STAGES=3)],
                         ids=["default", "32x4", "32x3"])
def test_gluon_forward_matches_float64_reference(T, H, D, K, N, dtype, sink_kind, config):
    gen = torch.Generator().manual_seed(T * 7 + K)
    q, kv, idx, sink = inputs(T, H, D, K, N, dtype, gen, sink_kind)
    scale = D ** -0.5
    out, lse = sat._sparse_attn_fwd(q, kv, idx, sink, scale, dict(config, KERNEL="gluon"))
    assert sat.forward_kernel(q, {"KERNEL": "gluon"}) == "gluon"
    low = sparse_attention_reference(q, kv, Explicit(idx), sink, scale)
    exact = sparse_attention_reference(q.double(), kv.double(), Explicit(idx), sink.double(), scale)
    for name, k, r, e in zip(("out", "lse"), (out, lse), low, exact):
        k, r, e = k.double(), r.double(), e.double()
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(k), finite) and torch.equal(k[~finite], e[~finite]), \
            f"{name}: inf pattern differs from float64"
        err_k = (k - e)[finite].abs().max().item()
        err_r = (r - e)[finite].abs().max().item()
        assert err_k <= 2.0 * err_r + 1e-6 * e[finite].abs().max().item(), \
            f"{name}: kernel error {err_k:.3e}, reference {dtype} error {err_r:.3e}"
    assert torch.all(out[3] == 0) and torch.all(lse[3] == float("-inf"))


@pytest.mark.parametrize("shape,dtype", [((4, 48, 512), torch.bfloat16), ((4, 64, 512), torch.float32)])
def test_gluon_forward_refuses_what_it_cannot_run(shape, dtype):
    """H not a multiple of 64, fp32 (and, without an SM90 GPU, every input): a clear error; "auto" picks Triton."""
    q = torch.randn(*shape, device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype)
    with pytest.raises(ValueError, match="KERNEL='gluon'"):
        sat.forward_kernel(q, {"KERNEL": "gluon"})
    assert sat.forward_kernel(q, {"KERNEL": "auto"}) == "triton"
    with pytest.raises(ValueError, match="forward KERNEL must be"):
        sat.forward_kernel(q, {"KERNEL": "cuda"})


def test_auto_falls_back_to_triton_once_when_gluon_cannot_build(monkeypatch):
    """"auto" on a machine where the Gluon kernel fails to build: one warning, then the Triton kernel every time;
    an explicit KERNEL="gluon" raises the failure instead. (Kernel launches are stubbed: this is dispatch logic.)"""
    def broken(*args, **kwargs):
        raise RuntimeError("this Triton cannot build the Gluon kernel")

    launched = []
    monkeypatch.setattr(sat, "_GLUON_FAILED", None)
    monkeypatch.setattr(sat, "FORWARD_KERNEL", "auto")
    monkeypatch.setattr(gluon_hopper, "available", lambda q: True)
    monkeypatch.setattr(gluon_hopper, "launch_fwd", broken)
    monkeypatch.setattr(sat, "_launch", lambda kernel, grid_of, q, config, args: launched.append(kernel))
    q, kv = torch.zeros(2, 64, 128, dtype=torch.bfloat16), torch.zeros(3, 128, dtype=torch.bfloat16)
    idx, sink = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(64)
    with pytest.warns(RuntimeWarning, match="Gluon sparse-attention forward failed"):
        sat._sparse_attn_fwd(q, kv, idx, sink, 0.1)
    assert launched == [sat._sparse_attn_fwd_kernel] and sat.forward_kernel(q) == "triton"
    sat._sparse_attn_fwd(q, kv, idx, sink, 0.1)                         # no second attempt, no second warning
    assert len(launched) == 2
    with pytest.raises(RuntimeError, match="cannot build"):
        sat._sparse_attn_fwd(q, kv, idx, sink, 0.1, {"KERNEL": "gluon"})
