"""Run a Hugging Face transformers DeepseekV4 model's attention through dsv4attn (docs/hf_integration.md).

``apply(model)`` patches a ``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` in place: every ``DeepseekV4Attention``
then computes :class:`dsv4attn.HybridAttention` with the module's own parameters (shared, not copied), so the
state-dict keys, ``save_pretrained`` and ``from_pretrained`` are unchanged, and the MoE, hyper-connections,
embeddings and head stay transformers' code. The batch is described once per forward, at the model level:

- a padding-free packed row (batch 1, ``position_ids`` restarting at 0 at each document, as
  ``DataCollatorWithFlattening`` makes): each document is computed as if it ran alone;
- transformers' flash-attention kwargs ``cu_seq_lens_q`` / ``max_length_q``, when given, are the boundaries;
- an ordinary batch with ``attention_mask``: each row's real tokens are its own document(s); padding tokens are
  left out of every computation (their attention output is 0).

Training only: a forward that uses a KV cache (``generate``, ``use_cache=True``, ``cache=``/``past_key_values=``)
runs transformers' own attention instead, which is correct for unpacked rows (packed rows with a cache raise).

Needs transformers (the ``hf`` extra); importing this module imports it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

try:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as _hf
except ImportError as err:                                      # pragma: no cover - depends on the environment
    raise ImportError("dsv4attn.integrations.transformers needs transformers with DeepseekV4 (the 'hf' extra: "
                      "pip install 'dsv4attn[hf]')") from err

from ..checkpoints import name_tables
from ..config import AttentionConfig, check_phase
from ..layers import HybridAttention
from ..packing import PackedBatch, pack_batch
from ..rope import layer_rope_frequencies

__all__ = ["apply", "set_phase", "get_phase", "indexer_loss", "is_applied", "PackedRows", "packed_rows"]

_BATCH_ATTR = "_dsv4attn_rows"          # where the model's pre-hook leaves the batch on its position_ids tensor
_LAYER_KEY = "_dsv4attn_layer"          # the hidden HybridAttention (in __dict__: not a submodule, no extra keys)
_HOOK_KEY = "_dsv4attn_hook"


# ------------------------------------------------------------------------------------------------ the batch
@dataclass(frozen=True)
class PackedRows:
    """How the (B, S) tokens of one forward map onto the rows of one dsv4attn pack.

    ``order`` (T,) lists the tokens (flattened row-major, T = B * S) in packed order: real tokens first, in their
    order, then padding tokens (capacity padding of the pack); ``inverse`` undoes it. Both are None when every token
    is real (the pack's rows are then the flattened tokens). ``position_ids`` (B, S) are the in-document positions
    (0 for padding tokens): the model's rotary tables are built from them, and this object rides on that tensor to
    every attention layer of the same forward.
    """

    pack: PackedBatch
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    position_ids: torch.Tensor

    def to_packed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, D) -> (T, D) packed rows."""
        flat = x.reshape(-1, x.shape[-1])
        return flat if self.order is None else flat.index_select(0, self.order)

    def from_packed(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """(T, D) packed rows -> (B, S, D)."""
        if self.inverse is not None:
            y = y.index_select(0, self.inverse)
        return y.view(*shape[:-1], y.shape[-1])


def packed_rows(batch: int, seq: int, device: torch.device, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                max_length_q: int | None = None) -> PackedRows:
    """The :class:`PackedRows` of a (``batch``, ``seq``) forward. Documents:

    - ``cu_seq_lens_q`` given (flash-attention kwargs, batch 1): its boundaries; ``position_ids`` is not read.
    - otherwise each row is cut where ``position_ids`` is 0 (a padding-free packed row restarts at 0 at each
      document); without ``position_ids`` each row is one document. Positions inside a document must count up
      from 0 by one (over the real tokens), else a ValueError names the first token that does not.
    - ``attention_mask`` (B, S) of 0/1: tokens at 0 belong to no document and are moved behind the real ones.

    Cost: the pack's validation reads ``cu_seqlens`` once (:func:`dsv4attn.pack_batch`); cutting rows at the
    zeros of ``position_ids`` adds one more read (``torch.nonzero`` learns the number of documents). Nothing here
    runs per layer.
    """
    T = batch * seq
    if cu_seq_lens_q is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q describes one flattened row (batch 1), got a batch of {batch} rows")
        if attention_mask is not None:
            raise ValueError("pass either cu_seq_lens_q (a padding-free packed row) or attention_mask, not both")
        if not isinstance(cu_seq_lens_q, torch.Tensor):
            raise TypeError(f"cu_seq_lens_q must be a torch.Tensor, got {type(cu_seq_lens_q).__name__}")
        cu = cu_seq_lens_q.to(device=device, dtype=torch.int32)
        max_len = None if max_length_q is None else int(max_length_q)
        pack = pack_batch(cu, T, max_seqlen=max_len)
        return PackedRows(pack, None, None, pack.row_position.view(batch, seq))

    real = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, seq):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must be a 2-D (batch, seq) = ({batch}, {seq}) padding mask of 0/1 "
                             f"(4-D or dict masks are not supported by the dsv4attn path), got {got}")
        real = attention_mask.to(device=device) != 0
    if position_ids is None and real is None:           # one document per row: nothing to derive, no extra read
        cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq
        pack = pack_batch(cu, T, max_seqlen=seq)
        return PackedRows(pack, None, None, pack.row_position.view(batch, seq))

    if position_ids is None:                                            # each row's real tokens: one document
        pos = (real.long().cumsum(1) - 1).clamp(min=0)
    else:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != seq \
                or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"position_ids must have shape ({batch}, {seq}) or (1, {seq}), got "
                             f"{tuple(getattr(position_ids, 'shape', ()))}")
        pos = position_ids.to(device=device, dtype=torch.long).expand(batch, seq)
    flat_pos = pos.reshape(T)
    token_row = torch.arange(T, device=device) // seq
    if real is None:
        order = inverse = None
        pos_c, row_c, n_real = flat_pos, token_row, torch.tensor(T, device=device)
        real_c = torch.ones(T, dtype=torch.bool, device=device)
    else:
        flat_real = real.reshape(T)
        # Stable: real tokens keep their order (row by row), padding goes behind them as capacity padding.
        order = torch.argsort((~flat_real).to(torch.int8), stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(T, device=device)
        pos_c, row_c, real_c = flat_pos[order], token_row[order], flat_real[order]
        n_real = flat_real.sum()
    is_start = real_c & (pos_c == 0)
    # A real token continues its document iff it follows a real token of the same row at position p - 1.
    follows = torch.zeros_like(real_c)
    follows[1:] = real_c[:-1] & (row_c[1:] == row_c[:-1]) & (pos_c[1:] == pos_c[:-1] + 1)
    bad = real_c & ~is_start & ~follows
    starts = torch.nonzero(is_start).flatten()                          # the read that learns N
    cu = torch.cat([starts, n_real.view(1)]).to(torch.int32)
    # Poison cu_seqlens[0] where a position is inconsistent, so the pack's own single read also reports it
    # (no extra read on the good path); the error is then explained below.
    cu = cu + torch.nn.functional.pad(bad.any().view(1).to(torch.int32), (0, cu.shape[0] - 1))
    try:
        pack = pack_batch(cu, T)
    except ValueError:
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            token = int(order[i]) if order is not None else i
            b, s = divmod(token, seq)
            what = "position_ids" if position_ids is not None else "positions"
            raise ValueError(
                f"{what}[{b}, {s}] = {int(flat_pos[token])}: a document must start at position 0 and count up by "
                f"1 over its real tokens (a padding-free packed row restarts at 0 at each document); offsets such "
                f"as a continued sequence need a KV cache, which the dsv4attn path does not train with") from None
        raise
    positions = pack.row_position if inverse is None else pack.row_position.index_select(0, inverse)
    return PackedRows(pack, order, inverse, positions.view(batch, seq))


# ------------------------------------------------------------------------------------------------ the model
def _forward_names(module: nn.Module) -> list[str]:
    """Positional parameter names of the model's forward (after ``self``)."""
    params = inspect.signature(type(module).forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds][1:]


def _model_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of each patched ``DeepseekV4Model``: builds the forward's :class:`PackedRows` once and hands
    it to every attention layer on the ``position_ids`` tensor they all receive (and, under gradient
    checkpointing, receive again in the recomputation). Stateless (reads only ``module``), so deep copies and
    pickles of a patched model keep working."""
    names = _forward_names(module)
    if len(args) > len(names):
        return None                                     # not a call we understand: transformers will raise
    kw = dict(kwargs)
    kw.update(zip(names, args))
    cache = kw.get("cache", kw.get("past_key_values"))
    if cache is not None or kw.get("use_cache") is True:
        _check_cache_call(module, kw)
        return None                                     # transformers' attention runs (see _DSV4Attention)
    ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None or ref.dim() < 2:
        return None                                     # transformers raises its own error
    batch, seq = ref.shape[0], ref.shape[1]
    rows = packed_rows(batch, seq, ref.device, position_ids=kw.get("position_ids"),
                       attention_mask=kw.get("attention_mask"), cu_seq_lens_q=kw.get("cu_seq_lens_q"),
                       max_length_q=kw.get("max_length_q"))
    setattr(rows.position_ids, _BATCH_ATTR, rows)
    kw["position_ids"] = rows.position_ids
    # The layers take padding from the pack; a one-entry dict skips transformers' (B, 1, S, S) eager mask, the
    # one O(S^2) tensor of the forward (the model passes a dict's entry through as prebuilt).
    kw["attention_mask"] = {"sliding_attention": None}
    kw["use_cache"] = False                 # the config's default use_cache=True would build an unused cache
    return (), kw


def _check_cache_call(module: nn.Module, kw: dict) -> None:
    """A forward with a KV cache: inference only, and never on packed rows (transformers' attention would let the
    documents see each other)."""
    if module.training and torch.is_grad_enabled():
        raise ValueError("dsv4attn trains without a KV cache: pass use_cache=False (and no cache) to a training "
                         "forward of a model patched by dsv4attn.integrations.transformers.apply")
    position_ids = kw.get("position_ids")
    if kw.get("cu_seq_lens_q") is not None or (
            kw.get("attention_mask") is None and isinstance(position_ids, torch.Tensor)
            and position_ids.dim() == 2 and position_ids.shape[1] > 1 and bool((position_ids[:, 1:] == 0).any())):
        raise ValueError("packed rows (position_ids restarting at 0, or cu_seq_lens_q) with a KV cache are not "
                         "supported: the cached path runs transformers' attention, which mixes the documents; run "
                         "packed rows with use_cache=False")


# ------------------------------------------------------------------------------------------------ the layer
class _DSV4Attention(_hf.DeepseekV4Attention):
    """A ``DeepseekV4Attention`` whose forward is dsv4attn's (the class an instance gets from :func:`apply`; it
    adds no parameters or buffers). Without a KV cache: ``HybridAttention`` on the forward's pack, with this
    module's parameters and phase. With a cache: transformers' own forward."""

    def forward(self, hidden_states, position_embeddings=None, position_ids=None, attention_mask=None,
                cache=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if cache is not None:
            return super().forward(hidden_states, position_embeddings, position_ids, attention_mask, cache=cache,
                                   **kwargs)
        rows = getattr(position_ids, _BATCH_ATTR, None)
        if rows is None:
            # Called outside a patched model's forward (e.g. a decoder layer on its own): build the batch here and
            # leave it on position_ids for the next layers. A 4-D mask cannot be read back into documents.
            if isinstance(attention_mask, torch.Tensor):
                raise ValueError("a DeepseekV4Attention patched by dsv4attn needs the batch from the patched "
                                 "model's forward (or position_ids alone); it cannot read a prebuilt 4-D mask")
            batch, seq = hidden_states.shape[0], hidden_states.shape[1]
            rows = packed_rows(batch, seq, hidden_states.device, position_ids=position_ids,
                               cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), max_length_q=kwargs.get("max_length_q"))
            if isinstance(position_ids, torch.Tensor):
                setattr(position_ids, _BATCH_ATTR, rows)
        layer = self._dsv4attn_sync()
        y = layer(rows.to_packed(hidden_states), pack=rows.pack, phase=self.dsv4attn_phase)
        return rows.from_packed(y, hidden_states.shape), None

    @property
    def dsv4attn_layer(self) -> HybridAttention:
        """The dsv4attn layer that computes this module (its parameters are this module's)."""
        return self.__dict__[_LAYER_KEY]

    @property
    def indexer_loss(self) -> torch.Tensor | None:
        """Detached indexer loss of this layer's last training step (None for ratios 0 / 128, in eval mode and
        after a forward that raised); in the sparse phase its backward writes it (read it after ``backward()``)."""
        return self.dsv4attn_layer.indexer_loss

    def _dsv4attn_sync(self) -> HybridAttention:
        """The hidden layer, pointed at this module's current parameter objects (``module.to(...)`` may replace
        them when conversion swaps tensors) and in this module's train / eval mode."""
        layer = self.dsv4attn_layer
        for owner, leaf, hf_owner, hf_leaf in layer._dsv4attn_links:
            p = hf_owner._parameters[hf_leaf]
            if leaf in getattr(owner, "_fp32_params", ()) and p.dtype not in (torch.float32, torch.float64):
                # Sinks and positional biases are fp32 in dsv4attn (decision 11); transformers keeps them fp32 when
                # loading in bf16, but model.to(torch.bfloat16) casts them. Feed an fp32 copy (differentiable:
                # the gradient reaches the bf16 parameter) in the parameter's place for this forward.
                owner._parameters.pop(leaf, None)
                owner.__dict__[leaf] = p.float()
            else:
                owner.__dict__.pop(leaf, None)
                if owner._parameters.get(leaf) is not p:
                    owner._parameters[leaf] = p
        if layer.training != self.training:
            layer.train(self.training)
        return layer


def _hidden_layer(attn: nn.Module, cfg: AttentionConfig, ratio: int) -> HybridAttention:
    """A HybridAttention whose parameters *are* ``attn``'s (HF names, decision 12), built without allocating."""
    with torch.device("meta"):
        layer = HybridAttention(cfg, ratio)
    layer._inv_freq = layer_rope_frequencies(cfg, ratio)          # host-computed table (meta while built)
    links = []
    to_hf, _ = name_tables(ratio)
    for native, hf_name in to_hf.items():
        owner_path, _, leaf = native.rpartition(".")
        hf_path, _, hf_leaf = hf_name.rpartition(".")
        owner = layer.get_submodule(owner_path)
        hf_owner = attn.get_submodule(hf_path)
        ours, theirs = owner._parameters[leaf], hf_owner._parameters[hf_leaf]
        if ours.shape != theirs.shape:
            raise ValueError(f"{hf_name} of layer {attn.layer_idx} has shape {tuple(theirs.shape)}, dsv4attn "
                             f"expects {tuple(ours.shape)} for this config")
        owner._parameters[leaf] = theirs
        links.append((owner, leaf, hf_owner, hf_leaf))
    left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
    left += [n for m in layer.modules() for n, v in vars(m).items() if isinstance(v, torch.Tensor) and v.is_meta]
    if left:                                                        # a new tensor in HybridAttention.__init__
        raise RuntimeError(f"dsv4attn integration: {left} of HybridAttention not linked to the HF module")
    layer._dsv4attn_links = links
    layer.train(attn.training)
    return layer


def _models(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _hf.DeepseekV4Model)]


def _attentions(model: nn.Module) -> list[_DSV4Attention]:
    return [m for m in model.modules() if isinstance(m, _DSV4Attention)]


def apply(model: nn.Module, *, phase: str = "sparse", indexer_loss_coeff: float | None = None) -> nn.Module:
    """Patch a transformers DeepseekV4 model (``DeepseekV4ForCausalLM``, ``DeepseekV4Model`` or any module holding
    one) in place so that every ``DeepseekV4Attention`` runs through dsv4attn; returns ``model``.

    Args:
        phase: ``"sparse"`` (default: top-k compressed attention, what transformers computes), ``"warmup"`` or
            ``"dense"`` (docs/semantics.md, decision 8); change it later with :func:`set_phase`.
        indexer_loss_coeff: weight of the indexer KL loss (default :class:`dsv4attn.AttentionConfig`'s, 0.01);
            in training the loss rides in each CSA layer's backward (attached to its output; in the sparse phase
            formed by the attention's backward), so the model's own loss trains the indexer (:func:`indexer_loss`
            reads its value after the backward).

    The parameters stay the modules' own (shared with the dsv4attn layers, never copied): state-dict keys, the
    optimizer's parameter list, ``save_pretrained`` and ``from_pretrained`` (which gives an unpatched model: call
    ``apply`` again) are unchanged. Calling ``apply`` again on a patched model only updates ``phase`` and, if
    given, ``indexer_loss_coeff``. Raises a TypeError for a model without a DeepseekV4Model and a ValueError for a
    config dsv4attn does not compute (compress rates other than 4 / 128, attention dropout).
    """
    phase = check_phase(phase)
    models = _models(model)
    if not models:
        raise TypeError(f"apply needs a transformers DeepseekV4 model (DeepseekV4ForCausalLM / DeepseekV4Model), "
                        f"got {type(model).__name__}")
    for base in models:
        config = base.config
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(f"attention_dropout={config.attention_dropout} is not supported by dsv4attn (no "
                             f"dropout on attention probabilities); set it to 0")
        overrides = {} if indexer_loss_coeff is None else {"indexer_loss_coeff": indexer_loss_coeff}
        cfg = AttentionConfig.from_hf(config, **overrides)
        for module in base.modules():
            if not isinstance(module, _hf.DeepseekV4Attention):
                continue
            if isinstance(module, _DSV4Attention):
                if indexer_loss_coeff is not None:
                    module.dsv4attn_layer.config = cfg
            else:
                layer = _hidden_layer(module, cfg, cfg.compress_ratios[module.layer_idx])
                module.__class__ = _DSV4Attention
                module.__dict__[_LAYER_KEY] = layer
            module.dsv4attn_phase = phase
        if _HOOK_KEY not in base.__dict__:
            base.__dict__[_HOOK_KEY] = base.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)
    return model


def is_applied(model: nn.Module) -> bool:
    """Whether ``model`` holds attention modules patched by :func:`apply`."""
    return bool(_attentions(model))


def _patched(model: nn.Module) -> list[_DSV4Attention]:
    layers = _attentions(model)
    if not layers:
        raise ValueError("the model is not patched: call dsv4attn.integrations.transformers.apply(model) first")
    return layers


def set_phase(model: nn.Module, phase: str) -> None:
    """Set the phase of every patched attention layer: ``"dense"`` (CSA attends to every visible compressed entry,
    the indexer gets zero gradients), ``"warmup"`` (top-k attention, indexer trained against the dense teacher),
    ``"sparse"`` (top-k, sparse teacher). Only CSA (ratio-4) layers depend on it; it applies from the next
    forward and keeps the optimizer state."""
    phase = check_phase(phase)
    for layer in _patched(model):
        layer.dsv4attn_phase = phase


def get_phase(model: nn.Module) -> str:
    """The phase of the patched layers (a ValueError if they differ)."""
    phases = {layer.dsv4attn_phase for layer in _patched(model)}
    if len(phases) != 1:
        raise ValueError(f"the patched layers have different phases: {sorted(phases)}")
    return phases.pop()


def indexer_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the CSA layers' indexer losses of the last training forward (detached, for logging), or None when no
    layer computed one (eval mode, no CSA layer, or no forward yet). It is already part of the backward: each
    layer's loss rides in the backward of its output (attached to it; in the sparse phase formed by the attention's
    backward, which also writes the value: read it after ``backward()``), so ``outputs.loss.backward()`` (and the HF
    Trainer) train the indexer. Value: ``indexer_loss_coeff * sum of KL / real tokens of the batch`` per layer (the
    dense phase gives 0)."""
    losses = [layer.indexer_loss for layer in _patched(model) if layer.indexer_loss is not None]
    if not losses:
        return None
    return torch.stack([loss.to(losses[0].dtype) for loss in losses]).sum()
