"""The default checks cost nothing on the hot path: a layer forward (and backward) given a prebuilt pack reads no
device value on the host and scans no tensor; building the pack reads ``cu_seqlens`` once; the public
``sparse_attention`` reads nothing either (out-of-range indices are masked, not looked for).

Counted on the CPU with a ``TorchFunctionMode``, which sees every torch call made from Python, Tensor methods
included: the calls that hand a device value to the host (``item``, ``tolist``, ``bool()``, ``int()``, ...,
``nonzero``-style data-dependent shapes) and the NaN/Inf scans (``isfinite``, ``isnan``, ``isinf``)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dsv4attn
from dsv4attn import AttentionConfig, HybridAttention, pack_batch
from dsv4attn.ops import indexer_kl, sparse_attention

T_ = torch.Tensor
HOST_READS = {T_.item, T_.tolist, T_.__bool__, T_.__int__, T_.__float__, T_.__index__, T_.__complex__, T_.numpy,
              T_.cpu, torch.equal, torch.allclose, T_.allclose, T_.equal, torch.nonzero, T_.nonzero,
              torch.argwhere, T_.argwhere, torch.masked_select, T_.masked_select, torch.unique, T_.unique,
              torch.unique_consecutive, T_.unique_consecutive, torch.repeat_interleave, T_.repeat_interleave}
SCANS = {torch.isfinite, T_.isfinite, torch.isnan, T_.isnan, torch.isinf, T_.isinf, torch.isneginf, torch.isposinf}


class HostReads(TorchFunctionMode):
    """Counts host reads and scans made inside the ``with`` block, by function name."""

    def __init__(self):
        super().__init__()
        self.reads, self.scans = Counter(), Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS and not (func in (torch.repeat_interleave, T_.repeat_interleave)
                                       and kwargs.get("output_size") is not None):
            self.reads[func.__name__] += 1
        elif func in (T_.__getitem__, T_.__setitem__) and _data_dependent_index(args[1]):
            self.reads[func.__name__ + " (mask or tensor bound)"] += 1
        if func in SCANS:
            self.scans[func.__name__] += 1
        return func(*args, **kwargs)


def _data_dependent_index(index) -> bool:
    """A boolean-mask index or a tensor slice bound: the result's shape needs a device value."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dtype == torch.bool:
            return True
        if isinstance(part, slice) and any(isinstance(b, torch.Tensor) for b in (part.start, part.stop, part.step)):
            return True
    return False


CU = [0, 20, 37, 37, 300]         # short documents, an empty one, one long enough for HCA entries; then padding
T = 310


@pytest.fixture(autouse=True)
def _default_checks():
    with dsv4attn.checks.checks("default"):
        yield


@pytest.fixture(scope="module")
def cfg():
    return AttentionConfig.tiny()


def _pack():
    return pack_batch(torch.tensor(CU, dtype=torch.int32), T, 263)


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
def test_layer_with_a_prebuilt_pack_reads_and_scans_nothing(cfg, ratio, phase):
    torch.manual_seed(0)
    layer = HybridAttention(cfg, ratio).train()
    x = torch.randn(T, cfg.hidden_size, requires_grad=True)
    pack = _pack()
    with HostReads() as forward:
        y = layer(x, pack=pack, phase=phase, cu_seqlens=pack.cu_seqlens, max_seqlen=pack.max_seqlen)
    with HostReads() as backward:
        y.square().mean().backward()
    assert dict(forward.reads) == {} and dict(forward.scans) == {}, (forward.reads, forward.scans)
    assert dict(backward.reads) == {} and dict(backward.scans) == {}, (backward.reads, backward.scans)
    if ratio == 4 and phase != "dense":
        assert layer.indexer_loss is not None            # the KL ran, and read nothing either


def test_pack_batch_reads_cu_seqlens_once():
    cu = torch.tensor(CU, dtype=torch.int32)
    for max_seqlen in (263, None):                       # computing max_seqlen uses the same read
        with HostReads() as built:
            pack = pack_batch(cu, T, max_seqlen)
        assert dict(built.reads) == {"tolist": 1} and not built.scans
        assert pack.max_seqlen == 263
    with HostReads() as single:                          # one document: valid by construction, nothing to read
        pack_batch(None, T)
    assert not single.reads


def test_layer_without_a_pack_reads_once(cfg):
    layer = HybridAttention(cfg, 4).eval()
    x = torch.randn(T, cfg.hidden_size)
    with HostReads() as counted:
        layer(x, cu_seqlens=torch.tensor(CU, dtype=torch.int32), max_seqlen=263)
    assert dict(counted.reads) == {"tolist": 1} and not counted.scans


def test_an_equal_cu_seqlens_tensor_is_compared_once_per_pack(cfg):
    layer = HybridAttention(cfg, 0).eval()
    x, pack = torch.randn(T, cfg.hidden_size), _pack()
    other = pack.cu_seqlens.clone()
    with HostReads() as first:
        layer(x, pack=pack, cu_seqlens=other)
    with HostReads() as second:
        layer(x, pack=pack, cu_seqlens=other)
    assert sum(first.reads.values()) == 1 and not second.reads


def test_a_model_forward_reads_only_to_build_its_pack():
    """The model builds one pack per batch and its layers read nothing (under CP the pack's agreement adds one
    read, still not one per layer: tests/parallel/test_context_parallel.py, _check_cp_packs)."""
    from dsv4attn.train.model import DecoderLM, model_config
    torch.manual_seed(0)
    model = DecoderLM(model_config("tiny", ratios=(0, 4, 128, 4, 128)))
    tokens = torch.randint(0, 256, (T,))
    with HostReads() as counted:
        model(tokens, torch.tensor(CU, dtype=torch.int32), 263, "sparse")
    assert dict(counted.reads) == {"tolist": 1} and not counted.scans, (counted.reads, counted.scans)


def test_values_mode_scans(cfg):
    """The counter does see the debug scans (so the zeros above mean something)."""
    layer = HybridAttention(cfg, 4).eval()
    x, pack = torch.randn(T, cfg.hidden_size), _pack()
    with dsv4attn.checks.checks("values"), HostReads() as counted:
        layer(x, pack=pack, phase="sparse")
    assert sum(counted.scans.values()) >= 10 and sum(counted.reads.values()) >= 10


def test_public_ops_read_nothing_by_default():
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(6, 2, 16, generator=g), torch.randn(5, 16, generator=g)
    indices = torch.tensor([[0, 9, -1], [4, -7, 2]] * 3, dtype=torch.int32)        # 9 and -7: out of range
    sink, length = torch.zeros(2), torch.tensor([3, 2, 1, 0, 9, -1], dtype=torch.int32)
    with HostReads() as counted:
        sparse_attention(q, kv, indices, sink, topk_length=length)
        indexer_kl(torch.randn(6, 2, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(6, 2, generator=g),
                   q, kv, indices, torch.zeros(6, 2))
    assert not counted.reads and not counted.scans, (counted.reads, counted.scans)
