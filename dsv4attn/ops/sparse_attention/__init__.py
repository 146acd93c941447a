"""Sparse MQA attention over a per-row index list, with a per-head attention sink."""
from __future__ import annotations

import torch

from ... import backend, checks
from ..index_sets import IndexSet, within
from .op import run, run_lse
from .reference import sparse_attention_naive, sparse_attention_reference

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | IndexSet, attn_sink: torch.Tensor,
                     softmax_scale: float | None = None, *, topk_length: torch.Tensor | None = None,
                     deterministic: bool = False, output_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     mass_probe: torch.Tensor | None = None, mass_offset: int = 0,
                     query_norm: tuple[torch.Tensor, torch.Tensor] | None = None):
    """One softmax per (row, head) over the keys ``indices[t]`` plus the sink logit (docs/semantics.md, decision 5).

    Args:
        q: (T, H, D) queries, fp16/bf16/fp32/fp64.
        kv: (N, D) the single shared KV head, same dtype as ``q`` (keys and values are the same rows).
        indices: (T, K) int32 rows of ``kv`` per query, ``-1`` = empty slot (or an :class:`IndexSet`).
            A repeated index counts once per occurrence. An index outside ``[0, N)`` is an empty slot too: it is
            never read (values >= N are set to -1 first, one elementwise pass and no host read; an
            :class:`IndexSet` whose ``bound`` is <= N, like the layers' own, skips that). In the debug mode
            (``dsv4attn.set_checks("values")``) an index tensor holding a value outside ``[-1, N)`` raises instead.
        attn_sink: (H,) per-head sink logit, fp32 (fp64 allowed for float64 checks); value 0, denominator only.
        softmax_scale: defaults to ``D ** -0.5``.
        topk_length: optional (T,) int32 (int64 accepted) in [0, K]: row t uses only its first ``topk_length[t]``
            slots, the rest count as ``-1`` (FlashMLA's ``topk_length``).
        deterministic: the backward gives bitwise-identical dq, dkv, d_attn_sink on every run with the same
            inputs (no float atomics: the kernels write per-slot dKV rows and reduce them in a fixed order; on
            SM90 at D = 512 the Gluon kernel in 2.5-3.1x the default backward's time; elsewhere the Triton passes,
            on an H100 4.2-5.3x the default Gluon backward's time). The reference backend is always deterministic.
        output_rope: optional ``(positions, inv_freq)``, (T,) int32 / int64 on ``q``'s device and (R/2,) float
            frequencies with R <= D: ``out`` comes rotated back by ``-positions[t] * inv_freq`` on its last R
            channels in interleaved pairs, the layer's output inverse RoPE (docs/semantics.md, "Output" step 1),
            done in the kernels' epilogue instead of a pass of its own over (T, H, D); the backward kernels rotate
            the incoming gradient forward as they load it. The kernels rotate in fp32 before their one rounding;
            the reference rounds ``out``, then rotates (:func:`dsv4attn.rope.apply_rope`). Not differentiable in
            ``inv_freq`` (on the layer it is a buffer); ``inv_freq`` must be on ``q``'s device too (a CUDA-graph
            capture cannot copy it there).
        mass_probe: optional (T, W) tensor in the compute dtype (fp32; fp64 for fp64 ``q``), and ``mass_offset``
            an int with ``mass_offset + W <= K``: a channel, not an input. The forward never reads it; if it
            requires grad, the backward hands it, as its gradient, the head-summed probabilities
            ``sum_h p[t, h, mass_offset + j]`` (j < W, 0 at empty slots, normalised by the full denominator with
            the sink): the sparse indexer KL's teacher mass when those slots are the top-k, formed by the backward
            kernels from the probabilities they form anyway. The node that made the probe
            (:func:`dsv4attn.ops.indexer_kl_from_attention`) turns it into the KL's gradient. Every backend forms
            it (the Gluon and Triton backwards in the pass that forms dq, the reference from its probabilities).
        query_norm: optional ``(x, rstd)`` from :func:`dsv4attn.ops.qnorm_rope.qnorm_rope_stats`: ``q`` is
            ``qnorm_rope(x)`` (per-head unweighted RMSNorm, then RoPE by ``output_rope``'s angles; no rotation
            without ``output_rope``) and ``rstd`` (T, H) its fp32 (fp64 for fp64 ``q``) ``1 / rms``; ``x`` is
            (T, H, D) in ``q``'s dtype and ``q`` must not require grad. The gradient then goes to ``x``: the
            Triton backward applies the norm's backward in its dq epilogue instead of the pass
            :func:`dsv4attn.ops.qnorm_rope` would run over dq and q (on SM90 the Gluon backward still runs that
            pass after its dq). Values are those of ``q`` as given; ``x`` is not read by the forward.
    Returns:
        out: (T, H, D) in ``q.dtype``; rows without a valid index give 0.
        lse: (T, H) fp32 (fp64 for fp64 inputs), natural log, **excluding** the sink; ``-inf`` for empty rows.
        The full softmax denominator is ``logaddexp(lse, attn_sink)``.

    Tensor indices run as the registered op ``torch.ops.dsv4attn.sparse_attention`` (works under
    ``torch.compile(fullgraph=True)`` and CUDA-graph capture). :class:`IndexSet` inputs run eagerly. By default
    nothing here reads a device value; the debug mode's checks (index and ``topk_length`` ranges, NaN in ``q``,
    ``kv``, ``attn_sink``: a scan and a host read each) are skipped while compiling or capturing.
    """
    width = _check_q_kv_indices(q, kv, indices)
    T, H, D = q.shape
    checks.check_tensor("attn_sink", attn_sink, shape=(H,), dtypes=(torch.float32, torch.float64), device=q.device)
    if topk_length is not None:
        checks.check_tensor("topk_length", topk_length, shape=(T,), dtypes=INDEX_DTYPES, device=q.device)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if output_rope is not None:
        _check_output_rope(output_rope, T, D, q.device)
    if mass_probe is not None:
        _check_mass_probe(mass_probe, mass_offset, q, width)
    if query_norm is not None:
        _check_query_norm(query_norm, q)
    scale = checks.check_scale(softmax_scale, D)
    if checks.values_readable():                    # the debug mode ("values"): raise where the default masks
        if isinstance(indices, torch.Tensor):
            checks.check_index_range("indices", indices, kv.shape[0])
        if topk_length is not None:
            _check_topk_length_range(topk_length, width)
        checks.check_finite("q", q)
        checks.check_finite("kv", kv)
        checks.check_finite("attn_sink", attn_sink, allow_inf=True)
    # topk_length needs no masking: slots past min(length, K) are empty by definition.
    indices = _in_range(indices, kv.shape[0])

    if backend.choose("sparse_attention", q.device) == "triton":
        return backend.kernel("sparse_attention")(q, kv, indices, attn_sink, scale, topk_length=topk_length,
                                                  deterministic=deterministic, output_rope=output_rope,
                                                  mass_probe=mass_probe, mass_offset=mass_offset,
                                                  query_norm=query_norm)
    return run(q, kv, indices, attn_sink, scale, topk_length, deterministic, "reference", output_rope, mass_probe,
               mass_offset, query_norm)


def sparse_attention_lse(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | IndexSet,
                         softmax_scale: float | None = None) -> torch.Tensor:
    """The ``lse`` of :func:`sparse_attention` without its output: per row and head the natural-log sum of
    ``exp(softmax_scale * <q[t, h], kv[k]>)`` over the valid keys ``indices[t]``, sink excluded.

    Args: ``q``, ``kv``, ``indices`` and ``softmax_scale`` as :func:`sparse_attention` takes them (out-of-range
    indices are empty slots, the debug mode raises on them).
    Returns: (T, H) fp32 (fp64 for fp64 inputs), ``-inf`` for rows without a valid key. Not differentiable: it is
    computed without autograd (what the indexer loss needs of the window: the teacher's detached mass outside its
    candidates).

    On SM90 (bf16 / fp16, H a multiple of 64, D in (128, 256, 512)) a Gluon kernel forms the scores alone (the
    indexer KL teacher's LSE kernel: no P V products, no output written); it agrees with :func:`sparse_attention`'s
    lse up to fp32 rounding. Elsewhere the Triton forward kernel runs without its P V products and output (its lse
    the full kernel's to the last bits: bit for bit under the CPU interpreter, on an H100 the same float64 error to
    the digit); the reference forms the scores alone too. Tensor indices run as
    the registered op ``torch.ops.dsv4attn.sparse_attention_lse``; :class:`IndexSet` inputs go to it one chunk of
    query rows at a time."""
    _check_q_kv_indices(q, kv, indices)
    scale = checks.check_scale(softmax_scale, q.shape[2])
    if checks.values_readable():
        if isinstance(indices, torch.Tensor):
            checks.check_index_range("indices", indices, kv.shape[0])
        checks.check_finite("q", q)
        checks.check_finite("kv", kv)
    indices = _in_range(indices, kv.shape[0])
    impl = "triton" if backend.choose("sparse_attention", q.device) == "triton" else "reference"
    with torch.no_grad():
        return run_lse(q.detach(), kv.detach(), indices, scale, impl)


def _check_q_kv_indices(q, kv, indices) -> int:
    """Checks ``q`` (T, H, D), ``kv`` (N, D) and ``indices`` (T, K) or an index set of T rows; returns K."""
    checks.check_tensor("q", q, dim=3, dtypes=FLOATS)
    T, H, D = q.shape
    checks.check_tensor("kv", kv, shape=(None, D), dtypes=(q.dtype,), device=q.device)
    if isinstance(indices, torch.Tensor):
        checks.check_tensor("indices", indices, shape=(T, None), dtypes=INDEX_DTYPES, device=q.device)
        return indices.shape[1]
    if isinstance(indices, IndexSet):
        if indices.total_rows != T:
            raise ValueError(f"indices must cover the {T} rows of q, got an index set of {indices.total_rows} rows")
        return indices.width
    raise TypeError(f"indices must be a (T, K) int32 torch.Tensor or an IndexSet, got {type(indices).__name__}")


def _in_range(indices, rows: int):
    """Index safety, in every mode and without a host read: no kernel ever sees a row >= ``rows`` (negative rows
    are empty slots in all of them)."""
    if isinstance(indices, torch.Tensor):
        return checks.mask_out_of_range(indices, rows)
    return within(indices, rows)


def _check_output_rope(output_rope, T: int, D: int, device) -> None:
    if not (isinstance(output_rope, (tuple, list)) and len(output_rope) == 2):
        raise TypeError(f"output_rope must be a (positions, inv_freq) pair of tensors, got "
                        f"{type(output_rope).__name__}")
    positions, inv_freq = output_rope
    checks.check_tensor("output_rope positions", positions, shape=(T,), dtypes=INDEX_DTYPES, device=device)
    checks.check_tensor("output_rope inv_freq", inv_freq, dim=1, dtypes=(torch.float32, torch.float64),
                        device=device)
    if 2 * inv_freq.shape[0] > D:
        raise ValueError(f"output_rope inv_freq of length {inv_freq.shape[0]} rotates {2 * inv_freq.shape[0]} "
                         f"channels, more than q's head dim {D}")


def _check_query_norm(query_norm, q: torch.Tensor) -> None:
    if not (isinstance(query_norm, (tuple, list)) and len(query_norm) == 2):
        raise TypeError(f"query_norm must be an (x, rstd) pair of tensors, got {type(query_norm).__name__}")
    x, rstd = query_norm
    checks.check_tensor("query_norm x", x, shape=tuple(q.shape), dtypes=(q.dtype,), device=q.device)
    checks.check_tensor("query_norm rstd", rstd, shape=tuple(q.shape[:2]),
                        dtypes=(torch.promote_types(q.dtype, torch.float32),), device=q.device)
    if q.requires_grad:
        raise ValueError("q must not require grad when query_norm is given: the gradient goes to query_norm's x "
                         "(make q under torch.no_grad(), e.g. with qnorm_rope_stats)")


def _check_mass_probe(probe, offset, q: torch.Tensor, width: int) -> None:
    cd = torch.promote_types(q.dtype, torch.float32)
    checks.check_tensor("mass_probe", probe, shape=(q.shape[0], None), dtypes=(cd,), device=q.device)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"mass_offset must be an int, got {type(offset).__name__}")
    if offset < 0 or offset + probe.shape[1] > width:
        raise ValueError(f"mass_offset + mass_probe.shape[1] must lie within the {width} slots of indices, got slots "
                         f"{offset} .. {offset + probe.shape[1]}")


def _check_topk_length_range(topk_length: torch.Tensor, width: int) -> None:
    if topk_length.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(topk_length)).tolist()          # one read
    if lo < 0 or hi > width:
        raise ValueError(f"topk_length must hold slot counts in [0, {width}] (K = indices.shape[1]), "
                         f"got values in [{lo}, {hi}]")


try:  # registers the Triton kernel with the backend (used on CUDA); CPU-only installs run the reference
    from . import triton as _triton_kernels  # noqa: F401
except ImportError:
    pass

__all__ = ["sparse_attention", "sparse_attention_lse", "sparse_attention_reference", "sparse_attention_naive"]
