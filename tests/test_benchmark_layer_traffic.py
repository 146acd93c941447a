"""``benchmarks/layer_traffic.py``: the op log of a layer's eager forward + backward on fake tensors.

The window-only layer's forward matmul FLOPs equal the count from its shapes (q_a, q_b, kv, the grouped o_a and
o_b projections), and no layer kind's step holds a ``slice_backward``: a slice of a (T, H, D) activation in the
autograd graph costs its backward a zero-filled copy of the whole tensor (the attention's q[0:T] did, 2 GiB per
layer at T = 32K in the Flash geometry), also where the attention runs in several chunks of query rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import dsv4attn
from dsv4attn.ops import index_sets

pytest.importorskip("triton", reason="the CUDA path's custom ops are registered by the Triton kernel modules")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import layer_traffic as bench  # noqa: E402

T = 96


def test_window_layer_forward_matmul_flops_match_the_shapes():
    c = dsv4attn.AttentionConfig.tiny()
    H, D, G = c.num_attention_heads, c.head_dim, c.o_groups
    want = 2 * T * (c.hidden_size * c.q_lora_rank + c.q_lora_rank * H * D + c.hidden_size * D
                    + H * D * c.o_lora_rank + G * c.o_lora_rank * c.hidden_size)
    rows = bench.count("tiny", T, 0, "sparse")
    got = sum(flop for direction, _, _, _, _, flop in rows if direction == "forward")
    assert got == want


CASES = [(r, p) for r in (0, 4, 128) for p in ("dense", "warmup", "sparse")]


@pytest.mark.parametrize("ratio,phase", CASES)
@pytest.mark.parametrize("budget", (None, 500), ids=("one-chunk", "chunked"))
def test_no_whole_activation_slice_in_the_backward(ratio, phase, budget, monkeypatch):
    if budget is not None:
        monkeypatch.setitem(index_sets.CHUNK_BUDGET, "cuda", budget)
    rows = bench.count("tiny", T, ratio, phase)
    assert any(direction == "backward" for direction, *_ in rows)
    attention_calls = [r for r in rows if r[:2] == ("forward", "dsv4attn.sparse_attention.default")]
    unchunked = 2 if (ratio, phase) == (4, "warmup") else 1       # the CSA warm-up's teacher: its window's LSE too
    assert (len(attention_calls) > unchunked) == (budget is not None)  # the row chunks the test means to cover
    assert not [name for _, name, *_ in rows if name == "aten.slice_backward.default"]


@pytest.mark.parametrize("ratio", (0, 4, 128))
def test_sparse_step_moves_no_whole_activation_outside_the_kernels(ratio):
    """In the sparse phase (one chunk of query rows) only matmuls and our kernels write tensors of the (T, H, D)
    attention activations' size: no copy, cast, concatenation or zero fill of q, out or their gradients."""
    c = dsv4attn.AttentionConfig.tiny()
    whole = T * c.num_attention_heads * c.head_dim
    rows = bench.count("tiny", T, ratio, "sparse")
    extra = [(direction, name, shape) for direction, name, shape, _, _, flop in rows
             if bench.kind(name, flop) == "other" and shape and _numel(shape) >= whole]
    assert not extra


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_the_csa_warmup_counts_its_teacher_as_the_ranges_ops():
    """The warm-up's teacher over every visible entry is one opaque op per direction on (T,) ranges: no (T, width)
    candidate tensor is formed around it."""
    rows = bench.count("tiny", T, 4, "warmup")
    names = {name for _, name, *_ in rows}
    assert {"dsv4attn.indexer_kl_ranges.default", "dsv4attn.indexer_kl_ranges_backward.default"} <= names
    assert "dsv4attn.indexer_kl.default" not in names
