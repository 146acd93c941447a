"""Triton kernels for the query RMSNorm + RoPE, plain and inverse RoPE: one pass over (T, H, D) each way.

Same contract as :mod:`.reference`. The (T, H, D) tensor is seen as ``T * H`` rows of ``D`` channels; a program
takes ``BLOCK_ROWS`` consecutive rows (``TILE // next_pow2(D)`` of them) and all their channels, so a row's RMS
statistic is one in-register reduction and every element is read and written once. The row's token is
``row // H``; its cos / sin come from a (T, rope_dim / 2) fp32 table computed by
:func:`dsv4attn.rope.rope_cos_sin` (float64 angles rounded to fp32: the reference's exact values; the table is
1/(8H) of the tensor at rope_dim 64, read through the cache).

Interleaved pairs without shuffles: channel ``k`` of the RoPE slice pairs with ``k ^ 1``, so the rotation by ``a``
is ``y_k * cos(a) + y_partner * s_k`` with ``s_k = -sin(a)`` on even and ``+sin(a)`` on odd channels, and the
partner is a second load of the same cache lines, issued for the RoPE channels only. Leading ("nope") channels pass
through untouched (``tl.where``, not ``* 1 + 0``, so even an infinite partner cannot leak into them).

* ``_rope_fwd_kernel``: ``NORM`` (``x * rstd`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32) then the
  rotation by ``SIGN * angle``, one rounding to the output dtype. ``NORM=True, SIGN=+1`` is ``qnorm_rope``;
  ``NORM=False, SIGN=-1`` the output inverse RoPE and ``SIGN=+1`` its backward (the transpose of a rotation is the
  rotation by the opposite angle); ``NORM=False, SIGN=+1`` is also ``rope_rotate`` (the indexer's queries).
* ``_qnorm_rope_bwd_kernel``: ``dy = R(-angle) dq`` and ``y = R(-angle) q`` in fp32 from the op's own output ``q``
  (the normalised rows, rounded once), then the RMSNorm backward ``dx = rstd * (dy - y * mean(dy * y))`` with the
  forward's per-row ``rstd`` (fp32). So the op keeps its output, which the attention keeps anyway, and a (T, H)
  fp32 tensor instead of its input ``x``, which is freed after the forward: at T = 32K, 64 heads of 512, a 2 GiB
  tensor less held per layer until the backward (the input has no other use: ``q_b_proj``'s backward needs its
  own input).

Row offsets are int64 (T * H * D passes 2^31 at T = 64K in the Flash geometry). No device->host sync.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ... import backend, variants
from ..triton_common import interpreting, round_to
from ...rope import rope_cos_sin
from .reference import (inverse_rope_reference, qnorm_rope_input_grad_reference, qnorm_rope_reference,
                        rope_rotate_reference, rstd_reference)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Elements per program (BLOCK_ROWS x next_pow2(D)) and warps. At D = 512 the default is 8 rows of 64 heads' worth
# of a token, 16 elements per thread. benchmarks/qnorm_rope.py --sweep times the alternatives.
CONFIGS = dict(fwd=dict(TILE=4096, num_warps=8), bwd=dict(TILE=4096, num_warps=8))


@triton.jit
def _tile(rows, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows (BLOCK_ROWS,), channels (1, BLOCK_D), element mask and int64 element offsets."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_D)[None, :]
    mask = (row < rows)[:, None] & (col < D)
    offs = row.to(tl.int64)[:, None] * D + col
    return row, col, mask, offs


@triton.jit
def _rstd(x, eps, D: tl.constexpr):
    """(BLOCK_ROWS,) fp32 ``1 / sqrt(mean(x^2) + eps)`` of an fp32 tile whose padding channels are 0."""
    return 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)


@triton.jit
def _cos_sin(COS, SIN, row, col, mask, HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """RoPE-channel mask (1, BLOCK_D), cos and the partner coefficient ``s`` (BLOCK_ROWS, BLOCK_D) of a rotation
    by +angle: ``out_k = y_k * cos + y_(k^1) * s`` with ``s = -sin`` on even and ``+sin`` on odd channels."""
    NOPE: tl.constexpr = D - 2 * HALF
    is_rope = col >= NOPE
    pair = (col - NOPE) // 2
    table = (row // HEADS)[:, None] * HALF + pair
    load = mask & is_rope
    cos = tl.load(COS + table, mask=load, other=1.0)
    sin = tl.load(SIN + table, mask=load, other=0.0)
    return is_rope, cos, tl.where((col % 2) == 1, sin, -sin)


@triton.jit
def _rope_fwd_kernel(X, COS, SIN, OUT, RSTD, rows, eps,
                     HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
                     SIGN: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROUND_BF16: tl.constexpr):
    # NORM: RSTD (rows,) fp32 receives each row's rstd (the backward's, with the output).
    row, col, mask, offs = _tile(rows, D, BLOCK_ROWS, BLOCK_D)
    y = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = _rstd(y, eps, D)
        y = y * rstd[:, None]
        tl.store(RSTD + row, rstd, mask=row < rows)
    if HALF > 0:
        is_rope, cos, s = _cos_sin(COS, SIN, row, col, mask, HEADS, D, HALF)
        if SIGN < 0:
            s = -s
        partner = tl.load(X + (offs + 1 - 2 * (col % 2)), mask=mask & is_rope, other=0.0).to(tl.float32)
        if NORM:
            partner = partner * rstd[:, None]
        y = tl.where(is_rope, y * cos + partner * s, y)
    tl.store(OUT + offs, round_to(y, OUT, ROUND_BF16), mask=mask)


@triton.jit
def _qnorm_rope_bwd_kernel(Q, RSTD, DQ, COS, SIN, DX, rows,
                           HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr):
    # Q: the forward's output; RSTD: its per-row rstd.
    row, col, mask, offs = _tile(rows, D, BLOCK_ROWS, BLOCK_D)
    dy = tl.load(DQ + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Q + offs, mask=mask, other=0.0).to(tl.float32)
    if HALF > 0:
        # The transpose of the forward rotation: the rotation by -angle, i.e. the partner coefficient negated; the
        # same rotation takes the output back to the normalised rows y = x * rstd.
        is_rope, cos, s = _cos_sin(COS, SIN, row, col, mask, HEADS, D, HALF)
        partner_offs = offs + 1 - 2 * (col % 2)
        partner = tl.load(DQ + partner_offs, mask=mask & is_rope, other=0.0).to(tl.float32)
        dy = tl.where(is_rope, dy * cos - partner * s, dy)
        partner = tl.load(Q + partner_offs, mask=mask & is_rope, other=0.0).to(tl.float32)
        y = tl.where(is_rope, y * cos - partner * s, y)
    rstd = tl.load(RSTD + row, mask=row < rows, other=0.0)
    # d/dx_j of x_i * r with r = (mean(x^2) + eps)^-1/2 and y = x * r:  r * (dy_j - y_j * mean(dy * y))
    mean_dy_y = tl.sum(dy * y, axis=1) / D
    dx = rstd[:, None] * (dy - y * mean_dy_y[:, None])
    tl.store(DX + offs, round_to(dx, DX, ROUND_BF16), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, config: dict):
    """(grid, constexprs, launch options) for a contiguous (T, H, D) ``x`` and its (T, rope_dim / 2) table."""
    T, H, D = x.shape
    block_d = triton.next_power_of_2(D)
    block_rows = max(1, config["TILE"] // block_d)
    meta = dict(HEADS=H, D=D, HALF=cos.shape[1], BLOCK_ROWS=block_rows, BLOCK_D=block_d,
                ROUND_BF16=x.dtype == torch.bfloat16 and interpreting())
    return (triton.cdiv(T * H, block_rows),), meta, dict(num_warps=config["num_warps"])


def _table_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # rope_dim 0: the kernels never read the table; pass x so that no empty tensor's null pointer is handed over.
    return (cos, sin) if cos.shape[1] else (x, x)


def _rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, norm: bool, sign: int,
              config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward kernel on contiguous ``x`` (T, H, D): a new tensor of its shape and dtype, and with ``norm`` each
    row's rstd, (T, H) fp32 (else None)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(x.shape[:2], dtype=torch.float32, device=x.device) if norm else None
    if x.numel() == 0:
        return out, rstd
    grid, meta, launch = _launch(x, cos, config or CONFIGS["fwd"])
    _rope_fwd_kernel[grid](x, *_table_args(x, cos, sin), out, rstd if norm else out, x.shape[0] * x.shape[1], eps,
                           NORM=norm, SIGN=sign, **meta, **launch)
    return out, rstd


def _qnorm_rope_bwd(grad: torch.Tensor, q: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    config: dict | None = None) -> torch.Tensor:
    """dx (T, H, D) in ``q``'s dtype of ``qnorm_rope`` from the contiguous output gradient ``grad``, the output
    ``q`` and its (T, H) rstd."""
    dx = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.numel() == 0:
        return dx
    grid, meta, launch = _launch(q, cos, config or CONFIGS["bwd"])
    _qnorm_rope_bwd_kernel[grid](q, rstd, grad, *_table_args(q, cos, sin), dx, q.shape[0] * q.shape[1], **meta,
                                 **launch)
    return dx


@torch.library.custom_op("dsv4attn::qnorm_rope", mutates_args=())
def qnorm_rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward of :func:`dsv4attn.ops.qnorm_rope`: contiguous x (T, H, D), cos / sin (T, rope_dim/2) fp32 ->
    q (T, H, D) in x's dtype and each row's rstd (T, H) fp32 (saved with q for the backward; no gradient)."""
    with backend.exact_math(x.device):
        return _rope_fwd(x, cos, sin, eps, norm=True, sign=1)


@qnorm_rope_op.register_fake
def _qnorm_rope_fake(x, cos, sin, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dsv4attn::qnorm_rope_backward", mutates_args=())
def qnorm_rope_backward_op(grad: torch.Tensor, q: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
    """dx of :func:`qnorm_rope_op` (``q.dtype``) from its output ``q`` and rstd."""
    with backend.exact_math(q.device):
        return _qnorm_rope_bwd(grad, q, rstd, cos, sin)


@qnorm_rope_backward_op.register_fake
def _qnorm_rope_backward_fake(grad, q, rstd, cos, sin):
    return q.new_empty(q.shape)


def _qnorm_rope_setup_context(ctx, inputs, output):
    _, cos, sin, _ = inputs
    q, rstd = output
    ctx.save_for_backward(q, rstd, cos, sin)
    ctx.mark_non_differentiable(rstd)


def _qnorm_rope_backward(ctx, grad, _grad_rstd):
    q, rstd, cos, sin = ctx.saved_tensors
    return qnorm_rope_backward_op(grad.to(q.dtype).contiguous(), q, rstd, cos, sin), None, None, None


qnorm_rope_op.register_autograd(_qnorm_rope_backward, setup_context=_qnorm_rope_setup_context)


@torch.library.custom_op("dsv4attn::rope_rotate", mutates_args=())
def rope_rotate_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Out-of-place RoPE (``inverse``: by -angle) of contiguous x (T, H, D); a fresh tensor even at rope_dim 0."""
    with backend.exact_math(x.device):
        return _rope_fwd(x, cos, sin, 0.0, norm=False, sign=-1 if inverse else 1)[0]


@rope_rotate_op.register_fake
def _rope_rotate_fake(x, cos, sin, inverse):
    return x.new_empty(x.shape)


def _rope_rotate_setup_context(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _rope_rotate_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return rope_rotate_op(grad.contiguous(), cos, sin, not ctx.inverse), None, None, None


rope_rotate_op.register_autograd(_rope_rotate_backward, setup_context=_rope_rotate_setup_context)


def kernel_supports(x: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """fp16 / bf16 / fp32 x; with RoPE channels an even head_dim (pairs start at an even channel)."""
    return x.dtype in KERNEL_DTYPES and (inv_freq.shape[0] == 0 or x.shape[-1] % 2 == 0)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor):
    """(T, rope_dim / 2) fp32 cos and sin, from float64 angles: exactly the reference's values."""
    return rope_cos_sin(positions, inv_freq, torch.float32)


def qnorm_rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float
                      ) -> torch.Tensor:
    """Triton implementation behind :func:`dsv4attn.ops.qnorm_rope` (arguments already checked).

    float64 inputs (and odd head dims with RoPE channels) **fall back to the reference**, so float64 checks keep
    working on any backend.
    """
    if not kernel_supports(x, inv_freq):
        return qnorm_rope_reference(x, positions, inv_freq, eps)
    cos, sin = rope_table(positions, inv_freq)
    return qnorm_rope_op(x.contiguous(), cos, sin, float(eps))[0]


def qnorm_rope_stats_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation behind :func:`dsv4attn.ops.qnorm_rope.qnorm_rope_stats` (no graph; arguments checked):
    the forward kernel's output and its rstd. float64 (and odd head dims with RoPE channels) fall back to the
    reference."""
    if not kernel_supports(x, inv_freq):
        return qnorm_rope_reference(x, positions, inv_freq, eps), rstd_reference(x, eps)
    cos, sin = rope_table(positions, inv_freq)
    return qnorm_rope_op(x.contiguous(), cos, sin, float(eps))      # the op: opaque to torch.compile


def qnorm_rope_input_grad_triton(grad: torch.Tensor, q: torch.Tensor, rstd: torch.Tensor, positions: torch.Tensor,
                                 inv_freq: torch.Tensor) -> torch.Tensor:
    """Triton implementation behind :func:`dsv4attn.ops.qnorm_rope.qnorm_rope_input_grad`: the backward kernel
    (float64 and the like: the reference)."""
    if not kernel_supports(q, inv_freq) or rstd.dtype != torch.float32:
        return qnorm_rope_input_grad_reference(grad, q, rstd, positions, inv_freq)
    cos, sin = rope_table(positions, inv_freq)
    return qnorm_rope_backward_op(grad.to(q.dtype).contiguous(), q.contiguous(), rstd.contiguous(), cos, sin)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool,
                   reference) -> torch.Tensor:
    if not kernel_supports(x, inv_freq):
        return reference(x, positions, inv_freq)
    cos, sin = rope_table(positions, inv_freq)
    return rope_rotate_op(x.contiguous(), cos, sin, inverse)


def rope_rotate_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Triton implementation behind :func:`dsv4attn.ops.rope_rotate` (arguments already checked); float64 falls
    back to the reference."""
    return _rotate_triton(x, positions, inv_freq, False, rope_rotate_reference)


def inverse_rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Triton implementation behind :func:`dsv4attn.ops.inverse_rope` (arguments already checked); float64 falls
    back to the reference. Always a new tensor (the custom op allocates its output)."""
    return _rotate_triton(x, positions, inv_freq, True, inverse_rope_reference)


for _op, _bwd in (("qnorm_rope", "_qnorm_rope_bwd_kernel"), ("rope_rotate", "_rope_fwd_kernel"),
                 ("inverse_rope", "_rope_fwd_kernel")):
    variants.register(_op, "forward", variants.Variant("triton", f"{_op} kernel (_rope_fwd_kernel)", variants.always,
                                                       variants.always))
    variants.register(_op, "backward", variants.Variant("triton", f"{_op} backward ({_bwd})", variants.always,
                                                        variants.always))
backend.register_kernel("qnorm_rope", qnorm_rope_triton)
backend.register_kernel("rope_rotate", rope_rotate_triton)
backend.register_kernel("inverse_rope", inverse_rope_triton)

__all__ = ["qnorm_rope_triton", "qnorm_rope_stats_triton", "qnorm_rope_input_grad_triton", "rope_rotate_triton", "inverse_rope_triton", "qnorm_rope_op", "qnorm_rope_backward_op",
           "rope_rotate_op", "kernel_supports", "rope_table", "CONFIGS"]
