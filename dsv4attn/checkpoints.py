"""Checkpoint names of one attention layer: native (= this package's module tree), Hugging Face transformers
``DeepseekV4Attention`` and DeepSeek's released checkpoints (docs/semantics.md, decision 12).

Native names mirror Hugging Face's except for the indexer, which here is a sibling of the compressor
(``indexer.*``, as in DeepSeek's release) instead of living under ``compressor.indexer.*``.
"""
from __future__ import annotations

from typing import Mapping

import torch

_TOP_HF = ["q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_proj.weight", "kv_norm.weight",
           "o_a_proj.weight", "o_b_proj.weight", "sinks"]
_TOP_DS = ["wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight", "wo_a.weight",
           "wo_b.weight", "attn_sink"]
_COMP_NATIVE = ["kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight"]
_COMP_DS = ["wkv.weight", "wgate.weight", "ape", "norm.weight"]


def name_tables(compress_ratio: int) -> tuple[dict[str, str], dict[str, str]]:
    """(native -> HF, native -> DeepSeek) key maps of a layer with ``compress_ratio``."""
    to_hf = dict(zip(_TOP_HF, _TOP_HF))
    to_ds = dict(zip(_TOP_HF, _TOP_DS))
    if compress_ratio:
        for native, ds in zip(_COMP_NATIVE, _COMP_DS):
            to_hf[f"compressor.{native}"] = f"compressor.{native}"
            to_ds[f"compressor.{native}"] = f"compressor.{ds}"
    if compress_ratio == 4:
        for native, ds in zip(_COMP_NATIVE, _COMP_DS):
            to_hf[f"indexer.compressor.{native}"] = f"compressor.indexer.{native}"
            to_ds[f"indexer.compressor.{native}"] = f"indexer.compressor.{ds}"
        to_hf["indexer.q_b_proj.weight"] = "compressor.indexer.q_b_proj.weight"
        to_hf["indexer.weights_proj.weight"] = "compressor.indexer.scorer.weights_proj.weight"
        to_ds["indexer.q_b_proj.weight"] = "indexer.wq_b.weight"
        to_ds["indexer.weights_proj.weight"] = "indexer.weights_proj.weight"
    return to_hf, to_ds


def to_hf_state_dict(layer) -> dict[str, torch.Tensor]:
    """The layer's parameters under Hugging Face ``DeepseekV4Attention`` names (full tensors: under FSDP2 each
    shard is gathered, a collective every rank of the mesh calls; under tensor parallelism each sharded parameter
    is all-gathered over the TP group, one collective per sharded parameter that every rank of the group calls)."""
    from .layers.common import full_value
    to_hf, _ = name_tables(layer.compress_ratio)
    return {to_hf[k]: _tp_full(layer, k, full_value(v)) for k, v in layer.state_dict().items()}


def _tp_full(layer, name: str, value: torch.Tensor) -> torch.Tensor:
    dim = _tp_dim(layer, name)
    return value if dim is None else layer.tp.gather(value, dim)


def _tp_dim(layer, name: str):
    """The dim along which a tensor-parallel layer holds a slice of ``name`` (native), None if it holds it whole."""
    tp = getattr(layer, "tp", None)
    return None if tp is None or tp.world == 1 else layer.tp_sharded.get(name)


LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def load_attention_state_dict(layer, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Copy ``state_dict`` (native, HF or DeepSeek names; one naming per call) into ``layer``.

    Returns ``(missing, unexpected)`` lists of key names. Every entry is checked before anything is copied, so a
    refused state dict leaves the layer exactly as it was: with ``strict`` any missing or unexpected key raises a
    ValueError that names them; a known key whose value is not a tensor, has another shape than its parameter, or
    is not a floating-point tensor with values (fp16 / bf16 / fp32 / fp64; not quantised fp8 or integer, not on
    the meta device) always raises, naming every such key and what was expected. Values are copied into the
    existing parameters, so fp32 parameters stay fp32 whatever the checkpoint dtype. A tensor-parallel layer takes
    full tensors and copies its rank's slice of the sharded ones (no communication).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of parameter names to tensors, got {type(state_dict).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    to_hf, to_ds = name_tables(layer.compress_ratio)
    native_keys = list(to_hf)
    incoming = set(state_dict)
    # Pick the naming the keys use; on a tie (ratio 0 / 128 keys are the same in HF and native) HF wins,
    # unless nothing matches at all: then missing keys are reported under native names.
    native = dict(zip(native_keys, native_keys))
    best = max((to_hf, to_ds, native), key=lambda table: len(incoming & set(table.values())))
    if not incoming & set(best.values()):
        best = native
    from_external = {ext: native for native, ext in best.items()}
    missing = [best[k] for k in native_keys if best[k] not in incoming]
    unexpected = sorted(k for k in incoming if k not in from_external)
    params = dict(layer.named_parameters())
    shape_errors, value_errors = [], []
    for ext, value in state_dict.items():
        native = from_external.get(ext)
        if native is None:
            continue
        dim = _tp_dim(layer, native)                  # tensor parallelism: the full tensor's shape is expected
        want = tuple(params[native].shape) if dim is None else layer.tp.full_shape(params[native].shape, dim)
        if not isinstance(value, torch.Tensor):
            value_errors.append(f"{ext}: expected a torch.Tensor of shape {want}, got {type(value).__name__}")
        elif tuple(value.shape) != want:
            shape_errors.append(f"{ext}: expected {want}, got {tuple(value.shape)}")
        elif value.dtype not in LOADABLE_DTYPES:
            hint = (" (quantised weights: dequantise them with their scales first)"
                    if "float8" in str(value.dtype) else "")
            value_errors.append(f"{ext}: expected a floating-point dtype in {[str(d) for d in LOADABLE_DTYPES]}, "
                                f"got {value.dtype}{hint}")
        elif value.device.type == "meta":
            value_errors.append(f"{ext}: expected a tensor with values, got one on the meta device")
    parts = []
    if strict and missing:
        parts.append(f"missing keys {missing}")
    if strict and unexpected:
        parts.append(f"unexpected keys {unexpected}")
    # Like nn.Module.load_state_dict: a wrong shape (or a value that cannot be loaded) is an error even when not
    # strict.
    if shape_errors:
        parts.append(f"shape mismatches {shape_errors}")
    if value_errors:
        parts.append(f"unloadable values {value_errors}")
    if parts:
        raise ValueError(f"state_dict does not fit HybridAttention(ratio={layer.compress_ratio}), nothing was "
                         f"loaded: " + "; ".join(parts))
    from .layers.common import copy_full_          # on use: the layers import this module
    with torch.no_grad():
        for ext, value in state_dict.items():
            native = from_external.get(ext)
            if native is not None:
                dim = _tp_dim(layer, native)              # a tensor-parallel rank takes its slice
                copy_full_(params[native], value if dim is None else layer.tp.shard(value, dim))
    return missing, unexpected
