"""Bad inputs to HybridAttention and to the functional ops raise an exception whose message names the argument
(docs/semantics.md, decision 9; the API in README.md "Use a layer"); valid inputs raise nothing. Most tests run in the
debug mode ("values", set by the fixture below); those about what the default mode does say so. Cross-device cu_seqlens
is not testable on a CPU machine and is left out."""
from __future__ import annotations

import re

import pytest
import torch

import dsv4attn
from dsv4attn import AttentionConfig, HybridAttention
from dsv4attn.checks import checks_enabled
from dsv4attn.ops import compress_pool, indexer_kl, indexer_topk, sparse_attention
from dsv4attn.ops.index_sets import Window
from dsv4attn.packing import pack_batch

T = 40
CU = [0, 20, 37]          # two documents, then 3 rows of capacity padding
MAX_SEQLEN = 20


@pytest.fixture(autouse=True)
def _restore_checks():
    """Every test starts in the debug mode ("values": NaN/Inf scans on) and leaves the mode as it found it."""
    with dsv4attn.checks.checks("values"):
        yield


@pytest.fixture(scope="module")
def cfg() -> AttentionConfig:
    return AttentionConfig.tiny()


@pytest.fixture(scope="module")
def layers(cfg):
    torch.manual_seed(0)
    return {r: HybridAttention(cfg, r).eval() for r in (0, 4, 128)}


def _x(rows: int = T, width: int = 128, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g, dtype=dtype)


def _cu(values=CU, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _nan_x():
    x = _x()
    x[5, 7] = float("nan")
    return x


def _inf_x():
    x = _x()
    x[30, 0] = float("inf")
    return x


# ------------------------------------------------------------------------------------- HybridAttention forward
# id -> (overrides of the call's keyword arguments (callables are evaluated at test time), exception, regex)
LAYER_CASES = {
    "cu_seqlens_int64": (dict(cu_seqlens=lambda: _cu(dtype=torch.int64)), ValueError, r"cu_seqlens.*int32"),
    "cu_seqlens_float": (dict(cu_seqlens=lambda: _cu(dtype=torch.float32)), ValueError, r"cu_seqlens.*int32"),
    "cu_seqlens_2d": (dict(cu_seqlens=lambda: _cu().view(1, 3)), ValueError, r"cu_seqlens.*1-D"),
    "cu_seqlens_empty": (dict(cu_seqlens=lambda: _cu([])), ValueError, r"cu_seqlens.*\(N\+1,\)"),
    "cu_seqlens_python_list": (dict(cu_seqlens=lambda: list(CU)), TypeError, r"cu_seqlens.*torch\.Tensor"),
    "cu_seqlens_decreasing": (dict(cu_seqlens=lambda: _cu([0, 20, 10])), ValueError,
                              r"cu_seqlens.*non-decreasing"),
    "cu_seqlens_first_not_zero": (dict(cu_seqlens=lambda: _cu([1, 20, 37])), ValueError,
                                  re.escape("cu_seqlens[0] must be 0")),
    "cu_seqlens_last_beyond_rows": (dict(cu_seqlens=lambda: _cu([0, 20, T + 1])), ValueError,
                                    re.escape("cu_seqlens[-1]")),
    "max_seqlen_below_longest_doc": (dict(max_seqlen=19), ValueError, r"max_seqlen=19.*longest"),
    "max_seqlen_tensor": (dict(max_seqlen=lambda: torch.tensor(MAX_SEQLEN)), TypeError, r"max_seqlen.*host int"),
    "max_seqlen_float": (dict(max_seqlen=20.0), TypeError, r"max_seqlen.*host int"),
    "max_seqlen_bool": (dict(max_seqlen=True), TypeError, r"max_seqlen"),
    "max_seqlen_negative": (dict(max_seqlen=-1), ValueError, r"max_seqlen.*>= 0"),
    "hidden_size_mismatch": (dict(hidden_states=lambda: _x(width=64)), ValueError,
                             r"hidden_states.*shape \(\*, 128\)"),
    "hidden_states_3d": (dict(hidden_states=lambda: _x().unsqueeze(0)), ValueError, r"hidden_states.*shape"),
    "hidden_states_1d": (dict(hidden_states=lambda: _x()[0]), ValueError, r"hidden_states.*shape"),
    "hidden_states_int": (dict(hidden_states=lambda: _x().to(torch.int32)), ValueError, r"hidden_states.*dtype"),
    "hidden_states_not_tensor": (dict(hidden_states=lambda: _x().tolist()), TypeError,
                                 r"hidden_states.*torch\.Tensor"),
    "hidden_states_float64_params_float32": (dict(hidden_states=lambda: _x(dtype=torch.float64)), ValueError,
                                             r"hidden_states.*float64.*float32"),
    "hidden_states_bf16_params_float32": (dict(hidden_states=lambda: _x(dtype=torch.bfloat16)), ValueError,
                                          r"hidden_states.*bfloat16.*float32"),
    "hidden_states_nan": (dict(hidden_states=_nan_x), ValueError, r"hidden_states.*NaN"),
    "hidden_states_inf": (dict(hidden_states=_inf_x), ValueError, r"hidden_states.*(NaN|Inf)"),
    "phase_typo_spares": (dict(phase="spares"), ValueError, r"phase.*'spares'"),
    "phase_capitalised": (dict(phase="Sparse"), ValueError, r"phase"),
    "phase_none": (dict(phase=None), ValueError, r"phase"),
    "cp_group_not_a_process_group": (dict(cp_group=lambda: object()), TypeError, r"cp_group must be a "),
    "pack_for_other_rows": (dict(pack=lambda: pack_batch(_cu(), T + 8, MAX_SEQLEN)), ValueError, r"pack"),
}


def _resolve(overrides: dict) -> dict:
    kwargs = dict(hidden_states=_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, phase="sparse", cp_group=None)
    kwargs.update({k: (v() if callable(v) else v) for k, v in overrides.items()})
    return kwargs


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_bad_input(layers, ratio, case):
    overrides, exc, pattern = LAYER_CASES[case]
    kwargs = _resolve(overrides)
    x = kwargs.pop("hidden_states")
    with pytest.raises(exc, match=pattern):
        layers[ratio](x, **kwargs)


@pytest.mark.parametrize("ratio", [3, "four", True, False, 4.0, None, -4, 64, 1],
                         ids=["three", "str_four", "bool_true", "bool_false", "float_four", "none", "minus_four",
                              "sixty_four", "one"])
def test_layer_bad_compress_ratio(cfg, ratio):
    with pytest.raises(ValueError, match=r"compress_ratio"):
        HybridAttention(cfg, ratio)


def test_config_index_topk_zero_rejected():
    with pytest.raises(ValueError, match=r"index_topk"):
        AttentionConfig.tiny(index_topk=0)


@pytest.mark.parametrize("phase", ["warmup", "sparse"])
def test_layer_topk_zero_after_mutation(phase):
    """A config mutated after validation still cannot reach the indexer with k <= 0."""
    cfg = AttentionConfig.tiny()
    cfg.index_topk = 0
    layer = HybridAttention(cfg, 4).eval()
    with pytest.raises(ValueError, match=r"topk"):
        layer(_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, phase=phase)


def test_free_checks_run_even_with_value_checks_off(layers):
    """dtype / shape checks cost nothing and stay on under set_checks(False)."""
    dsv4attn.set_checks(False)
    with pytest.raises(ValueError, match=r"cu_seqlens.*int32"):
        layers[4](_x(), cu_seqlens=_cu(dtype=torch.int64), max_seqlen=MAX_SEQLEN)
    with pytest.raises(TypeError, match=r"max_seqlen"):
        layers[4](_x(), cu_seqlens=_cu(), max_seqlen=torch.tensor(MAX_SEQLEN))
    with pytest.raises(ValueError, match=r"phase"):
        layers[4](_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, phase="spares")


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
def test_nan_passes_with_value_checks_off(layers, ratio):
    dsv4attn.set_checks(False)
    try:
        y = layers[ratio](_nan_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, phase="sparse")
    finally:
        dsv4attn.set_checks(True)
    assert y.shape == (T, 128)
    assert torch.isnan(y).any()            # garbage in, garbage out, but no exception
    with pytest.raises(ValueError, match=r"hidden_states.*NaN"):   # and the check is back on
        layers[ratio](_nan_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN)


def test_checks_context_manager_restores():
    from dsv4attn.checks import checks
    with checks(False):
        assert not checks_enabled()
    assert checks_enabled()
    with checks("default"):
        with checks("values"):
            assert checks_enabled()
        assert not checks_enabled()


# --------------------------------------------- batch metadata: validated in every mode, where the pack is built
METADATA_CASES = [case for case in LAYER_CASES if case.startswith(("cu_seqlens", "max_seqlen"))]


@pytest.mark.parametrize("case", METADATA_CASES)
def test_batch_metadata_is_validated_in_the_default_mode(layers, case):
    """Not a debug check: a decreasing cu_seqlens or a too-small max_seqlen raises with the scans off too."""
    dsv4attn.set_checks("default")
    overrides, exc, pattern = LAYER_CASES[case]
    kwargs = _resolve(overrides)
    x = kwargs.pop("hidden_states")
    with pytest.raises(exc, match=pattern):
        layers[4](x, **kwargs)


@pytest.mark.parametrize("cu, rows, max_seqlen, pattern", [
    ([0, 20, 10], T, 20, re.escape("cu_seqlens must be non-decreasing, but cu_seqlens[2]=10 < cu_seqlens[1]=20")),
    ([3, 20], T, 20, re.escape("cu_seqlens[0] must be 0, got 3")),
    ([0, 20, 41], T, 21, re.escape("cu_seqlens[-1]=41 exceeds the number of rows of the packed batch (40)")),
    ([0, 20, 37], T, 16, re.escape("max_seqlen=16 is smaller than the longest document in cu_seqlens (20); it "
                                   "must be >= every document length")),
    (None, T, 39, re.escape("max_seqlen=39 is smaller than the single document of 40 rows (cu_seqlens=None)")),
], ids=["decreasing", "first_not_zero", "past_the_rows", "max_seqlen_too_small", "single_doc_max_seqlen"])
def test_pack_batch_names_the_broken_rule(cu, rows, max_seqlen, pattern):
    dsv4attn.set_checks("default")
    with pytest.raises(ValueError, match=pattern):
        pack_batch(None if cu is None else _cu(cu), rows, max_seqlen)


def test_pack_batch_cu_seqlens_on_another_device():
    with pytest.raises(ValueError, match=r"cu_seqlens must be on meta, got cpu"):
        pack_batch(_cu(), T, MAX_SEQLEN, device=torch.device("meta"))


# ------------------------------------------------------------------------- the layer's surface: pack, CP arguments
def test_pack_and_cu_seqlens_must_agree(layers):
    pack = pack_batch(_cu(), T, MAX_SEQLEN)
    want = layers[4](_x(), pack=pack)
    for same in (pack.cu_seqlens, _cu()):                   # the pack's own tensor, or equal values: fine
        torch.testing.assert_close(layers[4](_x(), pack=pack, cu_seqlens=same), want, rtol=0, atol=0)
    for other in (_cu([0, 10, 37]), _cu([0, 37]), _cu(dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"cu_seqlens and pack disagree: cu_seqlens must be the pack's own "
                                             r"boundaries \(pack\.cu_seqlens, or a tensor of equal values\)"):
            layers[4](_x(), pack=pack, cu_seqlens=other)


def test_pack_and_max_seqlen_must_agree(layers):
    pack = pack_batch(_cu(), T, MAX_SEQLEN)
    layers[0](_x(), pack=pack, max_seqlen=MAX_SEQLEN)
    with pytest.raises(ValueError, match=r"max_seqlen=30 and pack disagree: the pack was built with max_seqlen=20"):
        layers[0](_x(), pack=pack, max_seqlen=30)


def test_pack_must_be_a_packed_batch(layers):
    with pytest.raises(TypeError, match=r"pack must be a PackedBatch from dsv4attn.pack_batch, got dict"):
        layers[0](_x(), pack={"cu_seqlens": _cu()})


@pytest.mark.parametrize("partition", ["contiguous", "head_tail"])
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
def test_cp_partition_needs_cp_group(layers, ratio, partition):
    with pytest.raises(ValueError, match=rf"cp_partition='{partition}' needs cp_group"):
        layers[ratio](_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, cp_partition=partition)


@pytest.mark.parametrize("name", ["q_b_proj.weight", "sinks", "indexer.weights_proj.weight",
                                  "compressor.position_bias"])
def test_non_finite_parameter_is_named_in_values_mode(cfg, name):
    torch.manual_seed(0)
    layer = HybridAttention(cfg, 4).eval()
    with torch.no_grad():
        layer.get_parameter(name).view(-1)[0] = float("inf")
    dsv4attn.set_checks("values")
    with pytest.raises(ValueError, match=rf"parameter {re.escape(name)} contains NaN or Inf; it must be finite"):
        layer(_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN)
    dsv4attn.set_checks("default")                          # the default mode does not look
    layer(_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN)


@pytest.mark.parametrize("failure", ["bad_cu_seqlens", "nan_input", "bad_phase", "cp_partition"])
def test_failed_forward_leaves_indexer_loss_none(cfg, failure):
    torch.manual_seed(0)
    layer = HybridAttention(cfg, 4).train()
    layer(_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, phase="warmup")
    assert layer.indexer_loss is not None
    kwargs = dict(cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN, phase="warmup")
    x = _x()
    if failure == "bad_cu_seqlens":
        kwargs["cu_seqlens"] = _cu([0, 20, 10])
    elif failure == "nan_input":
        x = _nan_x()
    elif failure == "bad_phase":
        kwargs["phase"] = "sparce"
    else:
        kwargs["cp_partition"] = "head_tail"
    with pytest.raises(ValueError):
        layer(x, **kwargs)
    assert layer.indexer_loss is None


# ------------------------------------------------------------------------------------- sanity: valid inputs
@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "csa", "hca"])
@pytest.mark.parametrize("phase", ["dense", "warmup", "sparse"])
@pytest.mark.parametrize("batch", ["single_doc", "packed_with_padding", "empty_doc", "long_doc"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_valid_inputs_raise_nothing(cfg, ratio, phase, batch, training):
    rows, cu, max_seqlen = {
        "single_doc": (T, None, None),
        "packed_with_padding": (T, _cu(), MAX_SEQLEN),
        "empty_doc": (T, _cu([0, 0, 20, 20, 37]), MAX_SEQLEN),
        "long_doc": (300, _cu([0, 260, 290]), 260),       # HCA layers get real compressed entries
    }[batch]
    torch.manual_seed(0)
    layer = HybridAttention(cfg, ratio).train(training)
    x = _x(rows).requires_grad_(training)
    y = layer(x, cu_seqlens=cu, max_seqlen=max_seqlen, phase=phase)
    assert y.shape == (rows, cfg.hidden_size)
    assert y.dtype == x.dtype
    assert torch.isfinite(y).all()
    if cu is not None:
        assert (y[int(cu[-1]):] == 0).all()             # capacity padding rows output 0
    if training:
        y.square().sum().backward()
        assert torch.isfinite(x.grad).all()
        if ratio == 4 and phase != "dense":
            assert layer.indexer_loss is not None and torch.isfinite(layer.indexer_loss)


def test_valid_call_with_max_seqlen_omitted(layers):
    y = layers[4](_x(), cu_seqlens=_cu())
    assert y.shape == (T, 128)


def test_valid_call_with_prebuilt_pack(layers):
    pack = pack_batch(_cu(), T, MAX_SEQLEN)
    y1 = layers[4](_x(), pack=pack)
    y2 = layers[4](_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN)
    torch.testing.assert_close(y1, y2)


def test_valid_float64_layer(cfg):
    layer = HybridAttention(cfg, 4).double().eval()
    y = layer(_x(dtype=torch.float64), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN)
    assert y.dtype == torch.float64


def test_valid_inputs_with_checks_off(layers):
    dsv4attn.set_checks(False)
    y = layers[128](_x(), cu_seqlens=_cu(), max_seqlen=MAX_SEQLEN)
    assert torch.isfinite(y).all()


# --------------------------------------------------------------------------------------------- sparse_attention
SA_T, SA_H, SA_D, SA_N = 6, 4, 16, 10


def _sa_args():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(SA_T, SA_H, SA_D, generator=g)
    kv = torch.randn(SA_N, SA_D, generator=g)
    indices = torch.tensor([[0, 1, -1], [2, 3, 4], [-1, -1, -1], [9, 0, 5], [6, -1, 7], [8, 1, 2]],
                           dtype=torch.int32)
    sink = torch.randn(SA_H, generator=g)
    return dict(q=q, kv=kv, indices=indices, attn_sink=sink)


def _with(fn):
    """A case: a function that edits the valid argument dict in place."""
    def make():
        a = _sa_args()
        fn(a)
        return a
    return make


def _set(key, value_fn):
    return lambda a: a.__setitem__(key, value_fn(a))


def _nan_at(key):
    def f(a):
        t = a[key].clone()
        t.view(-1)[3] = float("nan")
        a[key] = t
    return f


SA_CASES = {
    "q_2d": (_set("q", lambda a: a["q"][:, 0]), ValueError, r"q must be 3-D"),
    "q_int": (_set("q", lambda a: a["q"].to(torch.int32)), ValueError, r"q must have dtype"),
    "q_not_tensor": (_set("q", lambda a: a["q"].tolist()), TypeError, r"q must be a torch\.Tensor"),
    "kv_wrong_head_dim": (_set("kv", lambda a: a["kv"][:, :8]), ValueError, r"kv must have shape \(\*, 16\)"),
    "kv_3d": (_set("kv", lambda a: a["kv"][:, None]), ValueError, r"kv must have shape"),
    "kv_dtype_differs_from_q": (_set("kv", lambda a: a["kv"].double()), ValueError, r"kv must have dtype"),
    "sink_wrong_shape": (_set("attn_sink", lambda a: a["attn_sink"][:3]), ValueError,
                         r"attn_sink must have shape \(4,?\)"),
    "sink_2d": (_set("attn_sink", lambda a: a["attn_sink"][None]), ValueError, r"attn_sink must have shape"),
    "sink_bf16": (_set("attn_sink", lambda a: a["attn_sink"].bfloat16()), ValueError, r"attn_sink must have dtype"),
    "sink_fp16": (_set("attn_sink", lambda a: a["attn_sink"].half()), ValueError, r"attn_sink must have dtype"),
    "indices_float": (_set("indices", lambda a: a["indices"].float()), ValueError, r"indices must have dtype"),
    "indices_bool": (_set("indices", lambda a: a["indices"] >= 0), ValueError, r"indices must have dtype"),
    "indices_1d": (_set("indices", lambda a: a["indices"][:, 0]), ValueError, r"indices must have shape"),
    "indices_wrong_rows": (_set("indices", lambda a: a["indices"][:5]), ValueError,
                           r"indices must have shape \(6, \*\)"),
    "indices_out_of_range": (_set("indices", lambda a: torch.where(a["indices"] == 9, 10, a["indices"])),
                             ValueError, r"indices must hold row numbers in \[0, 10\)"),
    "indices_below_minus_one": (_set("indices", lambda a: torch.where(a["indices"] == -1, -2, a["indices"])),
                                ValueError, r"indices"),
    "index_set_wrong_rows": (_set("indices", lambda a: Window(pack_batch(None, SA_T + 1), 4)), ValueError,
                             r"indices must cover the 6 rows"),
    "q_nan": (_nan_at("q"), ValueError, r"q contains NaN"),
    "kv_nan": (_nan_at("kv"), ValueError, r"kv contains NaN"),
    # float() of these raised its own message, naming no argument
    "softmax_scale_str": (_set("softmax_scale", lambda a: "big"), ValueError, r"softmax_scale must be a positive"),
    "softmax_scale_two_elements": (_set("softmax_scale", lambda a: torch.tensor([1.0, 2.0])), ValueError,
                                   r"softmax_scale must be a positive"),
}


@pytest.mark.parametrize("case", list(SA_CASES))
def test_sparse_attention_bad_input(case):
    edit, exc, pattern = SA_CASES[case]
    args = _with(edit)()
    with pytest.raises(exc, match=pattern):
        sparse_attention(**args)


def test_sparse_attention_valid():
    args = _sa_args()
    out, lse = sparse_attention(**args)
    assert out.shape == (SA_T, SA_H, SA_D) and lse.shape == (SA_T, SA_H)
    assert lse.dtype == torch.float32
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()     # empty row: 0 and -inf, never NaN
    assert torch.isfinite(out).all()
    out64, _ = sparse_attention(args["q"].double(), args["kv"].double(), args["indices"].long(),
                                args["attn_sink"].double(), softmax_scale=0.5)
    assert out64.dtype == torch.float64


# ---------------------------------------------------------------------------------- compress_pool / indexer ops
OP_T, OP_CU, OP_MAX = 12, [0, 8, 12], 8


def _layout(ratio=4, rows=OP_T, cu=OP_CU, max_seqlen=OP_MAX):
    return pack_batch(torch.tensor(cu, dtype=torch.int32), rows, max_seqlen).compressed(ratio)


def _cp_args(d=8):
    g = torch.Generator().manual_seed(3)
    return dict(kv=torch.randn(OP_T, 2 * d, generator=g), gate=torch.randn(OP_T, 2 * d, generator=g),
                position_bias=torch.randn(4, 2 * d, generator=g), layout=_layout(4))


CP_CASES = {
    "kv_1d": (lambda a: a.update(kv=a["kv"][:, 0]), ValueError, r"kv must be 2-D"),
    "kv_int": (lambda a: a.update(kv=a["kv"].to(torch.int32), gate=a["gate"].to(torch.int32)), ValueError,
               r"kv.*dtype"),
    "gate_wrong_shape": (lambda a: a.update(gate=a["gate"][:, :8]), ValueError, r"gate must have shape"),
    "gate_wrong_rows": (lambda a: a.update(gate=a["gate"][:-1]), ValueError, r"gate must have shape \(12, 16\)"),
    "gate_dtype_differs": (lambda a: a.update(gate=a["gate"].double()), ValueError, r"gate must have dtype"),
    "odd_width_ratio_4": (lambda a: a.update(kv=a["kv"][:, :15], gate=a["gate"][:, :15],
                                             position_bias=a["position_bias"][:, :15]), ValueError,
                          r"kv must have an even width"),
    "position_bias_bf16": (lambda a: a.update(position_bias=a["position_bias"].bfloat16()), ValueError,
                           r"position_bias must have dtype"),
    "position_bias_wrong_ratio": (lambda a: a.update(position_bias=torch.zeros(128, 16)), ValueError,
                                  r"position_bias must have shape \(4, 16\)"),
    "position_bias_for_ratio_4_on_128_layout": (lambda a: a.update(layout=_layout(128)), ValueError,
                                                r"position_bias must have shape \(128, 16\)"),
    "layout_for_other_rows": (lambda a: a.update(layout=_layout(4, rows=20, cu=[0, 8, 20], max_seqlen=12)),
                              ValueError, r"layout"),
    # an AttributeError ('Tensor' object has no attribute 'ratio') before
    "layout_tensor": (lambda a: a.update(layout=torch.zeros(3)), TypeError, r"layout must be a CompressedLayout"),
    "layout_none": (lambda a: a.update(layout=None), TypeError, r"layout must be a CompressedLayout"),
}


@pytest.mark.parametrize("case", list(CP_CASES))
def test_compress_pool_bad_input(case):
    edit, exc, pattern = CP_CASES[case]
    args = _cp_args()
    edit(args)
    with pytest.raises(exc, match=pattern):
        compress_pool(**args)


def test_compress_pool_valid():
    out = compress_pool(**_cp_args())
    assert out.shape == (_layout(4).capacity, 8)
    assert torch.isfinite(out).all()


HI, DI = 2, 8


def _topk_args():
    g = torch.Generator().manual_seed(4)
    lay = _layout(4)
    return dict(q=torch.randn(OP_T, HI, DI, generator=g), k=torch.randn(lay.capacity, DI, generator=g),
                weights=torch.randn(OP_T, HI, generator=g), layout=lay, topk=3)


TOPK_CASES = {
    "topk_zero": (lambda a: a.update(topk=0), ValueError, r"topk must be a positive int, got 0"),
    "topk_negative": (lambda a: a.update(topk=-1), ValueError, r"topk must be a positive int"),
    "topk_bool": (lambda a: a.update(topk=True), ValueError, r"topk"),
    "topk_float": (lambda a: a.update(topk=3.0), ValueError, r"topk"),
    "topk_tensor": (lambda a: a.update(topk=torch.tensor(3)), ValueError, r"topk"),
    "q_2d": (lambda a: a.update(q=a["q"][:, 0]), ValueError, r"q must be 3-D"),
    "k_wrong_head_dim": (lambda a: a.update(k=a["k"][:, :4]), ValueError, r"k must have shape \(\*, 8\)"),
    "k_fewer_rows_than_layout": (lambda a: a.update(k=a["k"][:1]), ValueError, r"\bk\b"),
    "weights_wrong_heads": (lambda a: a.update(weights=a["weights"][:, :1]), ValueError,
                            r"weights must have shape \(12, 2\)"),
    "weights_wrong_rows": (lambda a: a.update(weights=a["weights"][:5]), ValueError, r"weights must have shape"),
    "layout_for_other_rows": (lambda a: a.update(layout=_layout(4, rows=20, cu=[0, 8, 20], max_seqlen=12)),
                              ValueError, r"layout"),
    # an AttributeError ('Tensor' object has no attribute 'total_rows') before
    "layout_tensor": (lambda a: a.update(layout=torch.zeros(3)), TypeError,
                      r"layout must be a CompressedLayout .* or an IndexSet"),
}


@pytest.mark.parametrize("case", list(TOPK_CASES))
def test_indexer_topk_bad_input(case):
    edit, exc, pattern = TOPK_CASES[case]
    args = _topk_args()
    edit(args)
    with pytest.raises(exc, match=pattern):
        indexer_topk(**args)


def test_indexer_topk_valid():
    out = indexer_topk(**_topk_args())
    assert out.dtype == torch.int32
    assert out.shape == (OP_T, min(3, OP_MAX // 4))


H, D = 4, 16


def _kl_args():
    g = torch.Generator().manual_seed(5)
    lay = _layout(4)
    nc = lay.capacity
    cand = torch.tensor([[-1, -1]] * 3 + [[0, -1]] * 4 + [[1, 0]] + [[-1, -1]] * 3 + [[2, -1]], dtype=torch.int32)
    return dict(index_q=torch.randn(OP_T, HI, DI, generator=g), index_k=torch.randn(nc, DI, generator=g),
                index_weights=torch.randn(OP_T, HI, generator=g), q=torch.randn(OP_T, H, D, generator=g),
                compressed_kv=torch.randn(nc, D, generator=g), candidates=cand,
                outside_lse=torch.randn(OP_T, H, generator=g))


KL_CASES = {
    "index_q_2d": (lambda a: a.update(index_q=a["index_q"][:, 0]), ValueError, r"index_q must be 3-D"),
    "index_k_wrong_dim": (lambda a: a.update(index_k=a["index_k"][:, :4]), ValueError, r"index_k must have shape"),
    "index_weights_wrong_shape": (lambda a: a.update(index_weights=a["index_weights"][:, :1]), ValueError,
                                  r"index_weights must have shape"),
    "q_wrong_rows": (lambda a: a.update(q=a["q"][:5]), ValueError, r"\bq must have shape"),
    "compressed_kv_wrong_rows": (lambda a: a.update(compressed_kv=a["compressed_kv"][:1]), ValueError,
                                 r"compressed_kv must have shape"),
    "compressed_kv_wrong_dim": (lambda a: a.update(compressed_kv=a["compressed_kv"][:, :8]), ValueError,
                                r"compressed_kv must have shape"),
    "outside_lse_wrong_heads": (lambda a: a.update(outside_lse=a["outside_lse"][:, :2]), ValueError,
                                r"outside_lse must have shape \(12, 4\)"),
    "candidates_float": (lambda a: a.update(candidates=a["candidates"].float()), ValueError,
                         r"candidates must have dtype"),
    "candidates_wrong_rows": (lambda a: a.update(candidates=a["candidates"][:5]), ValueError,
                              r"candidates must have shape"),
    "candidates_out_of_range": (lambda a: a.update(candidates=a["candidates"].masked_fill(a["candidates"] == 2, 7)),
                                ValueError, r"candidates"),
    # integer keys or queries were accepted and gave a KL of 0 for every row
    "index_k_int": (lambda a: a.update(index_k=a["index_k"].long()), ValueError, r"index_k must have dtype"),
    "q_int": (lambda a: a.update(q=a["q"].to(torch.int32)), ValueError, r"\bq must have dtype"),
    "compressed_kv_bool": (lambda a: a.update(compressed_kv=a["compressed_kv"] > 0), ValueError,
                           r"compressed_kv must have dtype"),
    "candidates_list": (lambda a: a.update(candidates=a["candidates"].tolist()), TypeError,
                        r"candidates must be a \(T, C\) int torch\.Tensor or an IndexSet"),
}


@pytest.mark.parametrize("case", list(KL_CASES))
def test_indexer_kl_bad_input(case):
    edit, exc, pattern = KL_CASES[case]
    args = _kl_args()
    edit(args)
    with pytest.raises(exc, match=pattern):
        indexer_kl(**args)


def test_indexer_kl_valid():
    kl = indexer_kl(**_kl_args())
    assert kl.shape == (OP_T,)
    assert torch.isfinite(kl).all()
    assert (kl[:3] == 0).all()                # empty candidate sets contribute 0


# ------------------------------------------------------------- index safety: out-of-range indices are never read
def _masked_indices(indices, rows):
    return torch.where((indices >= 0) & (indices < rows), indices, -1)


@pytest.mark.parametrize("as_index_set", [False, True], ids=["tensor", "index_set"])
def test_out_of_range_indices_are_empty_slots_by_default(as_index_set):
    from dsv4attn.ops import Explicit
    dsv4attn.set_checks("default")
    args = _sa_args()
    bad = args["indices"].clone()
    bad[0, 2], bad[3, 0], bad[4, 1] = SA_N, 10 ** 6, -5          # past the end, far past it, below -1
    want = sparse_attention(**dict(args, indices=_masked_indices(bad, SA_N)))
    got = sparse_attention(**dict(args, indices=Explicit(bad) if as_index_set else bad))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_out_of_range_indices_raise_in_values_mode():
    args = _sa_args()
    args["indices"] = args["indices"].clone()
    args["indices"][1, 1] = SA_N + 3
    with pytest.raises(ValueError, match=r"indices must hold row numbers in \[0, 10\) or -1 for an empty slot, "
                                         r"got values in \[-1, 13\]"):
        sparse_attention(**args)


def test_empty_kv_is_safe():
    """No key row at all: every index is out of range; by default each is an empty slot (no kernel reads kv)."""
    dsv4attn.set_checks("default")
    args = _sa_args()
    out, lse = sparse_attention(**dict(args, kv=args["kv"][:0]))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_out_of_range_candidates_are_empty_slots_by_default():
    dsv4attn.set_checks("default")
    args = _kl_args()
    bad = args["candidates"].clone()
    bad[8, 1] = args["index_k"].shape[0] + 4
    want = indexer_kl(**dict(args, candidates=_masked_indices(bad, args["index_k"].shape[0])))
    torch.testing.assert_close(indexer_kl(**dict(args, candidates=bad)), want, rtol=0, atol=0)
