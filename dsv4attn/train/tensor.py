"""Tensor parallelism in the training job (``--tp``): which parameters are sharded, the global gradient norm, and
the full-format checkpoint state.

The attention layers of a ``--tp N`` model are built with the TP group (:mod:`dsv4attn.parallel.tensor`): each
holds ``1 / N`` of ``q_b_proj``, ``sinks``, ``o_a_proj`` and ``o_b_proj`` (``HybridAttention.tp_sharded`` names
them and the dim they are split along); every other parameter of the model is whole, with the same value and the
same gradient on every TP rank. So:

- the gradient norm is ``sqrt(sum over sharded of |g|^2 summed over the TP group + sum over replicated of |g|^2)``,
  replicated parameters counted once (:func:`clip_grad_norm`), and every TP rank clips by the same factor;
- a checkpoint holds the full tensors, as a ``--tp 1`` run writes them: the sharded weights and their AdamW
  moments are gathered over the TP group (:func:`full_state`), and a resume cuts this rank's slices out of them
  (:func:`local_state`), so a run may resume with another ``--tp``.

Without TP layers every function here is the identity (or torch's own clip).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..layers import HybridAttention
from ..layers.common import is_sharded


def sharded_parameters(model: torch.nn.Module) -> dict[str, tuple[object, int]]:
    """``{parameter name in model.state_dict(): (the layer's TensorParallel, split dim)}`` of every sharded
    parameter (empty without TP layers)."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, HybridAttention) and module.tp.world > 1:
            for name, dim in module.tp_sharded.items():
                found[f"{prefix}.{name}" if prefix else name] = (module.tp, dim)
    return found


def full_numel(model: torch.nn.Module) -> int:
    """Parameters of the whole model (sharded ones counted at their full size)."""
    sharded = sharded_parameters(model)
    return sum(p.numel() * (sharded[n][0].world if n in sharded else 1) for n, p in model.named_parameters())


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global 2-norm of the gradients (0-d, the same on every TP rank), clipping them to ``max_norm`` when it is
    > 0 as ``torch.nn.utils.clip_grad_norm_`` does (factor ``min(1, max_norm / (norm + 1e-6))``).

    Sharded parameters' squared norms are summed over the TP group (one all-reduce of one number); replicated ones
    are whole on every rank and counted once. Without TP layers: torch's own clip (or norm)."""
    sharded = sharded_parameters(model)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    grads = [p.grad for _, p in params]
    if not sharded:
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_([p for _, p in params], max_norm)
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if not grads:                               # the same on every TP rank: they run the same layers
        return torch.zeros(())
    groups = {id(tp.group): tp.group for tp, _ in sharded.values()}
    if len(groups) != 1:
        raise ValueError("clip_grad_norm: the model's attention layers use different TP groups")
    group = next(iter(groups.values()))
    # Under FSDP2 every gradient is this rank's shard of it (a DTensor over the data-parallel ranks): its squares
    # are summed over those ranks too.
    fsdp = next((g.device_mesh.get_group() for g in grads if is_sharded(g)), None)
    grads = [g.to_local() if is_sharded(g) else g for g in grads]
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    squares = torch.zeros(2, dtype=dtype, device=grads[0].device)   # this rank's TP shards, replicated parameters
    for (name, _), g in zip(params, grads):
        squares[0 if name in sharded else 1] += g.detach().to(dtype).square().sum()
    if fsdp is not None:
        dist.all_reduce(squares, group=fsdp)
    own, whole = squares[0].clone(), squares[1]
    dist.all_reduce(own, group=group)
    total = (own + whole).sqrt()
    if max_norm > 0:
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return total


def _state_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict[int, str]:
    """``{index in state['param_groups'][*]['params']: parameter name}`` (a state_dict numbers the parameters in
    the order of ``optimizer.param_groups``)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for live, saved in zip(optimizer.param_groups, state["param_groups"]):
        for p, index in zip(live["params"], saved["params"]):
            out[index] = name_of[id(p)]
    return out


def _moments(entry: dict):
    """The per-element tensors of one parameter's AdamW state (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)."""
    return [k for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0]


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict | None = None,
               state: dict | None = None) -> tuple[dict, dict]:
    """(weights, optimizer state) of the whole model, in the layout a ``--tp 1`` run saves: every sharded weight
    and its AdamW moments all-gathered over the TP group (collective over it; every rank of the group gets them).
    ``weights`` / ``state``: this rank's dicts when already formed (under FSDP2, gathered over the data-parallel
    ranks first); default ``model.state_dict()`` / ``optimizer.state_dict()``."""
    sharded = sharded_parameters(model)
    weights = dict(model.state_dict() if weights is None else weights)
    for name, (tp, dim) in sharded.items():
        weights[name] = tp.gather(weights[name], dim)
    state = optimizer.state_dict() if state is None else state
    names = _state_names(model, optimizer, state)
    entries = dict(state["state"])
    for index in sorted(names):
        name = names[index]
        if name not in sharded or index not in entries:
            continue
        tp, dim = sharded[name]
        entry = dict(entries[index])
        for key in _moments(entry):
            entry[key] = tp.gather(entry[key], dim)
        entries[index] = entry
    return weights, {**state, "state": entries}


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optimizer_state: dict
                ) -> tuple[dict, dict]:
    """The full ``weights`` and ``optimizer_state`` of a checkpoint cut to this rank's slices of the sharded
    parameters (no communication). A tensor whose size along the split dim is not the full one is left as it is,
    for the shape check of the load to name."""
    sharded = sharded_parameters(model)
    if not sharded:
        return weights, optimizer_state
    own = model.state_dict()

    def cut(t, name):
        tp, dim = sharded[name]
        full = tp.full_shape(own[name].shape, dim)
        return tp.shard(t, dim).clone() if tuple(t.shape) == full else t

    weights = {k: cut(v, k) if k in sharded else v for k, v in weights.items()}
    state = optimizer_state
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
            and isinstance(state.get("param_groups"), list)):
        return weights, state
    try:
        names = _state_names(model, optimizer, state)
    except (KeyError, TypeError):
        return weights, state                   # the optimizer load names what does not fit
    entries = dict(state["state"])
    for index, name in names.items():
        if name in sharded and index in entries:
            entry = dict(entries[index])
            for key in _moments(entry):
                entry[key] = cut(entry[key], name)
            entries[index] = entry
    return weights, {**state, "state": entries}


def check_split(num_heads: int, o_groups: int, tp: int) -> str | None:
    """Why ``--tp tp`` cannot split a model with these heads and output groups, or None."""
    bad = [f"{what} ({n})" for what, n in (("num_attention_heads", num_heads), ("o_groups", o_groups)) if n % tp]
    if not bad:
        return None
    fits = [w for w in range(1, math.gcd(num_heads, o_groups) + 1) if math.gcd(num_heads, o_groups) % w == 0]
    return (f"--tp {tp} must divide the attention heads and output groups of the model, but "
            f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of {tp}; this model allows "
            f"--tp {', '.join(map(str, fits))}")
