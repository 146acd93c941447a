"""HybridAttention on packed batches: packed == per document, phases, and the invariants of docs/semantics.md."""
from __future__ import annotations

import pytest
import torch

import dsv4attn
from dsv4attn.layers import attention as attention_module
from layer_helpers import RAGGED, doc_slices, ragged_pack, randomize_

PHASES = ["dense", "warmup", "sparse"]
RATIOS = [0, 4, 128]
RATIO_IDS = ["window", "csa", "hca"]


def make_layer(ratio, seed=0, **overrides):
    cfg = dsv4attn.AttentionConfig.tiny(**overrides)
    return randomize_(dsv4attn.HybridAttention(cfg, ratio), seed=seed).double().train()


def indexer_params(layer):
    return {n: p for n, p in layer.named_parameters() if n.startswith("indexer.")}


def backbone_params(layer):
    return {n: p for n, p in layer.named_parameters() if not n.startswith("indexer.")}


def run(layer, x, cu, max_len, phase, grad_out):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase=phase)
    (y * grad_out).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    loss = layer.indexer_loss       # the sparse phase's is the layer's own tensor, rewritten by its next backward
    return y.detach(), x.grad, grads, None if loss is None else loss.clone()


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS)
def test_packed_equals_per_document(ratio, phase):
    """Output, input gradient, every parameter gradient and the indexer loss of one packed call equal the
    per-document runs (backbone: sum over documents; indexer: sum weighted by L_b / real rows, because each
    loss is normalised by its own real-row count)."""
    torch.manual_seed(0)
    layer = make_layer(ratio)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    y, dx, grads, loss = run(layer, x, cu, max_len, phase, g)
    n_real = int(cu[-1])

    want_y, want_dx = torch.zeros_like(y), torch.zeros_like(dx)
    want_grads = {n: torch.zeros_like(p) for n, p in grads.items()}
    want_loss = 0.0
    for doc in doc_slices(cu):
        L = doc.stop - doc.start
        if L == 0:
            continue
        y_b, dx_b, grads_b, loss_b = run(layer, x[doc], None, None, phase, g[doc])
        want_y[doc], want_dx[doc] = y_b, dx_b
        for n, gb in grads_b.items():
            want_grads[n] += gb * (L / n_real if n.startswith("indexer.") else 1.0)
        if loss_b is not None:
            want_loss += float(loss_b) * L / n_real
    tol = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(y, want_y, **tol)
    torch.testing.assert_close(dx, want_dx, **tol)
    assert set(grads) == set(want_grads)
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], **tol, msg=lambda m: f"{n}: {m}")
    if ratio == 4 and phase != "dense":
        assert float(loss) > 0
        assert float(loss) == pytest.approx(want_loss, rel=1e-9)
    assert (y[n_real:] == 0).all() and (dx[n_real:] == 0).all()


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS)
def test_capacity_padding_changes_nothing(ratio, phase):
    """Padding rows (any values) output 0, get zero gradient and do not count in the loss."""
    torch.manual_seed(1)
    layer = make_layer(ratio)
    cu, T0, max_len = ragged_pack(padding=0)
    x0 = torch.randn(T0, layer.config.hidden_size, dtype=torch.float64)
    g0 = torch.randn_like(x0)
    y0, dx0, grads0, loss0 = run(layer, x0, cu, max_len, phase, g0)
    pad = 13
    x1 = torch.cat([x0, 50 * torch.randn(pad, x0.shape[1], dtype=x0.dtype)])
    g1 = torch.cat([g0, torch.randn(pad, x0.shape[1], dtype=x0.dtype)])
    y1, dx1, grads1, loss1 = run(layer, x1, cu, max_len, phase, g1)
    assert (y1[T0:] == 0).all() and (dx1[T0:] == 0).all()
    torch.testing.assert_close(y1[:T0], y0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dx1[:T0], dx0, rtol=1e-12, atol=1e-14)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-10, atol=1e-14)
    if loss0 is not None:
        assert float(loss1) == pytest.approx(float(loss0), rel=1e-12)


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_zero_coefficient_gives_exact_zero_indexer_gradients(phase):
    """Invariant 9.5: with coefficient 0 the loss path runs and every indexer parameter gets a zero tensor."""
    layer = make_layer(4, indexer_loss_coeff=0.0)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    _, _, grads, loss = run(layer, x, cu, max_len, phase, torch.randn_like(x))
    assert float(loss) == 0.0
    for n, p in indexer_params(layer).items():
        assert p.grad is not None, n
        assert (p.grad == 0).all(), n


def test_dense_phase_gives_indexer_exact_zero_gradients():
    """docs/semantics.md, decision 8: in the dense phase the indexer does not run, yet its parameters get zero
    gradients, so optimizer state is identical in every phase."""
    layer = make_layer(4)
    calls = []
    layer.indexer.register_forward_hook(lambda *a: calls.append(1))
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    _, _, _, loss = run(layer, x, cu, max_len, "dense", torch.randn_like(x))
    assert calls == [] and float(loss) == 0.0
    for n, p in indexer_params(layer).items():
        assert p.grad is not None and (p.grad == 0).all(), n


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_indexer_loss_never_reaches_the_backbone(phase):
    """Invariant 9.9: the indexer loss alone (LM gradient 0) trains only the indexer."""
    layer = make_layer(4)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    _, dx, grads, _ = run(layer, x, cu, max_len, phase, torch.zeros_like(x))
    assert (dx == 0).all()
    for n in backbone_params(layer):
        assert n not in grads or (grads[n] == 0).all(), n
    assert any(grads[n].abs().max() > 0 for n in indexer_params(layer))
    for n in indexer_params(layer):
        assert torch.isfinite(grads[n]).all(), n


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_lm_loss_never_reaches_the_indexer(phase):
    """Invariant 9.9: with coefficient 0 the LM loss trains the backbone and sends exactly nothing to the
    indexer (top-k is not differentiable, indexer inputs are detached)."""
    layer = make_layer(4, indexer_loss_coeff=0.0)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    _, dx, grads, _ = run(layer, x, cu, max_len, phase, torch.randn_like(x))
    assert dx.abs().max() > 0
    for n in backbone_params(layer):
        assert grads[n].abs().max() > 0, n
    for n in indexer_params(layer):
        assert (grads[n] == 0).all(), n


def test_inverse_rope_does_not_alias_the_attention_output(monkeypatch):
    """Invariant 9.1: the output inverse RoPE is out of place; the attention output autograd saved is intact."""
    seen = []
    real = attention_module.sparse_attention

    def spy(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        seen.append((out, out.clone()))
        return out, lse

    monkeypatch.setattr(attention_module, "sparse_attention", spy)
    layer = make_layer(4)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64, requires_grad=True)
    y = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse")
    y.square().sum().backward()
    out, copy = seen[-1]
    assert torch.equal(out, copy)


def test_fp32_parameters_stay_fp32_under_bf16_cast():
    """docs/semantics.md, decision 11: sinks and both compressors' positional biases stay fp32 (values intact) after
    .to(bf16)."""
    layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 4))
    names = ["sinks", "compressor.position_bias", "indexer.compressor.position_bias"]
    before = {n: dict(layer.named_parameters())[n].detach().clone() for n in names}
    layer.to(torch.bfloat16)
    params = dict(layer.named_parameters())
    for n in names:
        assert params[n].dtype == torch.float32, n
        assert torch.equal(params[n], before[n]), n
    assert params["q_a_proj.weight"].dtype == torch.bfloat16
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    y = layer.train()(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse")
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert params["sinks"].grad.dtype == torch.float32
    layer.double()
    assert params["sinks"].dtype == torch.float64


@pytest.mark.parametrize("ratio", [4, 128], ids=["csa", "hca"])
def test_rows_before_the_first_compressed_entry_see_window_and_sink_only(ratio):
    """Invariant 9.11: rows t < r - 1 see no compressed entry, so the compressor cannot change them."""
    layer = make_layer(ratio)
    L = 2 * ratio + 3
    x = torch.randn(L, layer.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        y0 = layer(x, phase="dense")
        layer.compressor.kv_proj.weight.mul_(3.0)
        y1 = layer(x, phase="dense")
    unchanged = (y0 - y1).abs().amax(-1) == 0
    assert unchanged[: ratio - 1].all()
    assert not unchanged[ratio - 1:].any()


@pytest.mark.parametrize("ratio", [4, 128], ids=["csa", "hca"])
def test_tails_are_not_compressed(ratio):
    """Invariant 9.10: tokens after floor(L / r) * r are in no compressed entry."""
    cfg = dsv4attn.AttentionConfig.tiny()
    comp = randomize_(dsv4attn.Compressor(cfg.hidden_size, cfg.head_dim, ratio)).double()
    L = 2 * ratio + ratio // 2 + 1
    pack = dsv4attn.pack_batch(None, L, L)
    inv_freq = dsv4attn.rope.layer_rope_frequencies(cfg, ratio)
    x = torch.randn(L, cfg.hidden_size, dtype=torch.float64)
    x_tail = x.clone()
    x_tail[2 * ratio:] += 1.0
    with torch.no_grad():
        a, b = comp(x, pack, inv_freq), comp(x_tail, pack, inv_freq)
    assert a.shape[0] >= 2 and torch.equal(a, b)
    x_last = x.clone()
    x_last[2 * ratio - 1] += 1.0
    with torch.no_grad():
        assert not torch.equal(comp(x_last, pack, inv_freq)[1], a[1])


def test_sparse_with_wide_topk_equals_dense():
    """With top-k >= every document's entry count the sparse main path attends to exactly the dense set."""
    layer = make_layer(4, index_topk=1000).eval()
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse"),
                                   layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="dense"),
                                   rtol=1e-12, atol=1e-14)


def test_phases_build_their_own_graph(monkeypatch):
    """dense: no indexer; warmup: dense teacher over every visible entry (indexer_kl, which also selects the top-k);
    sparse: the teacher from the attention's backward over the top-k (indexer_kl_from_attention's probe)."""
    seen = []
    real, real_channel = attention_module.indexer_kl, attention_module.indexer_kl_from_attention

    def spy(index_q, index_k, index_w, q, ckv, candidates, outside_lse, scale, head_sum=None, select_topk=None):
        seen.append(("warmup", candidates))
        # warm-up: the loss selects the attention's top-k from the student scores it forms over every entry
        assert select_topk == layer.config.index_topk
        assert head_sum is None                       # one process: the teacher already sums every head
        return real(index_q, index_k, index_w, q, ckv, candidates, outside_lse, scale, select_topk=select_topk)

    def channel_spy(index_q, index_k, index_w, candidates, scores, weight, kl_value, probe_dtype, head_sum):
        seen.append(("sparse", candidates))
        assert head_sum is None and probe_dtype == torch.float64 and scores.shape == candidates.shape
        return real_channel(index_q, index_k, index_w, candidates, scores, weight, kl_value,
                            probe_dtype=probe_dtype, head_sum=head_sum)

    monkeypatch.setattr(attention_module, "indexer_kl", spy)
    monkeypatch.setattr(attention_module, "indexer_kl_from_attention",
                        lambda *a, probe_dtype, head_sum: channel_spy(*a, probe_dtype, head_sum))
    layer = make_layer(4)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    for phase in PHASES:
        layer(x, cu_seqlens=cu, max_seqlen=max_len, phase=phase)
    assert [kind for kind, _ in seen] == ["warmup", "sparse"]
    (_, warm), (_, sparse) = seen
    assert isinstance(warm.base, dsv4attn.ops.VisibleCompressed) and warm.width == max_len // 4
    assert isinstance(sparse, torch.Tensor) and sparse.shape == (T, layer.config.index_topk)
    assert torch.isnan(layer.indexer_loss)            # the sparse phase's value: written by the backward
    with torch.no_grad():
        layer.eval()
        assert layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse") is not None
    assert layer.indexer_loss is None and len(seen) == 2


def test_sparse_teacher_with_the_attention_denominator_equals_the_outside_mass_form():
    """The sparse phase's teacher is the attention's own probabilities of the top-k slots, taken in its backward;
    recomputed the long way (window + sink mass from a separate window attention, then the KL's own LSE over the
    top-k) it is the same loss."""
    from dsv4attn.ops import Explicit, VisibleCompressed, indexer_kl, indexer_topk

    layer = make_layer(4, seed=3)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse").sum().backward()      # the backward writes the loss
    pack = dsv4attn.pack_batch(cu, T, max_len)
    inp = layer.indexer_inputs(x, pack)
    topk = indexer_topk(inp["index_q"], inp["index_k"], inp["index_weights"],
                        VisibleCompressed(inp["layout"], T), layer.config.index_topk)
    kl = indexer_kl(inp["index_q"], inp["index_k"], inp["index_weights"], inp["q"], inp["compressed"], Explicit(topk),
                    inp["outside_lse"], layer.config.softmax_scale)
    expected = layer.config.indexer_loss_coeff * kl.sum() / pack.num_real_rows
    assert expected > 0
    torch.testing.assert_close(layer.indexer_loss, expected, rtol=1e-10, atol=0)


def test_frozen_indexer_reports_no_sparse_loss():
    """An indexer whose parameters do not require grad gets no gradient: its sparse-phase loss, which only the
    backward forms, is not formed and ``indexer_loss`` is None (never a stale value); the warm-up still reports its
    forward's value."""
    layer = make_layer(4, seed=4)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse").sum().backward()
    assert layer.indexer_loss > 0
    layer.indexer.requires_grad_(False)
    layer(x.clone().requires_grad_(True), cu_seqlens=cu, max_seqlen=max_len, phase="sparse").sum().backward()
    assert layer.indexer_loss is None
    layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="warmup").sum().backward()
    assert layer.indexer_loss > 0


def test_phase_switch_between_optimizer_steps_keeps_optimizer_state():
    """A run can change phase at any step: every parameter has a gradient in every phase, so AdamW state keys
    are identical after each step."""
    torch.manual_seed(2)
    layer = make_layer(4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    names = {id(p): n for n, p in layer.named_parameters()}
    keys_per_step = []
    for phase in ["dense", "warmup", "sparse", "dense", "sparse"]:
        opt.zero_grad(set_to_none=True)
        y = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase=phase)
        y.square().mean().backward()
        assert all(p.grad is not None for p in layer.parameters()), phase
        opt.step()
        keys_per_step.append({names[id(p)]: tuple(sorted(s)) for p, s in opt.state.items()})
    assert all(k == keys_per_step[0] for k in keys_per_step)
    assert len(keys_per_step[0]) == len(list(layer.parameters()))


def test_indexer_loss_value_readable_and_scaled_by_coefficient():
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, 128, dtype=torch.float64)
    losses = []
    for coeff in (0.01, 0.02):
        layer = make_layer(4, indexer_loss_coeff=coeff)
        layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="warmup")
        assert layer.indexer_loss.requires_grad is False
        losses.append(float(layer.indexer_loss))
    assert losses[0] > 0 and losses[1] == pytest.approx(2 * losses[0], rel=1e-12)


def test_ragged_pack_has_the_required_document_kinds():
    lengths = set(RAGGED)
    assert {0, 1, 3, 4, 5}.issubset(lengths) and max(lengths) > 128 and any(n % 4 for n in lengths if n > 4)


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS)
def test_bf16_autocast_stays_close_to_float64(ratio):
    """Under bf16 autocast the projections run in bf16 while the ops keep fp32 softmax / LSE / scores math;
    the output stays within bf16 rounding of the float64 reference (relative max error < 2e-2 for the tiny
    config, measured 5e-3 .. 6.3e-3). Dense phase: in sparse phases bf16 rounding may legitimately flip a near-tied
    top-k choice, which is a discrete change, not an error."""
    torch.manual_seed(3)
    layer = make_layer(ratio).eval()
    cu, T, max_len = ragged_pack()
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        want = layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="dense")
        layer.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(x.float(), cu_seqlens=cu, max_seqlen=max_len, phase="dense")
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 2e-2, f"relative max error {err:.3e}"


def test_fp32_parameter_gradients_survive_a_bf16_cast():
    """A cast after backward keeps the fp32 parameters' gradients fp32 and unrounded (optimizer-safe)."""
    layer = randomize_(dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 128))
    layer(torch.randn(300, 128)).square().sum().backward()
    before = layer.sinks.grad.clone(), layer.compressor.position_bias.grad.clone()
    layer.to(torch.bfloat16)
    assert layer.sinks.grad.dtype == torch.float32 and torch.equal(layer.sinks.grad, before[0])
    assert torch.equal(layer.compressor.position_bias.grad, before[1])
    assert layer.q_a_proj.weight.grad.dtype == torch.bfloat16


def test_indexer_inputs_needs_a_ratio_4_layer():
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 128)
    pack = dsv4attn.pack_batch(None, 16)
    with pytest.raises(ValueError, match="ratio-4 layer"):
        layer.indexer_inputs(torch.randn(16, 128), pack)


@pytest.mark.parametrize("ratio", [4, 128])
def test_max_seqlen_far_past_the_batch_is_a_loose_bound(ratio):
    """max_seqlen may exceed every document (a bound); 10**12 sized the compressed index sets by it (10**12 // 4
    slots per row: "can't allocate memory: you tried to allocate 2000000000000 bytes"). No document is longer than
    the batch, so the widths now stop at T // ratio; the output equals the one with the exact bound. In float64: the
    two bounds give index sets of different widths (more empty slots), whose sums the CPU's matmul kernels may block
    differently (fp32 differed by 1e-8 on an Intel Xeon, not on an AMD CPU), so equal up to float64 rounding."""
    torch.manual_seed(0)
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio).double().eval()
    x = torch.randn(300, 128, dtype=torch.float64)
    cu = torch.tensor([0, 20, 290], dtype=torch.int32)
    for phase in ("dense", "sparse"):
        want = layer(x, cu_seqlens=cu, max_seqlen=270, phase=phase)
        got = layer(x, cu_seqlens=cu, max_seqlen=10 ** 12, phase=phase)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("bad, message", [
    (dict(rows=12), r"hidden_states must have shape \(16, 128\), got \(12, 128\)"),
    (dict(width=64), r"hidden_states must have shape \(16, 128\), got \(16, 64\)"),
    (dict(pack="not a pack"), r"pack must be a PackedBatch"),
], ids=["rows", "width", "pack"])
def test_indexer_inputs_checks_its_arguments(bad, message):
    """Rows that do not match the pack raised 'positions must have shape (12,), got (16,)' from inside the query
    path, naming an argument the caller never passed."""
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), 4).eval()
    pack = bad.get("pack", dsv4attn.pack_batch(torch.tensor([0, 16], dtype=torch.int32), 16, 16))
    with pytest.raises((ValueError, TypeError), match=message):
        layer.indexer_inputs(torch.randn(bad.get("rows", 16), bad.get("width", 128)), pack)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS)
def test_refilled_pack_equals_the_new_batch_pack(ratio, phase):
    """What CUDA-graph replay relies on: a pack used once, then refilled in place with another batch's pack
    (PackedBatch.copy_: same rows, max_seqlen and number of documents), gives the new batch's output, input
    gradient, parameter gradients and indexer loss exactly."""
    from layer_helpers import forward_backward
    torch.manual_seed(2)
    layer = make_layer(ratio)
    T, docs, max_len = 260, 12, 200
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    cu_a, _, _ = ragged_pack()
    cu_b = torch.tensor([0, 131, 131, 140, 199, 200, 203], dtype=torch.int32)
    static = dsv4attn.pack_batch(cu_a, T, max_len, num_docs=docs)
    forward_backward(layer, x, g, phase, pack=static)            # builds and caches the pack's tables
    fresh = dsv4attn.pack_batch(cu_b, T, max_len, num_docs=docs)
    want = forward_backward(layer, x, g, phase, pack=fresh)
    got = forward_backward(layer, x, g, phase, pack=static.copy_(dsv4attn.pack_batch(cu_b, T, max_len,
                                                                                     num_docs=docs)))
    for name, a, b in zip(("output", "input grad"), got[:2], want[:2]):
        assert torch.equal(a, b), name
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name
    assert (got[3] is None) == (want[3] is None) and (want[3] is None or torch.equal(got[3], want[3]))


@pytest.mark.parametrize("ratio", RATIOS, ids=RATIO_IDS)
def test_input_projections_formed_together_equal_the_modules_called_alone(ratio, monkeypatch):
    """On one device the projections of the input rows (q_a, kv and the compressor's two) form one autograd node
    (its d x one product); a hook on a projection makes every module run itself again. Outputs, d x and every
    parameter's gradient agree (float64)."""
    layer = make_layer(ratio)
    cu, T, max_len = ragged_pack()
    torch.manual_seed(5)
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    g = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    calls = []
    real = attention_module.project_together
    monkeypatch.setattr(attention_module, "project_together", lambda x, ms: calls.append(len(ms)) or real(x, ms))
    together = run(layer, x, cu, max_len, "sparse", g)
    assert calls == [4 if ratio else 2]
    handle = layer.q_a_proj.register_forward_hook(lambda *a: None)
    alone = run(layer, x, cu, max_len, "sparse", g)
    handle.remove()
    assert calls == [4 if ratio else 2]
    torch.testing.assert_close(together[0], alone[0], rtol=0, atol=0)
    torch.testing.assert_close(together[1], alone[1], rtol=1e-12, atol=1e-13)
    assert together[2].keys() == alone[2].keys()
    for name in together[2]:
        torch.testing.assert_close(together[2][name], alone[2][name], rtol=1e-11, atol=1e-13, msg=name)


def test_a_compressor_subclass_with_its_own_forward_runs_it(monkeypatch):
    """The layer bypasses Compressor.forward only where it is the class's: a subclass's override still runs (and the
    projections then run one by one)."""
    from dsv4attn.layers.compressor import Compressor
    ran = []

    class Logged(Compressor):
        def forward(self, x, layout, inv_freq):
            ran.append(x.shape[0])
            return super().forward(x, layout, inv_freq)

    layer = make_layer(4)
    old = layer.compressor
    layer.compressor = Logged(old.kv_proj.in_features, old.head_dim, old.ratio).double()
    layer.compressor.load_state_dict(old.state_dict())
    cu, T, max_len = ragged_pack()
    calls = []
    real = attention_module.project_together
    monkeypatch.setattr(attention_module, "project_together", lambda x, ms: calls.append(len(ms)) or real(x, ms))
    x = torch.randn(T, layer.config.hidden_size, dtype=torch.float64)
    layer(x, cu_seqlens=cu, max_seqlen=max_len, phase="sparse")
    assert ran == [T] and calls == []
