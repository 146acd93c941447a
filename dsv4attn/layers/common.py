"""Small building blocks shared by the attention layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..norms import rms_norm_unweighted  # noqa: F401  (the layers' name for it)
from ..ops import rope_rotate


def rope_rows(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """:func:`dsv4attn.rope.apply_rope` of (N, D) rows (the KV head, compressed entries) through the ``rope_rotate``
    op: one fused pass each way on CUDA instead of a dozen elementwise kernels; the reference (``apply_rope``
    itself) elsewhere."""
    return rope_rotate(x.unsqueeze(1), positions, inv_freq).squeeze(1)


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor: under FSDP2 (``fully_shard``) a parameter outside its unit's forward and backward
    is this rank's shard, whose dtype is the stored one, not the one its unit all-gathers it in
    (``MixedPrecisionPolicy.param_dtype``). Code that reads a parameter's dtype to predict the compute dtype
    must not trust it then."""
    return _DTensor is not None and isinstance(p, _DTensor)


def copy_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.copy_(value)`` for a ``value`` of the parameter's full shape (cast to its dtype and device), also
    when ``param`` is an FSDP2 shard: every rank holds the full ``value`` and copies its own slice into its shard
    in place (no communication). Call under ``torch.no_grad()``."""
    if not is_sharded(param):
        param.copy_(value)
        return
    from torch.distributed.tensor import distribute_tensor
    local = distribute_tensor(value.to(device=param.device, dtype=param.dtype), param.device_mesh,
                              param.placements, src_data_rank=None).to_local()
    param.to_local().copy_(local)         # in place: FSDP2 gathers from the shard's own storage


def full_value(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the full tensor of an FSDP2 shard (an all-gather: every rank of its mesh calls it)."""
    return t.full_tensor() if is_sharded(t) else t


try:                                    # torch built without distributed support has no DTensor
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:                     # pragma: no cover
    _DTensor = None


class KeepFp32Params(nn.Module):
    """Parameters named in ``_fp32_params`` stay (at least) fp32 when the module is cast
    (docs/semantics.md, decision 11).

    ``module.to(torch.bfloat16)`` / ``.half()`` would otherwise round them; the original values are kept, moved to
    the new device, in fp32 (fp64 when the module is cast to fp64, for float64 checks).
    """

    _fp32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {}
        for name in self._fp32_params:
            p = getattr(self, name)
            saved[name] = (p.data, None if p.grad is None else p.grad.data)
        super()._apply(fn, recurse)
        for name, (before, before_grad) in saved.items():
            param = getattr(self, name)
            want = torch.float64 if param.dtype == torch.float64 else torch.float32
            if param.dtype != want:
                param.data = before.to(device=param.device, dtype=want)
                if param.grad is not None:  # the gradient keeps the parameter's dtype, unrounded
                    param.grad.data = before_grad.to(device=param.device, dtype=want)
        return self


class RMSNorm(nn.Module):
    """Weighted RMSNorm, computed in fp32 (fp64 for fp64 inputs) and cast back to the input dtype once.

    ``F.rms_norm`` over the promoted input: on CUDA that is one fused kernel each way (the weight matches the
    input's dtype after the promotion, the fused kernels' condition) instead of one per elementwise step; on the CPU
    it decomposes into the same steps as ``x * rsqrt(mean(x^2) + eps) * w``, bit for bit."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(cd), (x.shape[-1],), self.weight.to(cd), self.eps).to(x.dtype)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of the input (T, G, in) maps through ``weight.view(G, out, in)[g]``.

    ``weight`` is (G * out, in) as in HF ``o_a_proj`` / DeepSeek ``wo_a`` / Megatron ``linear_o_group_proj``.
    The products are batched matmuls that read and write the (T, G, .) layouts in place (:class:`_GroupedMatmul`),
    under autocast in its dtype (as the einsum's bmm would be); while ``torch.compile`` traces, and on devices without
    autocast (meta), the einsum ``tgi,goi->tgo`` itself.
    """

    def __init__(self, in_per_group: int, out_per_group: int, groups: int):
        super().__init__()
        self.groups, self.out_per_group = groups, out_per_group
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, self.out_per_group, -1)
        device = x.device.type
        # Dynamo refuses out= views; the einsum also keeps its dtype-mismatch error for mixed inputs.
        if torch.compiler.is_compiling() or not torch.amp.is_autocast_available(device):
            return torch.einsum("tgi,goi->tgo", x, w)
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                return _GroupedMatmul.apply(x.to(dtype), w.to(dtype))
        if x.dtype != w.dtype:
            return torch.einsum("tgi,goi->tgo", x, w)
        return _GroupedMatmul.apply(x, w)


class _GroupedMatmul(torch.autograd.Function):
    """``y[t, g] = w[g] @ x[t, g]`` for x (T, G, I), w (G, O, I): y (T, G, O).

    Each product is one strided batched matmul over the groups whose operands and results are (G, T, .) views of
    the (T, G, .) tensors, so neither direction copies x, y or their gradients into a groups-first layout (the
    einsum's autograd did: one (T, G, I) copy in the backward, 2 GiB in the Flash geometry at 32K rows).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        y = x.new_empty(x.shape[0], w.shape[0], w.shape[1])
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        grad_g = grad.transpose(0, 1)                                    # (G, T, O) view
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x, memory_format=torch.contiguous_format)
            torch.bmm(grad_g, w, out=dx.transpose(0, 1))
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(grad_g.transpose(1, 2), x.transpose(0, 1))      # (G, O, I)
        return dx, dw


def can_project_together(x: torch.Tensor, modules) -> bool:
    """Whether :func:`project_together` may bypass ``modules``' own forwards: eager (not while torch.compile traces),
    no module with forward or backward hooks (global ones included) or a ``forward`` replaced on the instance
    (FSDP2's gathers, device-placement and offloading wrappers, gradient probes, adapters hook, replace or subclass
    them), the projections plain bias-free ``nn.Linear`` holding plain weights (no FSDP2 shard or other tensor
    subclass) of ``x``'s dtype, or under autocast, which casts neither side when it is float64."""
    if torch.compiler.is_compiling():
        return False
    from torch.nn.modules import module as _module
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks):
        return False
    autocast = _autocast_dtype(x) is not None
    if autocast and x.dtype == torch.float64:
        return False
    for m in modules:
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "forward" in vars(m)):
            return False
        if isinstance(m, nn.Linear):
            if type(m) is not nn.Linear or m.bias is not None or type(m.weight) not in (torch.Tensor, nn.Parameter):
                return False
            if m.weight.dtype != x.dtype and (not autocast or m.weight.dtype == torch.float64):
                return False
    return True


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def project_together(x: torch.Tensor, linears) -> list[torch.Tensor]:
    """``[m(x) for m in linears]`` for bias-free ``nn.Linear`` modules reading one (rows, in) input ``x``, as one
    autograd node: its backward accumulates d x in one tensor, each product after the first added to it in the
    matmul's epilogue, where autograd would write one (rows, in) product per projection and add them up in separate
    passes (in the CSA layer at 32K rows: three sums reading 0.5 and writing 0.25 GiB each, against one extra read of
    0.25 GiB per product here: ~1.5 GiB less traffic, ~0.4 ms on an H200). The weight gradients are the usual
    ``g_i^T x``. Call it only where :func:`can_project_together` holds. Under autocast
    the operands are cast to its dtype first, as ``nn.Linear`` casts them."""
    weights = [m.weight for m in linears]
    dtype = _autocast_dtype(x)
    if dtype is not None:
        with torch.autocast(x.device.type, enabled=False):
            return list(_ProjectTogether.apply(x.to(dtype), *(w.to(dtype) for w in weights)))
    return list(_ProjectTogether.apply(x, *weights))


class _ProjectTogether(torch.autograd.Function):
    """``(x W_1^T, ..., x W_n^T)`` for x (rows, in), W_i (out_i, in); d x = sum_i g_i W_i accumulated in one
    (rows, in) tensor by the products themselves (outputs without a gradient left out)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor):
        ctx.set_materialize_grads(False)
        # x only where a weight gradient needs it (frozen projections: nn.Linear would not keep it either).
        ctx.save_for_backward(x if any(ctx.needs_input_grad[1:]) else None, *weights)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        used = [i for i, g in enumerate(grads) if g is not None]
        dx = None
        if ctx.needs_input_grad[0] and used:
            # Each further product is added in its epilogue (beta = 1): one extra read of d x per projection, no
            # concatenated copy of the gradients.
            dx = grads[used[0]] @ weights[used[0]]
            for i in used[1:]:
                dx.addmm_(grads[i], weights[i])
        dws = [grads[i].t() @ x if grads[i] is not None and ctx.needs_input_grad[1 + i] else None
               for i in range(len(weights))]
        return (dx, *dws)


class GradientHandle(torch.autograd.Function):
    """A stand-in for ``x`` with its shape and dtype and none of its storage (zeros, expanded from one element) that
    passes its gradient to ``x`` unchanged: for an argument an op takes only to return its gradient (the queries
    before the norm in ``sparse_attention(..., query_norm=)``), so that ``x`` is freed once the caller drops it
    instead of staying alive until the op runs (2 GiB at T = 32K, 64 heads of 512)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad


class AttachLoss(torch.autograd.Function):
    """Identity on ``out``; its backward also feeds gradient 1 into ``loss`` (Megatron's loss auto-scaler).

    This makes an ordinary ``lm_loss.backward()`` train the indexer through its own loss
    (docs/semantics.md, decision 7).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad_out, torch.ones(shape, dtype=dtype, device=device)
