"""Triton kernels for the compressor's gated pooling (docs/semantics.md, decision 4), forward and backward.

Same contract as :func:`.reference.compress_pool_reference`. Entry e of the layout has ``S`` slots:

* ratio 4 (overlap, ``S = 8``): slot s reads packed row ``first_row[e] - 4 + s``; slots 0..3 (the previous group)
  read the first channel half and exist only when ``entry_index[e] > 0``, slots 4..7 (its own group) the second;
* any other ratio r (``S = r``, 128 in V4): slot s reads row ``first_row[e] + s``, all channels.

Per channel: ``w = softmax_s(gate + position_bias[s mod r])`` in fp32, ``pooled = sum_s w * kv`` in fp32, one
rounding to ``kv.dtype``; padding entries are 0. With that uniform slot -> (row, column) map both ratios share one
kernel: a program takes a ``BLOCK_E x CHUNK x BLOCK_D`` tile (entries x slots x channels, channels contiguous in
memory) and walks the slots chunk by chunk with an online softmax (ratio 4: one chunk of all 8 slots; ratio 128:
chunks of ``CHUNK`` slots, so the ``(entries, 128, d)`` tensor is never materialised). Every kv / gate element is
read once: a row's first half belongs to the next entry, its second half to its own.

Backward, with ``dy`` the output gradient: ``dkv_s = w_s * dy`` and ``dgate_s = w_s * (kv_s - pooled) * dy`` (the
softmax gradient; ``pooled`` in fp32, not the rounded output) and ``d_bias[s mod r] = sum_entries dgate_s``.

* Ratio 4 recomputes the softmax from its 8 slots (they are in registers anyway: no saved state, one read).
* Ratio 128 needs the per-channel statistics of all 128 slots before any slot's gradient, so its forward also
  writes ``lse`` (log2 domain) and the fp32 ``pooled`` per (entry, channel) -- 8 bytes per entry-channel, 1/64 of
  the inputs -- and its backward is one streaming pass in which every slot chunk is independent.
* Each (row, column) belongs to at most one slot of one entry, so the gradients are plain stores, no atomics. The
  main kernel also marks the rows it covered (one byte per row and half); a second kernel writes zeros where no
  entry reached (tails, short or empty documents, capacity padding, the first half of a document's last group).
  Together they write every gradient element exactly once (no zero-fill of the whole buffer first) and make no
  assumption about the order of the entries (context-parallel layouts interleave padding entries).
* ``d_bias`` is a reduction over entries, done deterministically in two stages: each program loops over a fixed
  group of entries and stores its partial sums for its (slots, channels) tile; a PyTorch sum over the groups
  finishes. The number of groups depends on the shapes only, so results are bitwise repeatable.

No device->host sync: every launch size follows from host ints (T, width, ``layout.capacity``).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ... import backend, variants
from ..triton_common import interpreting, round_to
from ...packing import CompressedLayout
from .reference import compress_pool_reference

LOG2E = tl.constexpr(1.4426950408889634)     # a constexpr global: jit'ed code may read it
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tiles per ratio. Forward / backward: BLOCK_E entries x CHUNK slots x BLOCK_D channels per step. MAX_GROUPS bounds
# the backward's entry groups: its grid is groups x slot chunks x channel blocks, and its d_bias partial buffer is
# groups x ratio x width fp32 (ratio 4, width 1024: 8 MiB at 512 groups; ratio 128, width 512: 8 MiB at 32),
# written and read once more: few groups keep that traffic small, enough groups keep the GPU busy. Benchmarks and
# tests may pass others (benchmarks/compressor.py --sweep; fwd configs may add CHANNELS_FIRST=True).
# The defaults are the fastest of benchmarks/compressor.py --sweep on the H200 at the Flash widths (BENCHMARKS.md,
# "Compressor"): at ratio 4 whole 512-channel rows per program, at ratio 128 one 128-slot chunk per entry. The backwards
# hold 160-255 registers per thread (offline ptxas, sm_90), which caps them at 8-12 warps per SM.
CONFIGS = {
    4: dict(fwd=dict(BLOCK_E=2, CHUNK=8, BLOCK_D=512, num_warps=4),
            bwd=dict(BLOCK_E=1, CHUNK=8, BLOCK_D=512, MAX_GROUPS=512, num_warps=4)),
    128: dict(fwd=dict(BLOCK_E=1, CHUNK=128, BLOCK_D=64, num_warps=4),
              bwd=dict(BLOCK_E=1, CHUNK=8, BLOCK_D=256, MAX_GROUPS=32, num_warps=4)),
}
DEFAULT_CONFIG = CONFIGS[128]                # other ratios (no overlap): the ratio-128 tiles
ZERO_CONFIG = dict(BLOCK_T=32, BLOCK_W=128, num_warps=4)


@triton.jit
def _slot_tile(FIRST_ROW, ENTRY_INDEX, IS_REAL, entries, entry_ok, slots, ch,
               D: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr):
    """Addresses of an (entries x slots x channels) tile.

    Returns element offsets into kv / gate (E, S, D) int64, the (E, S) mask of slots that exist, the (S, D)
    offsets into ``position_bias`` and the (E, S) packed rows (for the coverage marks).
    """
    W: tl.constexpr = 2 * D if OVERLAP else D
    PREV: tl.constexpr = R if OVERLAP else 0            # slots before the entry's own group
    first = tl.load(FIRST_ROW + entries, mask=entry_ok, other=0)
    real = tl.load(IS_REAL + entries, mask=entry_ok, other=0) != 0
    real = real & entry_ok
    own = slots >= PREV                                  # (S,) own group (second half) vs previous group
    if OVERLAP:
        index = tl.load(ENTRY_INDEX + entries, mask=entry_ok, other=0)
        # Entry 0 of a document has no previous group: its first 4 slots do not exist (weight exactly 0).
        exists = real[:, None] & (own[None, :] | (index[:, None] > 0))
    else:
        exists = real[:, None] & own[None, :]
    rows = first.to(tl.int64)[:, None] + (slots - PREV)[None, :]              # (E, S)
    cols = ch[None, :] + tl.where(own, W - D, 0)[:, None]                      # (S, D)
    offs = rows[:, :, None] * W + cols[None, :, :]
    bias_offs = tl.where(own, slots - PREV, slots)[:, None] * W + cols        # bias row = slot mod r
    return offs, exists, bias_offs, rows


@triton.jit
def _compress_pool_fwd_kernel(
    KV, GATE, BIAS, FIRST_ROW, ENTRY_INDEX, IS_REAL, OUT, LSE, POOLED,
    capacity,
    D: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr, SLOTS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, SAVE_STATS: tl.constexpr, ROUND_BF16: tl.constexpr,
    CHANNELS_FIRST: tl.constexpr,
):
    # CHANNELS_FIRST: neighbouring programs take neighbouring channel blocks of the same entries (whole rows).
    eb = tl.program_id(1) if CHANNELS_FIRST else tl.program_id(0)
    cb = tl.program_id(0) if CHANNELS_FIRST else tl.program_id(1)
    entries = (eb * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    entry_ok = entries < capacity
    ch = cb * BLOCK_D + tl.arange(0, BLOCK_D)                # BLOCK_D divides D: no channel mask

    m = tl.full([BLOCK_E, BLOCK_D], float("-inf"), tl.float32)     # running max of the gate (log2 units)
    l = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)                   # running sum of 2^(g - m)
    acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)                 # running sum of 2^(g - m) * kv
    for c in range(SLOTS // CHUNK):
        slots = c * CHUNK + tl.arange(0, CHUNK)
        offs, exists, bias_offs, _ = _slot_tile(FIRST_ROW, ENTRY_INDEX, IS_REAL, entries, entry_ok, slots, ch,
                                                D, R, OVERLAP)
        mask = exists[:, :, None]
        bias = tl.load(BIAS + bias_offs)
        # Missing slots: gate -inf (weight exactly 0) and kv 0, as in the reference.
        g = (tl.load(GATE + offs, mask=mask, other=float("-inf")).to(tl.float32) + bias[None, :, :]) * LOG2E
        x = tl.load(KV + offs, mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(g, 1))
        # A padding entry (or a chunk of missing slots) keeps m at -inf: shift by 0 so no -inf - -inf appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(g - m_safe[:, None, :])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha + tl.sum(p * x, 1)
        m = m_new

    # False exactly for padding entries; a NaN gate or bias makes l NaN and must reach the output, as in the reference.
    has_slots = (l > 0) | (l != l)
    pooled = tl.where(has_slots, acc / tl.where(has_slots, l, 1.0), 0.0)
    out_offs = entries[:, None] * D + ch[None, :]
    tl.store(OUT + out_offs, round_to(pooled, OUT, ROUND_BF16), mask=entry_ok[:, None])
    if SAVE_STATS:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(has_slots, m_safe + tl.log2(tl.where(has_slots, l, 1.0)), 0.0)
        tl.store(LSE + out_offs, lse, mask=entry_ok[:, None])
        tl.store(POOLED + out_offs, pooled, mask=entry_ok[:, None])


@triton.jit
def _compress_pool_bwd_kernel(
    KV, GATE, BIAS, FIRST_ROW, ENTRY_INDEX, IS_REAL, DOUT, LSE, POOLED,
    DKV, DGATE, DBIAS_PARTIAL, MARKS,
    capacity, entries_per_group, T,
    D: tl.constexpr, R: tl.constexpr, OVERLAP: tl.constexpr, SLOTS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, HAS_STATS: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    # Without saved statistics the chunk holds every slot (the launcher checks): the softmax is recomputed here.
    W: tl.constexpr = 2 * D if OVERLAP else D
    PREV: tl.constexpr = R if OVERLAP else 0
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    cb = tl.program_id(2)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    ch = cb * BLOCK_D + tl.arange(0, BLOCK_D)
    own = slots >= PREV

    d_bias = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    e_begin = group * entries_per_group
    e_end = tl.minimum(e_begin + entries_per_group, capacity)
    for e0 in range(e_begin, e_end, BLOCK_E):
        entries = (e0 + tl.arange(0, BLOCK_E)).to(tl.int64)
        entry_ok = entries < e_end
        offs, exists, bias_offs, rows = _slot_tile(FIRST_ROW, ENTRY_INDEX, IS_REAL, entries, entry_ok, slots, ch,
                                                   D, R, OVERLAP)
        mask = exists[:, :, None]
        bias = tl.load(BIAS + bias_offs)
        g = (tl.load(GATE + offs, mask=mask, other=float("-inf")).to(tl.float32) + bias[None, :, :]) * LOG2E
        x = tl.load(KV + offs, mask=mask, other=0.0).to(tl.float32)
        real = tl.max(exists.to(tl.int32), 1) > 0                 # (E,) padding entries have no slot
        ent_offs = entries[:, None] * D + ch[None, :]
        dy = tl.load(DOUT + ent_offs, mask=real[:, None], other=0.0).to(tl.float32)
        if HAS_STATS:
            lse = tl.load(LSE + ent_offs, mask=real[:, None], other=0.0)
            pooled = tl.load(POOLED + ent_offs, mask=real[:, None], other=0.0)
            w = tl.exp2(g - lse[:, None, :])                       # missing slots: 2^-inf = 0
        else:
            m = tl.max(g, 1)
            m = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(g - m[:, None, :])
            l = tl.sum(p, 1)
            w = p / tl.where(l > 0, l, 1.0)[:, None, :]
            pooled = tl.sum(w * x, 1)
        dkv = w * dy[:, None, :]
        dgate = dkv * (x - pooled[:, None, :])                  # softmax gradient: w * (dw - sum(w * dw))
        tl.store(DKV + offs, round_to(dkv, DKV, ROUND_BF16), mask=mask)
        tl.store(DGATE + offs, round_to(dgate, DGATE, ROUND_BF16), mask=mask)
        d_bias += tl.sum(dgate, 0)
        if cb == 0:
            # Coverage marks for the zero-fill kernel: plane 0 = own group (second half for ratio 4, the whole
            # row otherwise), plane 1 = previous group (first half, ratio 4 only).
            plane = tl.where(own, 0, 1).to(tl.int64)[None, :] * T
            tl.store(MARKS + plane + rows, tl.full([BLOCK_E, CHUNK], 1, tl.int8), mask=exists)
    # The same (bias row, column) map as _slot_tile's (the loop may run zero times, so it is rebuilt here).
    bias_offs = tl.where(own, slots - PREV, slots)[:, None] * W + ch[None, :] + tl.where(own, W - D, 0)[:, None]
    tl.store(DBIAS_PARTIAL + group.to(tl.int64) * R * W + bias_offs, d_bias)


@triton.jit
def _zero_uncovered_kernel(
    DKV, DGATE, MARKS, T,
    W: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_ok = rows < T
    own = tl.load(MARKS + rows, mask=row_ok, other=1) != 0
    if OVERLAP:
        prev = tl.load(MARKS + T + rows, mask=row_ok, other=1) != 0
        covered = tl.where(cols[None, :] < D, prev[:, None], own[:, None])
    else:
        covered = own[:, None] & (cols[None, :] >= 0)
    mask = row_ok[:, None] & (cols < W)[None, :] & ~covered
    offs = rows[:, None] * W + cols[None, :]
    zeros = tl.zeros([BLOCK_T, BLOCK_W], tl.float32)
    tl.store(DKV + offs, zeros.to(DKV.dtype.element_ty), mask=mask)
    tl.store(DGATE + offs, zeros.to(DGATE.dtype.element_ty), mask=mask)


def _slots(ratio: int) -> int:
    return 2 * ratio if ratio == 4 else ratio


def _configs(ratio: int) -> dict:
    return CONFIGS.get(ratio, DEFAULT_CONFIG)


def _tile_meta(config: dict, ratio: int, d: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Kernel constexprs and launch options of ``config`` for this ratio and channel width."""
    cfg = dict(config)
    launch = dict(num_warps=cfg.pop("num_warps"))
    cfg.pop("MAX_GROUPS", None)
    slots = _slots(ratio)
    cfg["CHUNK"] = min(cfg["CHUNK"], slots)
    cfg["BLOCK_D"] = min(cfg["BLOCK_D"], d & -d)                 # a power of two dividing d
    meta = dict(D=d, R=ratio, OVERLAP=ratio == 4, SLOTS=slots,
                ROUND_BF16=dtype == torch.bfloat16 and interpreting(), **cfg)
    return meta, launch


def saves_stats(ratio: int, config: dict | None = None) -> bool:
    """Whether the forward writes the per-(entry, channel) lse and fp32 pooled value for the backward."""
    bwd = (config or _configs(ratio))["bwd"]
    return min(bwd["CHUNK"], _slots(ratio)) < _slots(ratio)


def kernel_supports(kv: torch.Tensor, position_bias: torch.Tensor, ratio: int) -> bool:
    """The kernels take fp16/bf16/fp32 kv with an fp32 bias, d a multiple of 16, a power-of-two slot count."""
    width = kv.shape[1]
    d = width // 2 if ratio == 4 else width
    slots = _slots(ratio)
    return (kv.dtype in KERNEL_DTYPES and position_bias.dtype == torch.float32 and d % 16 == 0
            and slots & (slots - 1) == 0)


def _compress_pool_fwd(kv, gate, position_bias, first_row, entry_index, is_real, ratio: int, config=None):
    """Returns out (capacity, d) kv.dtype, and lse (log2 units) and pooled fp32 (capacity, d) when the backward
    needs them (``saves_stats``), else two (0, d) fp32 tensors."""
    config = config or _configs(ratio)
    capacity = first_row.shape[0]
    d = kv.shape[1] // 2 if ratio == 4 else kv.shape[1]
    out = torch.empty(capacity, d, dtype=kv.dtype, device=kv.device)
    stats = saves_stats(ratio, config)
    lse = torch.empty(capacity if stats else 0, d, dtype=torch.float32, device=kv.device)
    pooled = torch.empty_like(lse)
    if capacity == 0:                          # no entry at all (capacity <= T // ratio)
        return out, lse, pooled
    fwd = dict(config["fwd"])
    channels_first = fwd.pop("CHANNELS_FIRST", False)
    meta, launch = _tile_meta(fwd, ratio, d, kv.dtype)
    grid = (triton.cdiv(capacity, meta["BLOCK_E"]), d // meta["BLOCK_D"])
    channels_first = channels_first and grid[0] <= 65535             # grid axis 1 holds at most 65535 blocks
    if channels_first:
        grid = grid[::-1]
    _compress_pool_fwd_kernel[grid](kv, gate, position_bias, first_row, entry_index, is_real, out, lse, pooled,
                                    capacity, SAVE_STATS=stats, CHANNELS_FIRST=channels_first,
                                    **meta, **launch)
    return out, lse, pooled


def _compress_pool_bwd(grad_out, kv, gate, position_bias, first_row, entry_index, is_real, lse, pooled,
                       ratio: int, config=None):
    """Returns dkv (T, width) kv.dtype, dgate (T, width) gate.dtype, d_bias (ratio, width) fp32."""
    config = config or _configs(ratio)
    T, width = kv.shape
    capacity = first_row.shape[0]
    d = width // 2 if ratio == 4 else width
    dkv, dgate = torch.empty_like(kv), torch.empty_like(gate)
    if capacity == 0 or T == 0:
        return dkv.zero_(), dgate.zero_(), torch.zeros(ratio, width, dtype=torch.float32, device=kv.device)
    bwd = dict(config["bwd"])
    meta, launch = _tile_meta(bwd, ratio, d, kv.dtype)
    has_stats = lse.shape[0] == capacity                 # the forward saved them (``saves_stats``)
    if not has_stats and meta["CHUNK"] < meta["SLOTS"]:
        raise ValueError(f"ratio {ratio} backward with CHUNK {meta['CHUNK']} < {meta['SLOTS']} slots needs the "
                         f"forward's saved statistics")
    # Entry groups: a fixed function of the shapes (and the config), so d_bias sums in the same order every run.
    blocks = triton.cdiv(capacity, meta["BLOCK_E"])
    per_group = triton.cdiv(blocks, min(blocks, bwd["MAX_GROUPS"])) * meta["BLOCK_E"]
    groups = triton.cdiv(capacity, per_group)
    d_bias_partial = torch.empty(groups, ratio, width, dtype=torch.float32, device=kv.device)
    marks = torch.zeros(2 if ratio == 4 else 1, T, dtype=torch.int8, device=kv.device)
    grid = (groups, meta["SLOTS"] // meta["CHUNK"], d // meta["BLOCK_D"])
    _compress_pool_bwd_kernel[grid](kv, gate, position_bias, first_row, entry_index, is_real, grad_out, lse, pooled,
                                    dkv, dgate, d_bias_partial, marks, capacity, per_group, T,
                                    HAS_STATS=has_stats, **meta, **launch)
    zero = dict(ZERO_CONFIG)
    zero_launch = dict(num_warps=zero.pop("num_warps"))
    zero_grid = (triton.cdiv(T, zero["BLOCK_T"]), triton.cdiv(width, zero["BLOCK_W"]))
    _zero_uncovered_kernel[zero_grid](dkv, dgate, marks, T, W=width, D=d, OVERLAP=ratio == 4, **zero,
                                      **zero_launch)
    return dkv, dgate, d_bias_partial.sum(0)


def _layout_args(layout: CompressedLayout):
    return layout.entry_first_row.contiguous(), layout.entry_index.contiguous(), layout.entry_is_real.contiguous()


@torch.library.custom_op("dsv4attn::compress_pool", mutates_args=())
def compress_pool_op(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, entry_first_row: torch.Tensor,
                     entry_index: torch.Tensor, entry_is_real: torch.Tensor,
                     ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton forward of :func:`dsv4attn.ops.compress_pool`, arguments checked and contiguous.

    Returns out (capacity, d) ``kv.dtype`` and the backward's statistics (lse in log2 units and the fp32 pooled
    value, (capacity, d) each when :func:`saves_stats`, else (0, d)).
    """
    with backend.exact_math(kv.device):
        return _compress_pool_fwd(kv, gate, position_bias, entry_first_row, entry_index, entry_is_real, ratio)


@compress_pool_op.register_fake
def _compress_pool_fake(kv, gate, position_bias, entry_first_row, entry_index, entry_is_real, ratio):
    capacity = entry_first_row.shape[0]
    d = kv.shape[1] // 2 if ratio == 4 else kv.shape[1]
    stats = capacity if saves_stats(ratio) else 0
    return (kv.new_empty(capacity, d), kv.new_empty(stats, d, dtype=torch.float32),
            kv.new_empty(stats, d, dtype=torch.float32))


@torch.library.custom_op("dsv4attn::compress_pool_backward", mutates_args=())
def compress_pool_backward_op(grad_out: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                              position_bias: torch.Tensor, entry_first_row: torch.Tensor, entry_index: torch.Tensor,
                              entry_is_real: torch.Tensor, lse: torch.Tensor, pooled: torch.Tensor,
                              ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dkv ``kv.dtype``, dgate ``gate.dtype``, d_position_bias fp32; every row outside a complete group gets 0."""
    with backend.exact_math(kv.device):
        return _compress_pool_bwd(grad_out, kv, gate, position_bias, entry_first_row, entry_index, entry_is_real,
                                  lse, pooled, ratio)


@compress_pool_backward_op.register_fake
def _compress_pool_backward_fake(grad_out, kv, gate, position_bias, entry_first_row, entry_index, entry_is_real,
                                 lse, pooled, ratio):
    return kv.new_empty(kv.shape), gate.new_empty(gate.shape), position_bias.new_empty(position_bias.shape)


def _setup_context(ctx, inputs, output):
    kv, gate, position_bias, first_row, entry_index, is_real, ratio = inputs
    _, lse, pooled = output
    ctx.save_for_backward(kv, gate, position_bias, first_row, entry_index, is_real, lse, pooled)
    ctx.ratio = ratio
    ctx.mark_non_differentiable(lse, pooled)


def _backward(ctx, grad_out, _grad_lse, _grad_pooled):
    kv, gate, position_bias, first_row, entry_index, is_real, lse, pooled = ctx.saved_tensors
    capacity = first_row.shape[0]
    d = kv.shape[1] // 2 if ctx.ratio == 4 else kv.shape[1]
    grad_out = kv.new_zeros(capacity, d) if grad_out is None else grad_out.to(kv.dtype).contiguous()
    dkv, dgate, d_bias = compress_pool_backward_op(grad_out, kv, gate, position_bias, first_row, entry_index,
                                                   is_real, lse, pooled, ctx.ratio)
    return dkv, dgate, d_bias, None, None, None, None


compress_pool_op.register_autograd(_backward, setup_context=_setup_context)


def compress_pool_triton(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                         layout: CompressedLayout) -> torch.Tensor:
    """Triton implementation behind :func:`dsv4attn.ops.compress_pool` (arguments already checked).

    Args:
        kv: (T, c*d) compressor value projection, fp16/bf16/fp32 (c = 2 for ratio 4, else 1), d a multiple of 16.
        gate: (T, c*d) gate projection, same dtype.
        position_bias: (ratio, c*d) fp32.
        layout: the batch's :class:`CompressedLayout` of this ratio (entries in any order; padding anywhere).
    Returns:
        (layout.capacity, d) in ``kv.dtype``, padding entries 0; differentiable in kv, gate and position_bias.

    float64 inputs (or an fp64 bias), widths the tiles do not take and ratios whose slot count is not a power of
    two **fall back to the reference**, so float64 checks keep working on any backend.
    """
    if not kernel_supports(kv, position_bias, layout.ratio):
        return compress_pool_reference(kv, gate, position_bias, layout)
    out, _, _ = compress_pool_op(kv.contiguous(), gate.contiguous(), position_bias.contiguous(),
                                 *_layout_args(layout), layout.ratio)
    return out


variants.register("compress_pool", "forward", variants.Variant(
    "triton", "compress-pool forward kernel (_compress_pool_fwd_kernel)", variants.always, variants.always))
variants.register("compress_pool", "backward", variants.Variant(
    "triton", "compress-pool backward kernel (_compress_pool_bwd_kernel)", variants.always, variants.always))
backend.register_kernel("compress_pool", compress_pool_triton)

__all__ = ["compress_pool_triton", "compress_pool_op", "compress_pool_backward_op", "kernel_supports",
           "saves_stats"]
