"""``torch.ops.dsv4attn.sparse_attention``: the tensor-indices path as a registered custom op.

Registered with ``torch.library.custom_op`` + ``register_fake`` + ``register_autograd`` so that ``torch.compile``
(fullgraph) sees one opaque node per direction instead of tracing the kernels' Python launchers, and so that the
op can be captured in a CUDA graph: nothing in either direction reads a device value on the host and every shape
follows from the input shapes (value checks run before the op, in :func:`dsv4attn.ops.sparse_attention`).

The backend is an argument (``impl``, "reference" or "triton"), chosen once by the public function through
:mod:`dsv4attn.backend`; the backward runs on the backend the forward ran on. :func:`run` is what both backends
call: lazy :class:`IndexSet` inputs do not pass through the op on the reference backend (it consumes them chunk by
chunk in eager mode), the kernels take them one chunk of rows at a time.

This module never imports the kernels: ``triton.py`` imports it and hands its launchers over
(:func:`register_triton`), so that a CPU-only install has the op and there is no import cycle.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import backend
from ...rope import apply_rope
from ..index_sets import Explicit, IndexSet, chunk_rows
from ..qnorm_rope.reference import qnorm_rope_input_grad_reference
from .reference import reference_backward, reference_forward, reference_lse, sparse_attention_reference

IMPLS = ("reference", "triton")
# (supports(q), forward, backward, lse) of the kernels, set by ``triton.py`` when it is imported; None without
# Triton.
_triton: tuple | None = None


def register_triton(supports, forward, backward, lse) -> None:
    global _triton
    _triton = (supports, forward, backward, lse)


def limit_slots(indices: torch.Tensor, topk_length: Optional[torch.Tensor]) -> torch.Tensor:
    """``indices`` with slots ``k >= topk_length[t]`` of row t set to -1 (FlashMLA's ``topk_length``)."""
    if topk_length is None:
        return indices
    slot = torch.arange(indices.shape[1], device=indices.device)
    return torch.where(slot[None, :] < topk_length[:, None], indices, -1)


def _kernels(q: torch.Tensor, impl: str):
    """The kernels' (supports, forward, backward, lse) when ``impl`` is "triton" and they take ``q``; None means: run
    the reference."""
    return _triton if impl == "triton" and _triton is not None and _triton[0](q) else None


def _rope(positions: Optional[torch.Tensor], inv_freq: Optional[torch.Tensor]):
    """(positions, inv_freq) of the output rotation, or None (no rotation asked for, or no RoPE channels)."""
    return None if positions is None or inv_freq is None or inv_freq.shape[0] == 0 else (positions, inv_freq)


@torch.library.custom_op("dsv4attn::sparse_attention", mutates_args=())
def sparse_attention_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, attn_sink: torch.Tensor,
                        softmax_scale: float, topk_length: Optional[torch.Tensor], deterministic: bool,
                        impl: str, rope_positions: Optional[torch.Tensor] = None,
                        rope_inv_freq: Optional[torch.Tensor] = None, mass_probe: Optional[torch.Tensor] = None,
                        mass_offset: int = 0, query_input: Optional[torch.Tensor] = None,
                        query_rstd: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of :func:`dsv4attn.ops.sparse_attention` for (T, K) tensor indices, arguments already checked.

    ``deterministic`` only affects the backward; ``impl`` names the backend ("reference" or "triton").
    ``mass_probe`` (T, W) fp32 (fp64 for fp64 ``q``) and ``mass_offset``: the forward does not read the probe; the
    backward hands the head-summed probabilities of slots ``mass_offset .. mass_offset + W`` to it as its gradient
    (the sparse indexer KL's teacher, :func:`dsv4attn.ops.sparse_attention`).
    ``rope_positions`` (T,) and ``rope_inv_freq`` (R/2,): the output comes rotated back by ``-positions * inv_freq``
    on its last R channels (``output_rope``: the kernels rotate before their one rounding, the reference rounds,
    then rotates with :func:`dsv4attn.rope.apply_rope`).
    ``query_input`` (T, H, D) and ``query_rstd`` (T, H) (``query_norm``): q is ``qnorm_rope(query_input)`` with that
    rstd and the output's angles; the forward reads neither, the backward gives the gradient to ``query_input``.
    Returns out (T, H, D) ``q.dtype`` and lse (T, H) fp32 (fp64 for fp64 ``q``), both contiguous.
    """
    idx = limit_slots(indices, topk_length)
    rope = _rope(rope_positions, rope_inv_freq)
    with backend.exact_math(q.device):
        kernels = _kernels(q, impl)
        if kernels is not None:
            return kernels[1](q, kv, idx, attn_sink, softmax_scale, rope)
        out, lse = reference_forward(q, kv, Explicit(idx), attn_sink, softmax_scale)
        if rope is not None:
            out = apply_rope(out, *rope, inverse=True)
        return out.contiguous(), lse


@sparse_attention_op.register_fake
def _sparse_attention_fake(q, kv, indices, attn_sink, softmax_scale, topk_length, deterministic, impl,
                           rope_positions=None, rope_inv_freq=None, mass_probe=None, mass_offset=0, query_input=None,
                           query_rstd=None):
    T, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((T, H), dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("dsv4attn::sparse_attention_backward", mutates_args=())
def sparse_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                 attn_sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, softmax_scale: float,
                                 topk_length: Optional[torch.Tensor], deterministic: bool,
                                 impl: str, rope_positions: Optional[torch.Tensor] = None,
                                 rope_inv_freq: Optional[torch.Tensor] = None, mass_offset: int = 0,
                                 mass_width: int = 0, query_rstd: Optional[torch.Tensor] = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``q.dtype``, dkv ``kv.dtype``, d_attn_sink ``attn_sink.dtype`` from the forward's saved ``out`` and ``lse``
    (the one-pass GPU backward forms Delta = rowsum(dO * out) from ``out``; the other backends recompute it), and
    the (T, ``mass_width``) head-summed probabilities of slots ``mass_offset .. mass_offset + mass_width``
    (the sparse indexer KL's teacher mass, fp32 (fp64 for fp64 ``q``); (T, 0) when ``mass_width`` is 0, and then
    not formed).

    With the output rotation, ``grad_out`` and ``out`` are in the rotated frame: the gradient is rotated forward
    (by ``+positions * inv_freq``, rounded to its dtype) before the attention's backward; Delta, a sum of per-head
    dot products, is the same in either frame, so the kernels' pre-pass forms it from the two as given.
    ``deterministic=True`` makes the Triton backward atomic-free (bitwise repeatable); the reference always is.
    With ``query_rstd`` (T, H) the first result is the gradient of the query norm's input (``query_norm``), not dq.
    """
    idx = limit_slots(indices, topk_length)
    rope = _rope(rope_positions, rope_inv_freq)
    slots = (mass_offset, mass_width) if mass_width else None
    with backend.exact_math(q.device):
        kernels = _kernels(q, impl)
        if kernels is not None:
            grads = kernels[2](grad_out, q, kv, idx, attn_sink, out, lse, softmax_scale, deterministic, rope, slots,
                               query_rstd)
        else:
            if rope is not None:
                grad_out = apply_rope(grad_out, *rope)
            grads = reference_backward(grad_out, q, kv, Explicit(idx), attn_sink, lse, softmax_scale,
                                       mass_slots=slots)
            if query_rstd is not None:
                grads = (norm_input_grad(grads[0], q, query_rstd, rope), *grads[1:])
            grads = tuple(g.contiguous() for g in grads)
    return grads if slots else (*grads, _mass_like(q, 0))


def _mass_like(q: torch.Tensor, width: int) -> torch.Tensor:
    """An empty (T, width) teacher mass in the compute dtype (fp32, fp64 for fp64 ``q``)."""
    return q.new_empty(q.shape[0], width, dtype=torch.promote_types(q.dtype, torch.float32))


@sparse_attention_backward_op.register_fake
def _sparse_attention_backward_fake(grad_out, q, kv, indices, attn_sink, out, lse, softmax_scale, topk_length,
                                    deterministic, impl, rope_positions=None, rope_inv_freq=None, mass_offset=0,
                                    mass_width=0, query_rstd=None):
    return (q.new_empty(q.shape), kv.new_empty(kv.shape), attn_sink.new_empty(attn_sink.shape),
            _mass_like(q, mass_width))


def _setup_context(ctx, inputs, output):
    (q, kv, indices, attn_sink, softmax_scale, topk_length, deterministic, impl, positions, inv_freq, probe,
     mass_offset, _query_input, query_rstd) = inputs
    ctx.save_for_backward(q, kv, indices, attn_sink, output[0], output[1], topk_length, positions, inv_freq,
                          query_rstd)
    ctx.softmax_scale, ctx.deterministic, ctx.impl = softmax_scale, deterministic, impl
    # The mass is formed only when the probe's channel is wanted (a probe that does not require grad costs nothing).
    ctx.mass_offset = mass_offset
    ctx.mass_width = probe.shape[1] if probe is not None and ctx.needs_input_grad[10] else 0
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_lse):
    q, kv, indices, attn_sink, out, lse, topk_length, positions, inv_freq, query_rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(q)
    dq, dkv, dsink, mass = sparse_attention_backward_op(grad_out, q, kv, indices, attn_sink, out, lse,
                                                        ctx.softmax_scale, topk_length, ctx.deterministic, ctx.impl,
                                                        positions, inv_freq, ctx.mass_offset, ctx.mass_width,
                                                        query_rstd)
    # With query_norm the first gradient is the norm input's (q itself gets none).
    dq, dx = (None, dq) if query_rstd is not None else (dq, None)
    # The probe's "gradient" is the teacher mass (a channel to the indexer KL's node, not a derivative).
    return (dq, dkv, None, dsink, None, None, None, None, None, None, mass if ctx.mass_width else None, None, dx,
            None)


sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("dsv4attn::sparse_attention_lse", mutates_args=())
def sparse_attention_lse_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                            impl: str) -> torch.Tensor:
    """The forward's lse alone, (T, H) fp32 (fp64 for fp64 ``q``), for (T, K) tensor indices, arguments already
    checked; no gradient (:func:`dsv4attn.ops.sparse_attention.sparse_attention_lse`)."""
    with backend.exact_math(q.device):
        kernels = _kernels(q, impl)
        if kernels is not None:
            return kernels[3](q, kv, indices, softmax_scale)
        return reference_lse(q, kv, Explicit(indices), softmax_scale)


@sparse_attention_lse_op.register_fake
def _sparse_attention_lse_fake(q, kv, indices, softmax_scale, impl):
    return q.new_empty(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32))


def _lse_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _lse_backward(ctx, _grad_lse):
    return None, None, None, None, None


# Not differentiable (as the attention's lse): inputs that require grad give an output that does not.
sparse_attention_lse_op.register_autograd(_lse_backward, setup_context=_lse_setup_context)


def run_lse(q, kv, indices, scale: float, impl: str) -> torch.Tensor:
    """:func:`sparse_attention_lse_op` for tensor or :class:`IndexSet` indices (the latter one chunk of query rows
    at a time, as :func:`run` takes them)."""
    if isinstance(indices, torch.Tensor):
        return sparse_attention_lse_op(q, kv, indices, scale, impl)
    if impl == "reference":                         # chunk by chunk, never materialised
        with backend.exact_math(q.device):
            return reference_lse(q, kv, indices, scale)
    chunks = list(chunk_rows(q.shape[0], indices.width, device=q.device)) or [(0, 0)]
    parts = [sparse_attention_lse_op(q[s:e], kv, indices.rows(s, e, torch.int32).to(torch.int32), scale, impl)
             for s, e in chunks]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def norm_input_grad(grad: torch.Tensor, q: torch.Tensor, rstd: torch.Tensor, rope) -> torch.Tensor:
    """The gradient of the query norm's input from ``grad``, the gradient of its output ``q`` (reference formula;
    ``rope``: the (positions, inv_freq) of q's rotation, or None)."""
    if rope is None:
        rope = (torch.zeros(q.shape[0], dtype=torch.int64, device=q.device),
                torch.zeros(0, dtype=torch.float64, device=q.device))
    return qnorm_rope_input_grad_reference(grad, q, rstd, *rope)


class _NormedQuery(torch.autograd.Function):
    """q as it is, with the gradient of the norm's input ``x`` (``query_norm`` on the reference's index-set path,
    whose attention is plain autograd): the backward maps q's gradient to x's."""

    @staticmethod
    def forward(ctx, q, x, rstd, positions, inv_freq):
        ctx.save_for_backward(q, rstd, positions, inv_freq)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad):
        q, rstd, positions, inv_freq = ctx.saved_tensors
        return None, norm_input_grad(grad, q, rstd, _rope(positions, inv_freq)), None, None, None


def run(q, kv, indices, attn_sink, scale: float, topk_length, deterministic: bool, impl: str, output_rope=None,
        mass_probe=None, mass_offset: int = 0, query_norm=None):
    """The op on backend ``impl`` for tensor or :class:`IndexSet` indices (arguments already checked);
    ``output_rope``: None or (positions, inv_freq) of the output's inverse RoPE; ``mass_probe`` / ``mass_offset``:
    see :func:`sparse_attention_op`; ``query_norm``: None or (x, rstd), the gradient goes to x instead of q."""
    positions, inv_freq = output_rope if output_rope is not None else (None, None)
    x, rstd = query_norm if query_norm is not None else (None, None)
    with backend.exact_math(q.device):
        if isinstance(indices, IndexSet):
            index_set = indices if topk_length is None else _FirstSlots(indices, topk_length)
            if impl == "reference":                 # chunk by chunk: never materialises (T, K) indices
                if query_norm is not None:
                    q = _NormedQuery.apply(q, x, rstd, positions, inv_freq)
                out, lse = sparse_attention_reference(q, kv, index_set, attn_sink, scale, mass_probe, mass_offset)
                if _rope(positions, inv_freq) is not None:      # not differentiable in inv_freq, as the op
                    out = apply_rope(out, positions, inv_freq.detach(), inverse=True)
                return out, lse
            # The kernels take (rows, K) tensors: materialise them one chunk of query rows at a time, so that a
            # wide set (every visible compressed entry of a long document) never becomes a (T, K) tensor.
            chunks = list(chunk_rows(q.shape[0], index_set.width, device=q.device)) or [(0, 0)]
            # q whole, or split (its backward is one concatenation): a slice q[s:e] costs its backward a zero-filled
            # copy of the whole of q per chunk, 2 GiB each at T = 32K with 64 heads of 512, even for q[0:T].
            sizes = [e - s for s, e in chunks]
            pieces = [q] if len(chunks) == 1 else q.split(sizes)
            # The probe and the norm's input split the same way (their backwards are one concatenation each).
            probes, inputs = ([None] * len(chunks) if t is None else [t] if len(chunks) == 1 else t.split(sizes)
                              for t in (mass_probe, x))
            # int32 asked for and formed directly; .to() is free then, and keeps a subclass that ignores dtype safe.
            parts = [sparse_attention_op(piece, kv, index_set.rows(s, e, torch.int32).to(torch.int32), attn_sink,
                                         scale, None, deterministic, impl,
                                         None if positions is None else positions[s:e], inv_freq, probe, mass_offset,
                                         x_part, None if rstd is None else rstd[s:e])
                     for piece, probe, x_part, (s, e) in zip(pieces, probes, inputs, chunks)]
            if len(parts) == 1:
                return parts[0]
            return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
        return sparse_attention_op(q, kv, indices, attn_sink, scale, topk_length, deterministic, impl, positions,
                                   inv_freq, mass_probe, mass_offset, x, rstd)


class _FirstSlots(IndexSet):
    """``base`` with slots ``k >= lengths[t]`` of row t empty: ``topk_length`` applied to a lazy index set."""

    def __init__(self, base: IndexSet, lengths: torch.Tensor):
        self.base, self.lengths = base, lengths
        self.width, self.total_rows, self.bound = base.width, base.total_rows, base.bound

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return limit_slots(self.base.rows(start, end, dtype), self.lengths[start:end])


__all__ = ["sparse_attention_op", "sparse_attention_backward_op", "sparse_attention_lse_op", "limit_slots", "run",
           "run_lse", "register_triton", "IMPLS"]
