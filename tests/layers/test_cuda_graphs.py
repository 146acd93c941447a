"""Whole-layer CUDA graphs (GPU): a layer's forward and backward captured once at a fixed capacity and replayed
with other document boundaries (the pack refilled in place: PackedBatch.copy_, docs/packing.md) equal eager runs
of those batches. Skipped without a CUDA GPU."""
from __future__ import annotations

import pytest
import torch

import dsv4attn
from layer_helpers import forward_backward, randomize_

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

T, DOCS, MAX_SEQLEN = 512, 6, 512
BATCHES = [(0, 200, 203, 330, 512), (0, 512), (0, 1, 4, 9, 140, 141, 400)]


def _cu(bounds) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
def test_captured_layer_replays_other_batches_like_eager(ratio, phase):
    torch.manual_seed(0)
    layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio)).cuda().train()
    hidden = layer.config.hidden_size
    static = dsv4attn.pack_batch(_cu(BATCHES[0]), T, MAX_SEQLEN, num_docs=DOCS)
    static_x = torch.randn(T, hidden, device="cuda", requires_grad=True)
    static_g = torch.randn(T, hidden, device="cuda")

    def step():
        y = layer(static_x, pack=static, phase=phase)
        (y * static_g).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):           # warm-up: kernels built, the pack's tables cached
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    # The gradients the graph writes on every replay (the eager runs below give the layer other .grad tensors).
    static_dx = static_x.grad
    static_grads = {n: p.grad for n, p in layer.named_parameters()}
    static_loss = layer.indexer_loss         # the capture's detached loss tensor (None without an indexer loss)

    for b, bounds in enumerate(BATCHES[1:] + BATCHES[:1]):
        x = torch.randn(T, hidden, device="cuda")
        g = torch.randn(T, hidden, device="cuda")
        static.copy_(dsv4attn.pack_batch(_cu(bounds), T, MAX_SEQLEN, num_docs=DOCS))
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        got = (static_y.detach().clone(), static_dx.clone(), {n: g.clone() for n, g in static_grads.items()},
               None if static_loss is None else static_loss.clone())   # the eager run below rewrites the sparse one
        want = forward_backward(layer, x, g, phase, pack=dsv4attn.pack_batch(_cu(bounds), T, MAX_SEQLEN,
                                                                            num_docs=DOCS))
        tol = dict(rtol=1e-4, atol=1e-5)    # fp32 kernels; the backward's atomics add in another order
        where = f"ratio {ratio} {phase} batch {b}"
        torch.testing.assert_close(got[0], want[0], **tol, msg=lambda m: f"{where} output: {m}")
        torch.testing.assert_close(got[1], want[1], **tol, msg=lambda m: f"{where} input grad: {m}")
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=lambda m: f"{where} {name}: {m}")
        assert (got[3] is None) == (want[3] is None), where
        if want[3] is not None:
            torch.testing.assert_close(got[3], want[3], **tol, msg=lambda m: f"{where} indexer loss: {m}")
