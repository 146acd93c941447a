"""Whole-layer ``torch.compile(fullgraph=True)``: every ratio and phase traces without a graph break and equals eager.

CPU, float64, ``backend="aot_eager"`` (AOT autograd traces forward and backward; the ops are run, not re-generated):
outputs, the gradients of x and of every parameter, and ``layer.indexer_loss`` equal the eager layer's to
``rtol=1e-12`` (observed: bitwise equal). One compiled layer per ratio is shared by that ratio's tests: each phase
is one graph (``phase`` is a host string the trace specialises on), and a new pack of the same geometry (T, number
of documents, ``max_seqlen``) reuses it: its tensors are graph inputs, its host ints are equal and the caches the
trace reads are as eager calls left them (:func:`dsv4attn.packing.cached`), so it costs 0 recompiles. A different
document count changes the shape of ``cu_seqlens``: one recompile, with that size symbolic, then none.

The CUDA path (Triton custom ops) cannot run here; its dispatch is traced instead, in float32 with the Triton
backend forced: forward and backward must trace in one graph each, through the ops' fake kernels only.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dsv4attn
from layer_helpers import randomize_

T, MAX_SEQLEN = 184, 130
PACK_CU = (0, 5, 135, 175)          # documents 5, 130, 40, then 9 padding rows
OTHER_CU = (0, 130, 130, 170)       # same T, N and max_seqlen: other boundaries, an empty document, 14 padding
PHASES = ("dense", "warmup", "sparse")
TOL = dict(rtol=1e-12, atol=1e-14)


class GraphCounter:
    """An aot_eager backend that counts the graphs it compiled. Unlike CompileCounterWithBackend's frame count it
    does not count an attempt that dynamo restarts: a float64 0-dim CPU tensor the trace reads (the sparse phase's
    loss value, written by the backward) makes dynamo's float tensorification restart the analysis once, on the
    CPU in float64 only."""

    def __init__(self):
        self.inner, self.graphs = CompileCounterWithBackend("aot_eager"), 0

    def __call__(self, gm, example_inputs):
        compiled = self.inner(gm, example_inputs)      # a restart raises through here
        self.graphs += 1
        return compiled


def _pack(cu, max_seqlen=MAX_SEQLEN):
    return dsv4attn.pack_batch(torch.tensor(cu, dtype=torch.int32), T, max_seqlen=max_seqlen)


class Compiled:
    """One ratio's layer, its input, the fullgraph compile of it and the counter of the graphs it made."""

    def __init__(self, ratio: int):
        torch._dynamo.reset()               # graphs of other tests must not count against the recompile limit
        torch.manual_seed(ratio)
        self.layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio).double(), ratio)
        self.x = torch.randn(T, self.layer.config.hidden_size, dtype=torch.float64)
        self.grad_y = torch.randn(T, self.layer.config.hidden_size, dtype=torch.float64)
        self.counter = GraphCounter()
        self.compiled = torch.compile(self.layer, backend=self.counter, fullgraph=True)

    def run(self, fn, pack, phase):
        """(y, dx, {parameter: grad}, indexer_loss) of one forward and backward of ``fn``."""
        self.layer.zero_grad(set_to_none=True)
        x = self.x.clone().requires_grad_(True)
        y = fn(x, pack=pack, phase=phase)
        y.backward(self.grad_y)
        grads = {name: p.grad for name, p in self.layer.named_parameters()}
        loss = self.layer.indexer_loss      # the sparse phase's is the layer's own tensor: a copy of this run's value
        return y.detach(), x.grad, grads, None if loss is None else loss.clone()

    def check(self, pack, phase):
        """The compiled layer equals the eager one on ``pack`` in ``phase``."""
        want = self.run(self.layer, pack, phase)
        got = self.run(self.compiled, pack, phase)
        torch.testing.assert_close(got[0], want[0], **TOL)
        torch.testing.assert_close(got[1], want[1], **TOL)
        assert got[2].keys() == want[2].keys()
        for name, grad in want[2].items():
            if grad is None:                # the indexer of a CSA layer in the dense phase outside training
                assert got[2][name] is None, name
            else:
                torch.testing.assert_close(got[2][name], grad, **TOL, msg=lambda m: f"{name}: {m}")
        if want[3] is None:
            assert got[3] is None
        else:
            assert got[3] is not None and got[3].grad_fn is None     # detached, for logging
            torch.testing.assert_close(got[3], want[3], **TOL)


@pytest.fixture(scope="module", params=(0, 4, 128), ids=lambda r: f"ratio{r}")
def compiled(request):
    return Compiled(request.param)


@pytest.mark.parametrize("phase", PHASES)
def test_fullgraph_compile_equals_eager(compiled, phase):
    """Compiles with fullgraph=True (any graph break would raise) and equals eager, gradients included."""
    compiled.check(_pack(PACK_CU), phase)
    if compiled.layer.compress_ratio == 4 and phase != "dense":
        assert compiled.layer.indexer_loss > 0          # the KL is attached and logged under compile too


def test_another_pack_of_the_same_capacity_reuses_the_graphs(compiled):
    """Fresh packs of the same T, N and max_seqlen: correct, and 0 recompiles (one graph per phase in all)."""
    for phase in PHASES:                               # a new pack object each call, as in training
        compiled.check(_pack(PACK_CU), phase)          # (compiles the phase if the test above did not run)
    assert compiled.counter.graphs == len(PHASES)
    for phase in PHASES:
        compiled.check(_pack(OTHER_CU), phase)
    assert compiled.counter.graphs == len(PHASES)


def test_another_document_count_recompiles_once():
    """N changes the shape of cu_seqlens (and of the per-document tables): one recompile, after which that size is
    symbolic and further document counts reuse the graph."""
    c = Compiled(4)
    c.check(_pack(PACK_CU), "sparse")
    assert c.counter.graphs == 1
    c.check(_pack((0, 60, 184)), "sparse")                              # 2 documents, no padding
    assert c.counter.graphs == 2
    c.check(_pack((0, 7, 8, 40, 44, 130, 131)), "sparse")                # 6 documents
    assert c.counter.graphs == 2


def test_parameters_placed_without_apply_still_report_the_sparse_loss():
    """Parameters assigned on a device that ``Module._apply`` never saw (as some loaders place them) find no loss
    buffers there (simulated by emptying the per-device store): a compiled sparse step makes them outside the graph
    (one graph break) and reports the eager loss; ``fullgraph=True`` refuses, naming the fix (``layer.to``)."""
    c = Compiled(4)
    want = c.run(c.layer, _pack(PACK_CU), "sparse")
    c.layer._kl_value_on.clear()
    got = c.run(torch.compile(c.layer, backend="aot_eager"), _pack(PACK_CU), "sparse")
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[3], want[3], **TOL)
    torch._dynamo.reset()
    c.layer._kl_value_on.clear()
    with pytest.raises(Exception, match=r"layer\.to\(device\)"):
        c.run(torch.compile(c.layer, backend="aot_eager", fullgraph=True), _pack(PACK_CU), "sparse")


# ------------------------------------------------------------------------------------- the CUDA (Triton) dispatch
class _Traced(Exception):
    """Raised once AOT autograd has partitioned the joint graph: the kernels themselves never run."""


def _custom_ops(graph) -> set[str]:
    """The dsv4attn ops a graph calls, directly or (an op that mutates an argument) through auto_functionalized."""
    targets = [n.args[0] if "auto_functionalized" in str(n.target) else n.target for n in graph.nodes]
    return {str(t).split(".")[1] for t in targets if str(t).startswith("dsv4attn.")}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the ops' CUDA path)")
@pytest.mark.parametrize("phase", ("warmup", "sparse"))
def test_triton_dispatch_traces_fullgraph_through_fake_kernels(phase):
    """With the Triton backend forced (float32), the CSA layer's forward and backward trace as one graph each, every
    op an opaque registered custom op (dense and HCA layers use a subset of these ops)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition

    torch._dynamo.reset()
    layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 4))
    x = torch.randn(T, layer.config.hidden_size, requires_grad=True)
    graphs = {}

    def partition(joint, inputs, **kwargs):
        graphs["forward"], graphs["backward"] = default_partition(joint, inputs, **kwargs)
        raise _Traced

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: g, partition_fn=partition)

    pack = _pack(PACK_CU)
    dsv4attn.set_backend("triton")
    try:
        with pytest.raises(Exception) as caught:
            torch.compile(layer, backend=backend, fullgraph=True)(x, pack=pack, phase=phase)
    finally:
        dsv4attn.set_backend(None)
        torch._dynamo.reset()
    assert "_Traced" in repr(caught.value) or isinstance(caught.value, _Traced), caught.value
    # The warm-up's teacher over every visible entry takes the ranges op: the graph holds (T,) ranges, not the
    # (T, max_seqlen / 4) candidate tensor (T^2 / 4 bytes); its window mass is the window's lse alone, and it
    # selects the attention's top-k itself (from the student scores it forms).
    # The sparse phase's KL is formed in the backward, from the teacher mass the attention's backward hands over.
    forward_kl, backward_kl = (("indexer_kl_ranges", "indexer_kl_ranges_backward") if phase == "warmup" else
                               ((), "indexer_kl_from_mass"))
    own = {"sparse_attention_lse"} if phase == "warmup" else {"indexer_topk_ranges"}
    assert _custom_ops(graphs["forward"].graph) == {"qnorm_rope", "rope_rotate", "compress_pool",
                                                    "sparse_attention", *([forward_kl] if forward_kl else [])} | own
    # The query norm's backward runs inside the attention's (sparse_attention's query_norm).
    assert _custom_ops(graphs["backward"].graph) == {"rope_rotate", "compress_pool_backward", backward_kl,
                                                     "sparse_attention_backward"}


def test_every_custom_op_has_a_fake_kernel():
    """What lets torch.compile trace the ops (and CUDA graphs capture them) without running them."""
    from torch._library.simple_registry import singleton

    import dsv4attn.ops  # noqa: F401  (registers the ops that exist in this install)
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv4attn::")]
    assert "dsv4attn::sparse_attention" in names
    missing = [n for n in names if singleton.find(n).fake_impl.kernel is None]
    assert not missing, missing


# ---------------------------------------------------------------------------------------- CUDA: inductor, run
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio", (0, 4, 128))
def test_gpu_inductor_fullgraph_equals_eager(ratio):
    """On CUDA with inductor (the Triton kernels as opaque custom ops, the code around them generated), fp32: every
    phase compiles without a graph break, output, input and parameter gradients and the indexer loss within 1e-4
    (relative to each tensor's largest magnitude) of eager, and a second pack of the same geometry reuses the
    graphs."""
    torch._dynamo.reset()
    torch.manual_seed(ratio)
    layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio), ratio).cuda()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x0 = torch.randn(T, layer.config.hidden_size, device="cuda")
    grad_y = torch.randn(T, layer.config.hidden_size, device="cuda")

    def run(fn, pack, phase):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = fn(x, pack=pack, phase=phase)
        y.backward(grad_y)
        loss = layer.indexer_loss
        return ([y.detach(), x.grad] + [p.grad for p in layer.parameters() if p.grad is not None],
                None if loss is None else loss.clone())

    def close(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item() <= 1e-4

    for cu in (PACK_CU, OTHER_CU):
        pack = dsv4attn.pack_batch(torch.tensor(cu, dtype=torch.int32, device="cuda"), T, max_seqlen=MAX_SEQLEN)
        for phase in PHASES:
            (want, want_loss), (got, got_loss) = run(layer, pack, phase), run(compiled, pack, phase)
            assert len(got) == len(want) and all(close(g, w) for g, w in zip(got, want)), (cu, phase)
            assert (got_loss is None) == (want_loss is None), phase
            if want_loss is not None:
                assert close(got_loss, want_loss), (phase, got_loss, want_loss)
    assert counter.frame_count == len(PHASES)
