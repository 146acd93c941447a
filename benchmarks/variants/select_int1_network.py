"""Top-k select kernel (Triton): its bitonic networks written here, with the compare-exchange's predicate as int1.

Why: the select's sorts (``tl.topk`` of 1024 int32 column maxima and of 1024 int64 keys, ``tl.sort`` of 512 keys)
take half the time on Triton 3.9.0 that they take on 3.6.0 / 3.7.1 (BENCHMARKS.md, thirty-third session: 1.30 vs
2.49-2.51 ms at 32K). One cause is in the network's Python source, not the compiler: in 3.6 / 3.7 the
compare-exchange compares the int1 "partner is larger" against an int32 xor of two position bits, which lowers to a
select and a compare more per element; 3.9 casts that xor to int1 first. The select kernel built offline for
sm_90 at the Flash top-k's config (KP 512, TILE 1024, one row a program, 4 warps; PTX instruction counts and ptxas's
registers / spill bytes; built with ``ASTSource`` as
``tests/ops/test_indexer_triton.py`` builds it: ``kernel_variants.py --build-only`` covers Gluon kernels only):

| Triton | kernel | selp | setp | ld / st.shared | bar.sync | PTX lines | registers, spills |
|---|---|---|---|---|---|---|---|
| 3.6.0 | shipped | 1974 | 2021 | 383 / 350 | 101 | 16387 | 87, 0 |
| 3.6.0 | ``int1_network`` | 1274 | 1402 | 383 / 350 | 101 | 15510 | 88, 0 |
| 3.7.1 | shipped | 1974 | 2021 | 348 / 350 | 101 | 16411 | 80, 0 |
| 3.7.1 | ``int1_network`` | 1274 | 1402 | 348 / 350 | 101 | 15531 | 80, 0 |
| 3.9.0 | shipped | 1286 | 1394 | 187 / 157 | 270 | 14435 | 80, 0 |
| 3.9.0 | ``int1_network`` | 1286 | 1394 | 187 / 157 | 270 | 14259 | 80, 0 |

So the selects and compares match 3.9.0's (-35% / -31%); the shared-memory accesses (the compiler's layout
conversions) stay twice 3.9.0's: the same bytes, as 8-byte ``ld/st.shared.b64`` where 3.9.0 issues 16-byte
``.v2.b64`` (counted on the network alone), so at most part of the 2x is expected. The same network and directions as
``tl.topk`` / ``tl.sort``: outputs must be bitwise.

- ``int1_network``: ``_kth_largest``, ``_largest_first`` and ``_descending`` through the networks below.
- ``warps2``, ``int1_warps2``, ``int1_warps1``: the select with 2 or 1 warps a program (``SELECT_WARPS``; 4 shipped, 8
  swept before): a row's 1024-wide tiles then span fewer warps, so fewer of the network's exchanges cross warps
  through shared memory (none with one warp), at more registers a thread. Offline (3.6.0 / 3.7.1 / 3.9.0): 2 warps
  186 / 179 / 128 registers, no spills; 1 warp 255 registers, spills 8 / 8 / 124 bytes (the network alone: none);
  per program, PTX lines x threads (the instructions a row costs): 4 warps 15510 x 128, 2 warps 24597 x 64, 1 warp
  37620 x 32 (``int1_network`` forms, 3.6.0). Outputs must be bitwise.

Checked on the CPU under the interpreter: the variant's select (``by_rank=False``) equals the stable-sort reference
on every case of ``tests/ops/test_indexer_triton.py``'s select checks (Triton 3.9.0 and 3.7.1; 3.6.0's interpreter cannot run
the select kernel, shipped or not, see ``tests/ops/interpreter.py``), and the two networks alone equal
``torch.sort`` on int32 / int64 rows of 4 to 64 (3.9.0 and 3.6.0). GPU:
``python benchmarks/kernel_variants.py benchmarks/variants/select_int1_network.py --T 32768 8192 --H 0 4096`` on
each Triton (3.6.0 and 3.7.1, where the gain is expected; 3.9.0, where none is).
"""
import torch

MODULE = "dsv4attn.ops.indexer.triton"
KERNEL = "_topk_select_kernel"

_ANCHOR = "# The select kernel works on ROWS query rows at once"
_HELPERS = '''
@triton.constexpr_function
def _log2_exact(n):
    """log2 of a power of two, at compile time."""
    return int(n).bit_length() - 1


@triton.jit
def _axis_bit(cube, a: tl.constexpr):
    """0/1 along innermost axis ``a`` of the hypercube ``cube`` (bit ``a`` of an element's position in its row),
    shaped to broadcast against it."""
    dims: tl.constexpr = len(cube.shape)
    return tl.reshape(tl.arange(0, 2), [1] * (dims - 1 - a) + [2] + [1] * a)


@triton.jit
def _exchange(cube, descending, a: tl.constexpr):
    """One compare-exchange step of a bitonic network on the integer hypercube ``cube``: each element meets its
    partner across innermost axis ``a`` (the xor of the pair, reduced along that axis, recovers the partner from
    either side); the pair's lower position keeps the larger where ``descending`` (0/1, broadcast) is 1. The
    keep-the-larger predicate is formed as int1 before the compare: as an int32 comparison against the compare's
    result, Triton 3.6 / 3.7 lower it to a select and a compare more per element (Triton 3.9's own network has the
    cast)."""
    dims: tl.constexpr = len(cube.shape)
    partner = cube ^ tl.xor_sum(cube, dims - 1 - a, keep_dims=True)
    keep_larger = (descending ^ _axis_bit(cube, a)).to(tl.int1)
    return tl.where((partner > cube) == keep_larger, partner, cube)


@triton.jit
def _bitonic_merge(cube, width_log2: tl.constexpr, last: tl.constexpr):
    """Sort each bitonic run of 2^width_log2 innermost elements: descending if ``last``, else runs alternate in
    direction (bit width_log2 of the position picks it), so neighbouring runs form the next stage's bitonic run."""
    if last:
        descending = 1
    else:
        descending = _axis_bit(cube, width_log2)
    for i in tl.static_range(width_log2):
        cube = _exchange(cube, descending, width_log2 - 1 - i)
    return cube


@triton.jit
def _sorted_descending(x):
    """Each row of the (R, N) integer ``x`` (R, N powers of two) sorted in descending order, by a bitonic network."""
    n_log2: tl.constexpr = _log2_exact(x.shape[1])
    cube = tl.reshape(x, [2] * _log2_exact(x.numel))
    for s in tl.static_range(1, n_log2 + 1):
        cube = _bitonic_merge(cube, s, s == n_log2)
    return tl.reshape(cube, x.shape)


@triton.jit
def _largest_descending(x, k: tl.constexpr):
    """The k largest of each row of the (R, N) integer ``x`` (R, N, k powers of two, 2 <= k <= N), descending: runs
    of k sorted in alternating directions, then repeatedly the elementwise larger of neighbouring runs (a bitonic
    run holding the best k of both) merged again, until one run is left."""
    n_log2: tl.constexpr = _log2_exact(x.shape[1])
    k_log2: tl.constexpr = _log2_exact(k)
    cube = tl.reshape(x, [2] * _log2_exact(x.numel))
    for s in tl.static_range(1, k_log2 + 1):
        cube = _bitonic_merge(cube, s, s == n_log2)
    for s in tl.static_range(k_log2 + 1, n_log2 + 1):
        cube = tl.max(cube, len(cube.shape) - 1 - k_log2)
        cube = _bitonic_merge(cube, k_log2, s == n_log2)
    return tl.reshape(cube, [x.shape[0], k])
'''
_CHANGES = [
    (_ANCHOR, _HELPERS + "\n\n" + _ANCHOR),
    ("tl.sum(tl.where(tl.arange(0, KP)[None, :] == K - 1, tl.topk(x, KP), 0), 1)",
     "tl.sum(tl.where(tl.arange(0, KP)[None, :] == K - 1, _largest_descending(x, KP), 0), 1)"),
    ("        return tl.topk(keys, KP)\n", "        return _largest_descending(keys, KP)\n"),
    ("        return tl.sort(keys, 1, descending=True)\n", "        return _sorted_descending(keys)\n"),
]
_WARPS = 'SELECT_WARPS=4, KERNEL="auto")'
VARIANTS = {"int1_network": _CHANGES,
            "warps2": [(_WARPS, _WARPS.replace("4", "2"))],
            "int1_warps2": _CHANGES + [(_WARPS, _WARPS.replace("4", "2"))],
            "int1_warps1": _CHANGES + [(_WARPS, _WARPS.replace("4", "1"))]}


def inputs(T, H, device):
    """Random int32 orders (distinct almost surely), ``H`` the document length (0: one document of T rows), row t
    seeing (t mod doc + 1) / 4 entries."""
    gen = torch.Generator(device=device).manual_seed(0)
    doc = H or T
    t = torch.arange(T, device=device)
    width = doc // 4
    orders = torch.randint(-2**31, 2**31 - 1, (T, width), device=device, generator=gen, dtype=torch.int64).int()
    return dict(orders=orders, first=((t // doc) * width).int(), visible=((t % doc + 1) // 4).int())


def call(module, inp):
    T = inp["orders"].shape[0]
    out = torch.empty(T, 512, dtype=torch.int32, device=inp["orders"].device)
    scores = torch.empty(T, 512, dtype=torch.float32, device=out.device)
    module._select(inp["orders"], inp["first"], inp["visible"], None, 0, out, scores, module.CONFIG)
    return out, scores
