"""Building blocks of the layers."""
from __future__ import annotations

import pytest
import torch

from dsv4attn.layers.common import rms_norm_unweighted


def _autograd_version(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_unweighted_rms_norm_matches_autograd_and_gradchecks():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    y = rms_norm_unweighted(x, 1e-6)
    (dx,) = torch.autograd.grad((y * g).sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = _autograd_version(x2, 1e-6)
    (dx2,) = torch.autograd.grad((y2 * g).sum(), x2)
    torch.testing.assert_close(y, y2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dx, dx2, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(lambda t: rms_norm_unweighted(t, 1e-3), (x,))


def test_unweighted_rms_norm_bf16_statistics_in_fp32():
    torch.manual_seed(1)
    x = torch.randn(4, 2, 64) * 30
    y = rms_norm_unweighted(x.bfloat16(), 1e-6)
    assert y.dtype == torch.bfloat16
    want = _autograd_version(x.bfloat16().double(), 1e-6)
    assert (y.double() - want).abs().max() < 2e-2


def test_unweighted_rms_norm_in_row_chunks_equals_one_chunk(monkeypatch):
    from dsv4attn import norms
    torch.manual_seed(2)
    x = torch.randn(7, 3, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    y = rms_norm_unweighted(x, 1e-6)
    (dx,) = torch.autograd.grad((y * g).sum(), x)
    monkeypatch.setattr(norms, "CHUNK_ELEMENTS", 2 * 3 * 8)     # 2 rows per chunk, 4 chunks
    y_c = rms_norm_unweighted(x, 1e-6)
    (dx_c,) = torch.autograd.grad((y_c * g).sum(), x)
    assert torch.equal(y, y_c) and torch.equal(dx, dx_c)


def test_unweighted_rms_norm_bf16_rounds_once():
    torch.manual_seed(3)
    x = (torch.randn(16, 4, 64) * 5).bfloat16()
    want = _autograd_version(x.float(), 1e-6).bfloat16()     # fp32 statistics and product, one rounding
    got = rms_norm_unweighted(x, 1e-6)
    ulp = (want.float().abs() * 2.0 ** -7).clamp(min=1e-30)
    assert ((got.float() - want.float()).abs() <= ulp).all()


def _grouped_linear(groups=3, out_per_group=8, in_per_group=16, dtype=torch.float64, seed=0):
    from dsv4attn.layers.common import GroupedLinear
    torch.manual_seed(seed)
    m = GroupedLinear(in_per_group, out_per_group, groups).to(dtype)
    torch.nn.init.normal_(m.weight)
    return m


def test_grouped_linear_equals_its_einsum_definition_and_gradchecks():
    """The batched-matmul path (no groups-first copies) against y[t, g] = W_g x[t, g] in float64, also on a
    (T, G, I) view of a wider tensor (the layer passes a reshape of the attention output)."""
    from dsv4attn.layers.common import _GroupedMatmul
    m = _grouped_linear()
    x = torch.randn(11, 3, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(11, 3, 8, dtype=torch.float64)
    y = m(x)
    dx, dw = torch.autograd.grad((y * g).sum(), (x, m.weight))
    x2, w2 = x.detach().clone().requires_grad_(True), m.weight.detach().clone().requires_grad_(True)
    y2 = torch.einsum("tgi,goi->tgo", x2, w2.view(3, 8, 16))
    dx2, dw2 = torch.autograd.grad((y2 * g).sum(), (x2, w2))
    torch.testing.assert_close(y, y2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dx, dx2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dw, dw2, rtol=1e-13, atol=1e-13)
    assert y.is_contiguous() and dx.is_contiguous() and dw.shape == m.weight.shape
    w = m.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: _GroupedMatmul.apply(a, b.view(3, 8, 16)), (x, w))
    wide = torch.randn(11, 3 * 16 + 5, dtype=torch.float64)[:, :48].view(11, 3, 16)
    torch.testing.assert_close(m(wide), torch.einsum("tgi,goi->tgo", wide, m.weight.view(3, 8, 16)))


def test_grouped_linear_strided_input_and_gradient():
    """Backward with a non-contiguous input (a column slice) and a broadcast upstream gradient (from ``sum``)."""
    m = _grouped_linear()
    x_leaf = torch.randn(7, 3 * 16 + 5, dtype=torch.float64, requires_grad=True)
    dx, dw = torch.autograd.grad(m(x_leaf[:, :48].view(7, 3, 16)).sum(), (x_leaf, m.weight))
    x2 = x_leaf.detach().clone().requires_grad_(True)
    w2 = m.weight.detach().clone().requires_grad_(True)
    dx2, dw2 = torch.autograd.grad(torch.einsum("tgi,goi->tgo", x2[:, :48].view(7, 3, 16), w2.view(3, 8, 16)).sum(),
                                   (x2, w2))
    torch.testing.assert_close(dx, dx2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dw, dw2, rtol=1e-13, atol=1e-13)
    assert torch.equal(dx[:, 48:], torch.zeros_like(dx[:, 48:]))


def test_grouped_linear_under_autocast_equals_the_einsum():
    """Under autocast the batched matmuls run in the autocast dtype, bit for bit the einsum's result, and the fp32
    weight still gets an fp32 gradient."""
    m = _grouped_linear(dtype=torch.float32)
    x = torch.randn(4, 3, 16)
    g = torch.randn(4, 3, 8)
    w2 = m.weight.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        want = torch.einsum("tgi,goi->tgo", x, w2.view(3, 8, 16))
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    (dw,) = torch.autograd.grad(y, m.weight, g.to(y.dtype))
    (dw2,) = torch.autograd.grad(want, w2, g.to(want.dtype))
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw, dw2, rtol=0, atol=0)


def test_grouped_linear_on_meta_and_twice_differentiated():
    """Meta tensors take the einsum; a second differentiation raises a clear error (the layer's attention op has no
    double backward either)."""
    m = _grouped_linear().to("meta")
    assert m(torch.empty(5, 3, 16, dtype=torch.float64, device="meta")).shape == (5, 3, 8)
    m = _grouped_linear()
    x = torch.randn(5, 3, 16, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        dx.sum().backward()


def _linears(*outs, inp=16, dtype=torch.float64):
    torch.manual_seed(3)
    return [torch.nn.Linear(inp, o, bias=False, dtype=dtype) for o in outs]


def test_project_together_equals_the_modules_and_gradchecks():
    """Outputs, d x and every weight's gradient as the modules called one by one (float64), with an output whose
    gradient is absent (unused) and a weight that needs none; gradcheck of the node."""
    from dsv4attn.layers.common import _ProjectTogether, can_project_together, project_together
    ms = _linears(8, 4, 6)
    ms[1].weight.requires_grad_(False)
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    assert can_project_together(x, ms)
    ys = project_together(x, ms)
    want = [m(x) for m in ms]
    for y, w in zip(ys, want):
        torch.testing.assert_close(y, w, rtol=0, atol=0)
    gs = [torch.randn_like(y) for y in ys]
    loss = (ys[0] * gs[0]).sum() + (ys[1] * gs[1]).sum()          # ys[2] unused: no gradient reaches it
    dx, dw0 = torch.autograd.grad(loss, (x, ms[0].weight))
    loss2 = (want[0] * gs[0]).sum() + (want[1] * gs[1]).sum()
    dx2, dw02 = torch.autograd.grad(loss2, (x, ms[0].weight))
    torch.testing.assert_close(dx, dx2, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dw0, dw02, rtol=0, atol=0)
    weights = [m.weight.detach().clone().requires_grad_(True) for m in ms]
    assert torch.autograd.gradcheck(lambda a, *w: _ProjectTogether.apply(a, *w), (x, *weights))


def test_project_together_under_autocast_casts_as_linear_does():
    """Under autocast the products run in its dtype, bit for bit nn.Linear's, and fp32 weights get fp32 gradients."""
    from dsv4attn.layers.common import can_project_together, project_together
    ms = _linears(8, 4, dtype=torch.float32)
    x = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert can_project_together(x, ms)
        ys = project_together(x, ms)
        want = [m(x) for m in ms]
    for y, w in zip(ys, want):
        assert y.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(y, w, rtol=0, atol=0)
    (dw,) = torch.autograd.grad(ys[0].float().sum(), ms[0].weight)
    (dw2,) = torch.autograd.grad(want[0].float().sum(), ms[0].weight)
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw, dw2, rtol=0, atol=0)


def test_project_together_is_refused_where_the_modules_must_run_themselves():
    """Forward and backward hooks (FSDP2's gathers, adapters, gradient probes), a forward replaced on the instance,
    subclasses, biases, weights that are tensor subclasses, a dtype the weights do not have (float64 under autocast,
    which autocast leaves alone), and a module that only owns the projections (its forward would be bypassed) with a
    hook: the modules run themselves then."""
    from dsv4attn.layers.common import can_project_together

    class Adapter(torch.nn.Linear):
        pass

    x = torch.randn(3, 16, dtype=torch.float64)
    ms = _linears(8, 4)
    assert can_project_together(x, ms)
    assert not can_project_together(x.float(), ms)
    owner = torch.nn.Module()
    assert can_project_together(x, ms + [owner])
    handle = owner.register_forward_pre_hook(lambda *a: None)
    assert not can_project_together(x, ms + [owner])
    handle.remove()
    handle = ms[0].register_forward_hook(lambda *a: None)
    assert not can_project_together(x, ms)
    handle.remove()
    wrapped = _linears(8)[0]
    wrapped.forward = lambda t, inner=wrapped.forward: inner(t)    # e.g. a device-placement wrapper's
    assert not can_project_together(x, [wrapped, ms[1]])
    assert not can_project_together(x, [Adapter(16, 8, bias=False, dtype=torch.float64), ms[1]])
    assert not can_project_together(x, [torch.nn.Linear(16, 8, dtype=torch.float64), ms[1]])
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert not can_project_together(x, ms)
    finally:
        handle.remove()
    for register in ("register_full_backward_hook", "register_full_backward_pre_hook"):
        handle = getattr(ms[1], register)(lambda *a: None)          # a gradient probe must still see its gradients
        assert not can_project_together(x, ms)
        handle.remove()
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *a: None)
    try:
        assert not can_project_together(x, ms)
    finally:
        handle.remove()

    class Quantised(torch.Tensor):                                   # a weight that is a tensor subclass
        pass

    odd = _linears(8)[0]
    odd.weight = torch.nn.Parameter(odd.weight.detach().as_subclass(Quantised))
    assert not can_project_together(x, [odd, ms[1]])
    with torch.autocast("cpu", dtype=torch.bfloat16):                 # autocast leaves float64 alone
        assert not can_project_together(x, ms)
        assert can_project_together(x.float(), _linears(8, 4, dtype=torch.float32))
    assert can_project_together(x, ms)


def test_gradient_handle_holds_no_storage_and_passes_the_gradient():
    """``GradientHandle``: x's shape and dtype, one element of storage, x's gradient unchanged through it (what lets
    the layer free the queries before the norm once ``qnorm_rope_stats`` has read them)."""
    from dsv4attn.layers.common import GradientHandle
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    handle = GradientHandle.apply(x * 1.0)
    assert handle.shape == x.shape and handle.dtype == x.dtype and handle.requires_grad
    assert handle.untyped_storage().nbytes() == x.element_size()
    g = torch.randn_like(x)
    torch.autograd.backward(handle, g)
    assert torch.equal(x.grad, g)
