"""Triton indexer top-k vs the reference: on CPU through TRITON_INTERPRET=1, and at Flash sizes on CUDA.

As in test_sparse_attention_triton.py, the interpreter must be on before Triton is first imported, so every
interpreted kernel run happens in one subprocess (``_worker``) that prints its measurements as JSON; the
parametrised tests only judge them.

What must hold (docs/semantics.md, decision 6):
- fp32 inputs (and exactly representable ones in any dtype: integer q and k, power-of-two weights): the indices
  equal the reference's exactly, ties to the lower index included. The kernel sums heads in another order than
  the reference, so random fp32 scores agree to ~1e-7 relative, not bit for bit; at these sizes no two candidates
  of a row are that close, at Flash sizes some are (the GPU test compares scores there).
- bf16 / fp16 inputs: both sides compute fp32 scores of the same rounded inputs and may order near-ties
  differently, so the *scores* of the chosen sets (float64, from the rounded inputs) are compared instead: same
  -1 pattern, and the i-th best chosen scores agree within SCORE_RTOL of the row's largest |score|.
- The select kernel alone, on hand-made int32 score orders (fresh random each run, the seed is reported): equal to
  a stable descending sort for distinct values, heavy ties at the extremes and at order(-inf), and rows that defeat
  its tile-maxima bound (its exact search). The interpreter orders by pairwise ranks (``BY_RANK``, as the op does
  there); five cases also run the GPU's path (the kernel's bitonic sort), and a CUDA test runs it at Flash
  widths, with four warps a program and with one.
- The kernel path is the registered op ``dsv4attn::indexer_topk_ranges``: ``torch.library.opcheck`` passes and
  ``torch.compile(fullgraph=True)`` of :func:`indexer_topk_triton` returns the eager indices (both run the op, so
  they run in the interpreter worker too).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from dsv4attn import variants
from dsv4attn.ops.index_sets import contiguous_ranges

from tests.ops.interpreter import run_worker
from tests.ops.kernel_checks import OpLog
from tests.packs import build_pack, random_lengths

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMALL = dict(BLOCK_T=16, BLOCK_E=16, num_warps=4, num_stages=1, SELECT_TILE=16, SELECT_BLOCK=512,
             SELECT_WARPS=4)                   # many row / entry blocks per pack, several tiles per row
# Default score tiles, small select tiles: rows of up to 35 candidates span up to 3 tiles of 16 (2 KP = 16 for k <= 8).
TILES16 = dict(SELECT_TILE=16, SELECT_BLOCK=512)
SCORE_RTOL = 1e-5        # fp32 summation-order noise over <= 8 heads x 64 dims is ~1e-7 of the row maximum


def _case(dtype, H, Di, topk, *, compare="exact", values="randn", config=None, budget=None, view="layout",
          k_dtype=None, max_len=40, padding=5):
    return dict(dtype=dtype, H=H, Di=Di, topk=topk, compare=compare, values=values, config=config, budget=budget,
                view=view, k_dtype=k_dtype, max_len=max_len, padding=padding)


CASES = {
    "fp32-H1-D16-top1-small": _case("fp32", 1, 16, 1, config=SMALL),
    "fp32-H3-D32-top5": _case("fp32", 3, 32, 5),
    "fp32-H8-D64-top64-over-width": _case("fp32", 8, 64, 64),
    # 7 rows per chunk: 17 int32 orders + 2 KP = 16 int64 scratch keys (32 int32 words) per row.
    "fp32-H2-D16-top7-small-chunks": _case("fp32", 2, 16, 7, config=SMALL, budget=7 * (17 + 32)),
    "fp32-H5-D32-top4-rows-table": _case("fp32", 5, 32, 4, view="rows-table"),
    "fp32-H4-D32-top6-offset-small": _case("fp32", 4, 32, 6, view="offset", config=SMALL),
    "fp32-H3-D24-top5-odd-dim": _case("fp32", 3, 24, 5),
    "fp32-H2-D16-top3-no-padding": _case("fp32", 2, 16, 3, padding=0),
    "bf16-H8-D64-top9": _case("bf16", 8, 64, 9, compare="scores"),
    "bf16-H3-D16-top100-small": _case("bf16", 3, 16, 100, compare="scores", config=SMALL),
    "bf16-H4-D32-top6-rows-table": _case("bf16", 4, 32, 6, compare="scores", view="rows-table"),
    "fp16-H4-D32-top5": _case("fp16", 4, 32, 5, compare="scores"),
    "bf16-q-fp32-k-H3-D32-top5": _case("bf16", 3, 32, 5, compare="scores", k_dtype="fp32"),
    "ties-zero-fp32-top5": _case("fp32", 2, 16, 5, values="zero"),
    "ties-int-fp32-top4-small": _case("fp32", 3, 16, 4, values="int", config=SMALL),
    "ties-int-bf16-top6": _case("bf16", 4, 32, 6, values="int"),
    # The select kernel over several tiles per row: distinct scores (the tile-maxima bound), ties straddling the
    # threshold (the exact search and the tie ranks across tiles), a power-of-two k, and all scores equal.
    "fp32-H3-D32-top9-tiles": _case("fp32", 3, 32, 9, config=TILES16, max_len=110),
    "ties-int-fp32-top7-tiles": _case("fp32", 2, 16, 7, values="int", config=TILES16, max_len=110),
    "ties-int-fp32-top16-tiles": _case("fp32", 3, 16, 16, values="int", config=TILES16, max_len=110),
    "ties-const-fp32-top6-tiles": _case("fp32", 2, 16, 6, values="const", config=TILES16, max_len=110),
    "no-entries-width2": _case("fp32", 2, 16, 4, max_len=8, padding=0, view="no-entries"),
    "fp32-H3-D32-top5-stack": _case("fp32", 3, 32, 5, view="stack", config=SMALL),
}


def _make(c, seed):
    """(q, k, w, candidates, layout) of one case, fresh random values from ``seed``."""
    from dsv4attn.ops.index_sets import Rows, Stack, VisibleCompressed
    import dsv4attn

    gen = torch.Generator().manual_seed(seed)
    if c["view"] == "no-entries":            # max_seqlen 8 but one 3-row document: capacity 0, width 2
        pack = dsv4attn.pack_batch(torch.tensor([0, 3], dtype=torch.int32), 3, 8)
    else:
        # Always a length-1, empty, < ratio, == ratio and ratio + 1 document, plus random ones and a long one.
        lengths = random_lengths(gen, 4, c["max_len"], must=(1, 0, 3, 4, 5, c["max_len"] + 30))
        pack = build_pack(lengths, c["padding"])
    lay = pack.compressed(4)
    T, H, Di = pack.total_rows, c["H"], c["Di"]
    dt = DTYPES[c["dtype"]]
    k_dt = DTYPES[c["k_dtype"]] if c["k_dtype"] else dt
    n_keys = lay.capacity
    candidates = VisibleCompressed(lay, T)
    if c["view"] == "offset":
        candidates, n_keys = VisibleCompressed(lay, T, offset=11), lay.capacity + 11
    elif c["view"] == "rows-table":
        # A context-parallel style view: rows 6.. of the batch, entries mapped through an increasing table with
        # gaps (gathered rows of several ranks), then shifted past 7 raw key rows.
        gaps = torch.randint(1, 4, (lay.capacity,), generator=gen)
        table = gaps.cumsum(0) - 1
        T = T - 6
        candidates = Rows(VisibleCompressed(lay, pack.total_rows), 6, T, shift=7, table=table)
        n_keys = int(table[-1]) + 8
    elif c["view"] == "stack":
        # A head-tail context-parallel rank: two separate row ranges of the batch, stacked, through one table.
        table = torch.randint(1, 4, (lay.capacity,), generator=gen).cumsum(0) - 1
        a, b = T // 3, T // 2
        base = VisibleCompressed(lay, pack.total_rows)
        candidates = Stack(Rows(base, 0, a, table=table), Rows(base, b, T - b, table=table))
        T, n_keys = a + T - b, int(table[-1]) + 1
    if c["values"] == "randn":
        q = torch.randn(T, H, Di, generator=gen, dtype=torch.float64).to(dt)
        k = torch.randn(n_keys, Di, generator=gen, dtype=torch.float64).to(k_dt)
        w = torch.randn(T, H, generator=gen, dtype=torch.float64).float()
    elif c["values"] == "const":             # every score the same positive number
        q, k, w = torch.ones(T, H, Di, dtype=dt), torch.ones(n_keys, Di, dtype=k_dt), torch.full((T, H), 0.125)
    elif c["values"] == "zero":              # every dot product negative: all scores exactly 0
        q = torch.ones(T, H, Di, dtype=dt)
        k = (-torch.rand(n_keys, Di, generator=gen) - 0.1).to(k_dt)
        w = torch.randn(T, H, generator=gen)        # signed: ReLU(.) * w gives +0.0 and -0.0, which tie
    else:                                    # exact scores with many equal values: keys repeat with period 3
        patterns = torch.randint(-2, 3, (3, Di), generator=gen).float()
        k = patterns[torch.arange(n_keys) % 3].to(k_dt)
        q = torch.randint(-2, 3, (T, H, Di), generator=gen).to(dt)
        sign = torch.randint(0, 2, (T, H), generator=gen).float() * 2 - 1
        w = sign * 2.0 ** torch.randint(-2, 2, (T, H), generator=gen).float()
    return q, k, w, candidates, lay


def _chosen_scores(q, k, w, chosen):
    """(T, K) float64 scores of the chosen rows of ``k`` (from the inputs as given), NaN at -1 slots."""
    parts = []
    for s in range(0, chosen.shape[0], 512):                                # bounded memory at Flash sizes
        rows = k.double()[chosen[s:s + 512].long().clamp(min=0)]               # (c, K, Di)
        dots = torch.einsum("thd,tkd->thk", q[s:s + 512].double(), rows)
        parts.append((torch.relu(dots) * w[s:s + 512].double()[..., None]).sum(1))
    scores = torch.cat(parts) if parts else torch.zeros(chosen.shape, dtype=torch.float64, device=chosen.device)
    return scores.masked_fill(chosen < 0, float("nan"))


def _returned_score_err(q, k, w, chosen, scores) -> float:
    """Largest difference between the scores returned with ``chosen`` and the float64 scores of those rows, relative
    to the slot's sum of |w_h q_hd k_d| (what bounds an fp32 sum's rounding; a row's largest score would not: a
    top-1 row with negative weights keeps its score nearest 0). -inf must mark exactly the -1 slots (inf if not)."""
    if scores.shape != chosen.shape or not torch.equal(scores == float("-inf"), chosen < 0):
        return float("inf")
    valid = chosen >= 0
    if not valid.any():
        return 0.0
    exact = _chosen_scores(q, k, w, chosen)
    rows = k.double()[chosen.long().clamp(min=0)]                                  # (T, K, Di)
    terms = torch.einsum("thd,tkd->thk", q.double().abs(), rows.abs())
    magnitude = (terms * w.double().abs()[..., None]).sum(1).clamp(min=1e-30)
    return float(((scores.double() - exact).abs() / magnitude)[valid].max())


def _judge(c, q, k, w, candidates, got, want):
    cand = candidates.materialize()
    in_set = all(set(r[r >= 0].tolist()) <= set(s[s >= 0].tolist()) for r, s in zip(got, cand))
    distinct = all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in got)
    packed_left = bool(((got >= 0).int().diff(dim=1) <= 0).all()) if got.shape[1] > 1 else True
    result = dict(shape_ok=got.shape == want.shape and got.dtype == torch.int32, in_set=in_set, distinct=distinct,
                  packed_left=packed_left, same_pattern=bool(torch.equal(got >= 0, want >= 0)),
                  mismatches=int((got != want).sum()), equal=bool(torch.equal(got, want)))
    if c["values"] != "randn" and want.shape[1] > 1:
        # Adjacent chosen slots with equal scores: the tie cases must really order ties (by the lower index).
        s_want = _chosen_scores(q, k, w, want)
        result["tied_pairs"] = int((s_want[:, 1:] == s_want[:, :-1]).sum())
    if c["compare"] == "scores" and got.numel():
        s_got, s_want = _chosen_scores(q, k, w, got), _chosen_scores(q, k, w, want)
        row_max = s_want.nan_to_num(0.0).abs().amax(1, keepdim=True).clamp(min=1e-30)
        # Sort both descending (NaN slots last) and compare the i-th best: near-ties may be swapped.
        a = s_got.nan_to_num(float("-inf")).sort(1, descending=True).values
        b = s_want.nan_to_num(float("-inf")).sort(1, descending=True).values
        both = torch.isfinite(a) & torch.isfinite(b)
        result["score_rel_err"] = float(((a - b).abs() / row_max)[both].max()) if both.any() else 0.0
        # The kernel's own order must be best first, up to the same noise.
        step = (s_got[:, 1:] - s_got[:, :-1]) / row_max
        result["order_rel_err"] = float(step.nan_to_num(0.0).clamp(min=0).max()) if step.numel() else 0.0
    return result


# ------------------------------------------------------------------------------ the select kernel on its own
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
NEG_INF_ORDER = -2139095041                    # order(-inf): an empty slot, -1 in the output
# (kind, rows, width, k, table): rows of hand-made int32 orders through the select kernel with TILES16-like tiles.
SELECT_CASES = {
    "distinct-top7": ("distinct", 40, 100, 7, False),
    "ties-top7": ("ties", 40, 100, 7, False),
    "far-top7-table": ("far", 24, 100, 7, True),
    "periodic-top5": ("periodic", 24, 64, 5, False),
    "ties-top1": ("ties", 24, 50, 1, False),
    "ties-top16": ("ties", 24, 70, 16, True),
    "distinct-top-width": ("distinct", 16, 20, 20, False),
    # Every row at most 2 KP = 64 orders: the kernel takes them all without a threshold (ties, a table).
    "ties-short-rows-table": ("ties", 24, 40, 30, True),
    # k = 1 (KP = 2) on rows of at most 2 orders: both short-row paths at the smallest width.
    "distinct-top1-short": ("distinct", 24, 2, 1, False),
}
SELECT_TILES = dict(SELECT_TILE=16, SELECT_BLOCK=256, SELECT_WARPS=4)


def _select_inputs(kind: str, rows: int, width: int, topk: int, gen: torch.Generator, device="cpu"):
    """(orders, visible, first) of one select case: (rows, width) int32 orders, (rows,) int64 lengths and offsets.

    distinct: the whole int32 range. ties: a few values, the extremes and order(-inf) among them, so ties straddle
    every threshold. far: a few int32-max over equal small values (the tile-maxima bound is far too low: the exact
    search takes its longest). periodic: one random tile of 16 repeated (every tile maximum ties). Lengths: 0, k - 1,
    k, k + 1, the width, then random.
    """
    shape = (rows, width)
    if kind == "distinct":
        orders = torch.randint(INT32_MIN, INT32_MAX + 1, shape, generator=gen, dtype=torch.int64)
    elif kind == "ties":
        values = torch.tensor([INT32_MIN, NEG_INF_ORDER, -5, -1, 0, 1, 7, INT32_MAX])
        orders = values[torch.randint(0, len(values), shape, generator=gen)]
    elif kind == "far":
        orders = torch.full(shape, -3, dtype=torch.int64)
        orders[torch.rand(shape, generator=gen) < 0.03] = INT32_MAX
    else:
        orders = torch.randint(-4, 4, (rows, 16), generator=gen).repeat(1, width // 16 + 1)[:, :width]
    lengths = [0, topk - 1, topk, topk + 1, width]
    visible = torch.tensor(lengths + torch.randint(0, width + 1, (rows - len(lengths),), generator=gen).tolist())
    first = torch.randint(0, 50, (rows,), generator=gen)
    return orders.to(torch.int32).to(device), visible.clamp(0, width).to(device), first.to(device)


def _decoded(orders: torch.Tensor) -> torch.Tensor:
    """The fp32 scores whose int32 orders these are (the score kernels' map inverted), as their int32 bits."""
    o = orders.long()
    return torch.where(o >= 0, o, o ^ 0x7FFFFFFF).to(torch.int32)


def _select_reference(orders, visible, first, table, shift: int, topk: int):
    """Plain PyTorch: each row's visible orders by a stable descending sort (ties to the lower j), mapped; and the
    chosen slots' scores decoded from their orders (-inf where empty), as int32 bits."""
    j = torch.arange(orders.shape[1], device=orders.device)
    live = j[None, :] < visible[:, None]
    ranked = torch.sort(orders.long().masked_fill(~live, INT32_MIN - 1), dim=1, descending=True, stable=True)
    best = ranked.indices[:, :topk]
    found = live.gather(1, best) & (orders.long().gather(1, best) != NEG_INF_ORDER)
    entry = first[:, None] + best
    if table is not None:
        entry = table[entry.masked_fill(~found, 0)]
    neg_inf = torch.tensor(float("-inf")).view(torch.int32)
    bits = torch.where(found, _decoded(orders.gather(1, best)), neg_inf.to(orders.device))
    return torch.where(found, entry + shift, -1).to(torch.int32), bits


def _run_select(case, gen, config, by_rank=None, device="cpu"):
    """(got, want) of one select case through ``_select`` and the reference."""
    from dsv4attn.ops.indexer import triton as ix_triton
    kind, rows, width, topk, with_table = case
    orders, visible, first = _select_inputs(kind, rows, width, topk, gen, device)
    table = None
    if with_table:              # increasing with gaps, as for a context-parallel view, then a shift of 3
        table = torch.randint(1, 4, (width + 50,), generator=gen).cumsum(0).to(device)
    shift = 3 if with_table else 0
    got = torch.full((rows, topk), -7, dtype=torch.int32, device=device)       # every slot must be written
    scores = torch.full((rows, topk), 7.0, dtype=torch.float32, device=device)
    ix_triton._select(orders, first, visible, table, shift, got, scores, config, by_rank=by_rank)
    want, want_bits = _select_reference(orders, visible, first, table, shift, topk)
    # The scores as int32 bits: NaN scores (order INT32_MAX) compare equal that way, -0.0 and 0.0 do not.
    return torch.cat([got, scores.view(torch.int32)], 1), torch.cat([want, want_bits], 1)


def _select_checks() -> dict:
    """Every SELECT_CASES case on fresh random inputs (the seed is reported), by pairwise ranks (the interpreter's
    default) and five through the bitonic sort (the GPU's path, slow under the interpreter)."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    runs = {name: _run_select(case, gen, SELECT_TILES) for name, case in SELECT_CASES.items()}
    for name in ("ties-top7", "far-top7-table", "ties-short-rows-table", "distinct-top1-short"):
        kind, rows, width, topk, table = SELECT_CASES[name]
        runs[name + "-network"] = _run_select((kind, 16, width, topk, table), gen, SELECT_TILES, by_rank=False)
    # Every row at most KP = 8 orders: no counting step before the sort of KP keys.
    runs["distinct-at-most-kp-network"] = _run_select(("distinct", 16, 8, 7, False), gen, SELECT_TILES, by_rank=False)
    return {name: dict(seed=seed, equal=bool(torch.equal(got, want)), rows_differ=int((got != want).any(1).sum()))
            for name, (got, want) in runs.items()}


def _worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set): every case, printed as one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dsv4attn import backend
    from dsv4attn.ops import Explicit, indexer_topk
    from dsv4attn.ops.indexer import triton as ix_triton
    from dsv4attn.ops.indexer.reference import indexer_topk_reference

    results = {}
    for seed, (case_id, c) in enumerate(CASES.items()):
        q, k, w, candidates, _ = _make(c, 1000 + seed)
        got, got_scores = ix_triton.indexer_topk_triton(q, k, w, candidates, c["topk"], config=c["config"],
                                                        budget=c["budget"], return_scores=True)
        want, want_scores = indexer_topk_reference(q, k, w, candidates, c["topk"], return_scores=True)
        results[case_id] = _judge(c, q, k, w, candidates, got, want)
        results[case_id]["returned_scores"] = dict(kernel=_returned_score_err(q, k, w, got, got_scores),
                                                   reference=_returned_score_err(q, k, w, want, want_scores))

    # Plumbing: registration, dispatch through the public op, determinism, and the documented fallbacks.
    c = CASES["fp32-H3-D32-top5"]
    q, k, w, candidates, lay = _make(c, 7)
    direct = ix_triton.indexer_topk_triton(q, k, w, candidates, 5)
    backend.set_backend("triton")
    try:
        public = indexer_topk(q, k, w, lay, 5)
    finally:
        backend.set_backend(None)
    q64, k64, w64 = q.double(), k.double(), w.double()
    explicit = Explicit(candidates.materialize())
    results["plumbing"] = dict(
        registered=backend.kernel("indexer_topk") is ix_triton.indexer_topk_triton,
        public_matches_direct=torch.equal(public, direct),
        deterministic=torch.equal(direct, ix_triton.indexer_topk_triton(q, k, w, candidates, 5)),
        fp64_fallback_is_reference=torch.equal(ix_triton.indexer_topk_triton(q64, k64, w64, candidates, 5),
                                               indexer_topk_reference(q64, k64, w64, candidates, 5)),
        explicit_set_falls_back=torch.equal(ix_triton.indexer_topk_triton(q, k, w, explicit, 5),
                                            indexer_topk_reference(q, k, w, explicit, 5)),
    )

    # The registered op: the kernel path goes through it, torch.library's own checks (schema, fake kernel,
    # autograd registration, AOT dispatch with dynamic shapes) pass, with and without an entry table, over several
    # query chunks and small tiles, and torch.compile(fullgraph=True) of the whole Triton path (IndexSet handling
    # included) gives the eager indices.
    plumbing = results["plumbing"]
    with OpLog() as log:
        ix_triton.indexer_topk_triton(q, k, w, candidates, 5)
    plumbing["runs_registered_op"] = "dsv4attn.indexer_topk_ranges.default" in log.names
    tiles = ix_triton._tile_list(dict(ix_triton.CONFIG, **SMALL))
    c = CASES["fp32-H5-D32-top4-rows-table"]
    qt, kt, wt, cand_t, _ = _make(c, 8)
    opchecks = [torch.library.opcheck(ix_triton.indexer_topk_ranges_op,
                                      (q, k, w, *contiguous_ranges(candidates), candidates.width, 5, tiles,
                                       7 * (candidates.width + 32))),      # 7 rows per chunk (KP = 8)
                torch.library.opcheck(ix_triton.indexer_topk_ranges_op,
                                      (qt, kt, wt, *contiguous_ranges(cand_t), cand_t.width, 4, tiles,
                                       1 << 20))]
    plumbing["opcheck"] = all(v == "SUCCESS" for check in opchecks for v in check.values())
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c_: ix_triton.indexer_topk_triton(a, b, c_, candidates, 5), fullgraph=True)
    plumbing["compile_fullgraph_matches_eager"] = torch.equal(compiled(q, k, w), direct)
    results["select"] = _select_checks()
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    return run_worker("tests.ops.test_indexer_triton")


@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_reference(interpreted, case_id):
    m = interpreted[case_id]
    assert m["shape_ok"], f"{case_id}: shape or dtype differs from the reference"
    assert m["in_set"] and m["distinct"], f"{case_id}: selected a row outside the candidates, or twice"
    assert m["packed_left"] and m["same_pattern"], f"{case_id}: -1 slots differ from the reference"
    if CASES[case_id]["values"] != "randn":
        assert m["tied_pairs"] > 0, f"{case_id}: no tied scores among the chosen entries, the case tests nothing"
    if CASES[case_id]["compare"] == "exact":
        assert m["equal"], f"{case_id}: {m['mismatches']} indices differ from the reference"
    else:
        assert m["score_rel_err"] <= SCORE_RTOL, f"{case_id}: chosen scores differ by {m['score_rel_err']:.2e}"
        assert m["order_rel_err"] <= SCORE_RTOL, f"{case_id}: not best first ({m['order_rel_err']:.2e})"


@pytest.mark.parametrize("case_id", list(CASES))
def test_returned_scores_are_the_chosen_rows_scores(interpreted, case_id):
    """``return_scores``: the kernel's and the reference's scores of their chosen rows, against float64 scores of
    those rows (fp32 summation noise; the reference's from its own fp32 sums)."""
    m = interpreted[case_id]["returned_scores"]
    assert m["kernel"] <= SCORE_RTOL and m["reference"] <= SCORE_RTOL, m


@pytest.mark.parametrize("check", ["registered", "public_matches_direct", "deterministic",
                                   "fp64_fallback_is_reference", "explicit_set_falls_back", "runs_registered_op",
                                   "opcheck", "compile_fullgraph_matches_eager"])
def test_plumbing(interpreted, check):
    assert interpreted["plumbing"][check]


@pytest.mark.parametrize("case_id", [*SELECT_CASES, "ties-top7-network", "far-top7-table-network",
                                     "ties-short-rows-table-network", "distinct-top1-short-network",
                                     "distinct-at-most-kp-network"])
def test_select_kernel_matches_stable_sort(interpreted, case_id):
    m = interpreted["select"][case_id]
    assert m["equal"], f"{case_id}: {m['rows_differ']} rows differ from a stable sort (seed {m['seed']})"


# ----------------------------------------------------------------------------------------------- CUDA, Flash sizes
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _sm90_gluon() -> bool:
    """An SM90 GPU with a Triton whose Gluon imports: where the Gluon score kernel can run at all (q and k of the
    Flash geometry, bf16, freshly allocated and so 16-byte aligned)."""
    from dsv4attn.ops.gluon_common import IMPORTED
    return (IMPORTED and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9)


needs_sm90_gluon = pytest.mark.skipif(not _sm90_gluon(), reason="needs an SM90 GPU and Triton's Gluon")
FLASH_LENGTHS = (3001, 1, 0, 2047, 5, 1536, 1000)       # 7590 real rows, then capacity padding to 8192
FLASH_T, FLASH_HI, FLASH_DI, FLASH_TOPK = 8192, 64, 128, 512
# fp32 accumulation over 64 heads x 128 dims in another order: a few 1e-6 of the row maximum, with margin.
FLASH_SCORE_RTOL = 1e-4


def _flash_inputs(dtype, values="randn", seed=0):
    from dsv4attn.ops.index_sets import VisibleCompressed
    pack = build_pack(FLASH_LENGTHS, FLASH_T - sum(FLASH_LENGTHS))
    pack = _to_cuda(pack)
    lay = pack.compressed(4)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, H, Di = FLASH_T, FLASH_HI, FLASH_DI
    if values == "randn":
        q = torch.randn(T, H, Di, device="cuda", generator=gen).to(dtype)
        k = torch.randn(lay.capacity, Di, device="cuda", generator=gen).to(dtype)
        w = torch.randn(T, H, device="cuda", generator=gen) * (H * Di) ** -0.5
    else:   # integer q, k and power-of-two weights: every score exact in fp32 in any summation order
        q = torch.randint(-2, 3, (T, H, Di), device="cuda", generator=gen).to(dtype)
        patterns = torch.randint(-2, 3, (5, Di), device="cuda", generator=gen)
        k = patterns[torch.arange(lay.capacity, device="cuda") % 5].to(dtype)
        w = 2.0 ** torch.randint(-3, 1, (T, H), device="cuda", generator=gen).float()
    return q, k, w, VisibleCompressed(lay, T), lay


def _to_cuda(pack):
    import dsv4attn
    return dsv4attn.pack_batch(pack.cu_seqlens.cuda(), pack.total_rows, pack.max_seqlen)


@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_flash_sizes_scores_match_reference(dtype):
    from dsv4attn.ops.indexer.reference import indexer_topk_reference
    from dsv4attn.ops.indexer.triton import indexer_topk_triton
    q, k, w, candidates, _ = _flash_inputs(DTYPES[dtype])
    got = indexer_topk_triton(q, k, w, candidates, FLASH_TOPK)
    want = indexer_topk_reference(q, k, w, candidates, FLASH_TOPK)
    assert got.shape == want.shape == (FLASH_T, FLASH_TOPK) and got.dtype == torch.int32
    assert torch.equal(got >= 0, want >= 0), "-1 slots differ from the reference"
    s_got, s_want = (_chosen_scores(q, k, w, x).nan_to_num(float("-inf")) for x in (got, want))
    row_max = s_want[torch.isfinite(s_want)].abs().max()
    a, b = s_got.sort(1, descending=True).values, s_want.sort(1, descending=True).values
    both = torch.isfinite(a) & torch.isfinite(b)
    err = ((a - b).abs()[both].max() / row_max).item()
    assert err <= FLASH_SCORE_RTOL, f"chosen scores differ by {err:.2e} of the largest score"
    # Within each row the chosen set equals the reference's except at near-ties; report how often that is.
    differs = (got.sort(1).values != want.sort(1).values).any(1).float().mean().item()
    assert differs <= 0.05, f"{differs:.1%} of rows chose a different set"


@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_flash_sizes_exact_scores_equal_indices(dtype):
    """Exactly representable inputs: every score is exact, so the indices (ties included) must be identical."""
    from dsv4attn.ops.indexer.reference import indexer_topk_reference
    from dsv4attn.ops.indexer.triton import indexer_topk_triton
    q, k, w, candidates, _ = _flash_inputs(DTYPES[dtype], values="int", seed=1)
    got = indexer_topk_triton(q, k, w, candidates, FLASH_TOPK)
    want = indexer_topk_reference(q, k, w, candidates, FLASH_TOPK)
    assert torch.equal(got, want), f"{int((got != want).any(1).sum())} rows differ"


@needs_cuda
def test_cuda_public_op_uses_triton_and_is_deterministic():
    from dsv4attn import backend
    from dsv4attn.ops import indexer_topk
    from dsv4attn.ops.indexer.triton import indexer_topk_triton
    q, k, w, candidates, lay = _flash_inputs(torch.bfloat16, seed=2)
    assert backend.choose("indexer_topk", q.device) == "triton"
    first = indexer_topk(q, k, w, lay, FLASH_TOPK)
    assert torch.equal(first, indexer_topk_triton(q, k, w, candidates, FLASH_TOPK))
    assert torch.equal(first, indexer_topk(q, k, w, lay, FLASH_TOPK))


@needs_cuda
def test_cuda_compile_fullgraph_and_cuda_graph_match_eager():
    """The registered op on the GPU: one opaque node under torch.compile, and capturable (no host sync)."""
    from dsv4attn.ops.indexer.triton import indexer_topk_triton
    q, k, w, candidates, _ = _flash_inputs(torch.bfloat16, seed=3)
    eager = indexer_topk_triton(q, k, w, candidates, FLASH_TOPK)          # also compiles the kernel
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: indexer_topk_triton(a, b, c, candidates, FLASH_TOPK), fullgraph=True)
    assert torch.equal(compiled(q, k, w), eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = indexer_topk_triton(q, k, w, candidates, FLASH_TOPK)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@needs_cuda
@pytest.mark.parametrize("kind", ["distinct", "ties", "far", "periodic"])
@pytest.mark.parametrize("topk", [FLASH_TOPK, 1024], ids=["flash-k512", "pro-k1024"])
@pytest.mark.parametrize("width", [8192, 2048], ids=["w8192", "w2048"])
def test_cuda_select_kernel_flash_sizes(kind, topk, width):
    """The select kernel alone at Flash widths (k = 512 of 8192 columns, a 32K document; of 2048, an 8K one, where
    a program is one warp; the Pro preset's k = 1024, four warps at both), default tiles, against a stable sort."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    from dsv4attn.ops.indexer import triton as ix_triton
    got, want = _run_select((kind, 2048, width, topk, kind == "far"), gen, ix_triton.CONFIG, device="cuda")
    assert torch.equal(got, want), f"{int((got != want).any(1).sum())} rows differ (seed {seed})"


@pytest.mark.parametrize("table, warps", [(False, 4), (True, 4), (True, 1)],
                         ids=["no-table", "table", "table-1-warp"])
def test_select_kernel_builds_for_sm90(table, warps):
    """The select kernel compiled for sm_90 without a GPU, at the Flash top-k's config (KP 512, TILE 1024, one row a
    program, the GPU's bitonic sort; 4 warps, and 1 as for short rows): the interpreter runs it without the
    compiler's checks (a variable given another shape in each branch of an ``if`` runs there and fails only to
    compile). One one-warp build only: each takes ~27 s on a CPU without Triton's cache (the CI's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4attn.ops.indexer import triton as ix_triton
    constexprs = dict(KP=512, TILE=1024, ROWS=1, HAS_TABLE=table, BY_RANK=False)
    signature = dict(ORDERS="*i32", FIRST="*i32", VISIBLE="*i32", TABLE="*i32", SCRATCH="*i64", OUT="*i32",
                     SCORES="*fp32", rows_c="i32", width="i32", shift="i32", K="i32",
                     **{name: "constexpr" for name in constexprs})
    # FP fusion stated (Triton's default so far): Triton 3.9 warns when it is left to its knob.
    kernel = triton.compile(ASTSource(ix_triton._topk_select_kernel, signature, constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, enable_fp_fusion=True))
    assert ".entry _topk_select_kernel" in kernel.asm["ptx"]


def test_select_warps_one_only_for_short_rows_at_flash_k():
    """One warp a select program only where every row of the launch fits SELECT_SHORT_WIDTH and KP <= 512 (one
    warp's registers hold the 2 KP keys); else SELECT_WARPS; a config without the key never takes one warp."""
    from dsv4attn.ops.indexer import triton as ix_triton
    config = ix_triton.CONFIG
    assert ix_triton._select_warps(2048, 512, config) == 1
    assert ix_triton._select_warps(1024, 8, config) == 1
    assert ix_triton._select_warps(2049, 512, config) == config["SELECT_WARPS"]
    assert ix_triton._select_warps(2048, 1024, config) == config["SELECT_WARPS"]
    assert ix_triton._select_warps(2048, 512, dict(config, SELECT_SHORT_WIDTH=0)) == config["SELECT_WARPS"]
    assert ix_triton._select_warps(16, 8, dict(SELECT_WARPS=8)) == 8


def test_select_tile_must_be_a_power_of_two():
    from dsv4attn.ops.indexer import triton as ix_triton
    orders, rows = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    config = dict(ix_triton.CONFIG, SELECT_TILE=48)
    with pytest.raises(ValueError, match="SELECT_TILE must be a power of two, got 48"):
        ix_triton._select(orders, rows, rows, None, 0, torch.empty(2, 4, dtype=torch.int32),
                          torch.empty(2, 4), config)


def test_score_kernel_choice(monkeypatch):
    """KERNEL: "auto" takes the Gluon score kernel only where it applies (and DSV4ATTN_KERNELS is not
    "triton", and it has not failed to build); "gluon" raises where it cannot run; other values are refused."""
    from dsv4attn.ops.indexer import gluon_hopper as gluon_scores
    from dsv4attn.ops.indexer import triton as ix_triton
    from dsv4attn.ops.sparse_attention import triton as sparse_triton
    q, k = torch.zeros(2, 64, 128, dtype=torch.bfloat16), torch.zeros(3, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(variants, "FAILED", {})
    monkeypatch.setattr(variants, "_mode", "auto")
    assert not ix_triton._use_gluon_scores(q, k, {"KERNEL": "auto"})              # CPU tensors: not available
    with pytest.raises(ValueError, match="KERNEL='gluon' asked for the Gluon indexer score kernel"):
        ix_triton._use_gluon_scores(q, k, {"KERNEL": "gluon"})
    monkeypatch.setattr(gluon_scores, "check", lambda q, k: (True, "stubbed"))
    assert ix_triton._use_gluon_scores(q, k, {"KERNEL": "auto"})
    assert not ix_triton._use_gluon_scores(q, k, {"KERNEL": "triton"})
    monkeypatch.setattr(variants, "_mode", "triton")
    assert not ix_triton._use_gluon_scores(q, k, {"KERNEL": "auto"})
    monkeypatch.setattr(variants, "_mode", "auto")
    monkeypatch.setitem(variants.FAILED, ("indexer_topk", "scores", (128, torch.bfloat16)), "no build")
    assert not ix_triton._use_gluon_scores(q, k, {"KERNEL": "auto"})
    with pytest.raises(ValueError, match="KERNEL must be 'auto', 'gluon' or 'triton', got 'fast'"):
        ix_triton._tile_list(dict(ix_triton.CONFIG, KERNEL="fast"))


@needs_sm90_gluon
@pytest.mark.parametrize("values", ["int", "randn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gluon_score_orders_match_triton(values, dtype, monkeypatch):
    """The Gluon score kernel's orders against the Triton kernel's on a ragged Flash-geometry pack, seen through a
    permutation table with a shift and with T not a multiple of the 64-row block: equal orders (integer inputs:
    exact scores in any summation order) or scores within FLASH_SCORE_RTOL of the row's largest (random inputs), nothing
    written past a row's candidates, and the Gluon kernel did run."""
    from dsv4attn.ops.indexer import gluon_hopper as gluon_scores
    from dsv4attn.ops.indexer import triton as ix_triton
    seed = int.from_bytes(os.urandom(2), "little")
    q, k, w, candidates, _ = _flash_inputs(dtype, values=values, seed=seed)
    assert gluon_scores.available(q, k), gluon_scores.check(q, k)[1]
    calls = []
    real = gluon_scores.launch_orders
    monkeypatch.setattr(gluon_scores, "launch_orders", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(variants, "FAILED", {})
    first, visible, _, _ = contiguous_ranges(candidates)
    rows = q.shape[0] - 5
    gen = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(k.shape[0], device="cuda", generator=gen)
    k_shifted = torch.cat([k[:3] * 0 + 1, k])                           # shift 3: rows 3.. hold the keys
    width = candidates.width
    got = {}
    for kernel in ("gluon", "triton"):
        orders = torch.full((rows, width), 7, dtype=torch.int32, device="cuda")    # 7: "not written"
        got[kernel] = ix_triton._score_orders(q[:rows], k_shifted, w[:rows].float(), first[:rows], visible[:rows],
                                              table, 3, width, dict(ix_triton.CONFIG, KERNEL=kernel),
                                              out=orders)
    assert calls == [1] and not variants.FAILED, variants.FAILED
    seen = torch.arange(width, device="cuda")[None, :] < visible[:rows, None]
    assert torch.all(got["gluon"][~seen] == 7), f"wrote columns past a row's candidates (seed {seed})"
    if values == "int":
        assert torch.equal(got["gluon"][seen], got["triton"][seen]), f"orders differ (seed {seed})"
        return

    def score(order):                       # the inverse of the order map, as fp32
        return torch.where(order >= 0, order, order ^ 0x7FFFFFFF).view(torch.float32)
    a, b = score(got["gluon"]).where(seen, 0.0), score(got["triton"]).where(seen, 0.0)
    scale = b.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert ((a - b).abs() <= FLASH_SCORE_RTOL * scale).all(), f"scores differ beyond {FLASH_SCORE_RTOL} (seed {seed})"


@needs_sm90_gluon
def test_cuda_misaligned_q_takes_the_triton_score_kernel():
    """A q whose base is not 16-byte aligned (its TMA descriptor cannot be made): "auto" runs the Triton score
    kernel, with the orders of an aligned copy; "gluon" refuses it with the availability error."""
    from dsv4attn.ops.indexer import gluon_hopper as gluon_scores
    from dsv4attn.ops.indexer import triton as ix_triton
    q, k, w, candidates, _ = _flash_inputs(torch.bfloat16, values="int", seed=5)
    assert gluon_scores.available(q, k), gluon_scores.check(q, k)[1]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    assert shifted.data_ptr() % 16 != 0 and not gluon_scores.available(shifted, k)
    first, visible, _, _ = contiguous_ranges(candidates)
    width = candidates.width
    got = {}
    for name, qq, kernel in (("aligned", q, "gluon"), ("shifted", shifted, "auto")):
        got[name] = ix_triton._score_orders(qq, k, w, first, visible, None, 0, width,
                                            dict(ix_triton.CONFIG, KERNEL=kernel),
                                            out=torch.full((q.shape[0], width), 7, dtype=torch.int32, device="cuda"))
    assert torch.equal(got["aligned"], got["shifted"])
    with pytest.raises(ValueError, match="KERNEL='gluon' asked for"):
        ix_triton._score_orders(shifted, k, w, first, visible, None, 0, width,
                                dict(ix_triton.CONFIG, KERNEL="gluon"))
