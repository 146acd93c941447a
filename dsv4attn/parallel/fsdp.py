"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models built from dsv4attn layers.

``shard_model(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
units=model.blocks)`` shards every :class:`~dsv4attn.HybridAttention` layer as its own unit, then each module of
``units`` (what is left of it: norms, MLP), then the root. Parameters become DTensors sharded on dim 0 over
``mesh``; each unit all-gathers its parameters before its forward and reduce-scatters (averages) its gradients
after its backward, so one optimizer step over the sharded parameters equals the step of a single process on
the whole batch (or of DDP over the same replicas).

Precision (docs/semantics.md, decision 11): the parameters a module names in ``_fp32_params`` (the attention
sinks, the compressors' positional biases) must reach the forward in fp32 (fp64 in float64 checks) whatever the
policy says. FSDP2 casts every parameter of a unit to its ``param_dtype`` and wants one original dtype per unit,
so a unit that would mix them is split in two: the modules holding only other parameters form one unit
(``fully_shard`` of their list: one all-gather, in the policy's ``param_dtype``) and the remaining fp32
parameters form a second, small unit on the layer itself with ``param_dtype=None`` (gathered and reduced in
their own dtype). Without a low-precision ``param_dtype`` and with one stored dtype, a layer is one unit.

Checkpoints: :func:`full_state_dict` and :func:`full_optimizer_state_dict` gather the full tensors (collectives:
every rank calls them) into exactly the dicts ``model.state_dict()`` / ``optimizer.state_dict()`` give without
FSDP; :func:`load_full_state_dict` and :func:`load_full_optimizer_state_dict` put such dicts back into a sharded
model and its optimizer (no communication: every rank holds the full dicts and keeps its own shard).

Composition: FSDP2 here shards over one data-parallel mesh. With context parallelism (``cp_group``), shard over
each CP rank's data-parallel group (the ranks holding the same CP rank of every replica): the ranks of one CP group
then hold the same shard, and after the backward they sum its local values (``p.grad.to_local()``) over the CP
group, as the training job's ``--fsdp --cp N`` does. With tensor parallelism, shard each TP rank's layers over
its data-parallel group (``--fsdp --tp N``: the TP slices are the tensors FSDP2 shards).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ..layers.common import copy_full_, full_value

__all__ = ["shard_model", "shard_unit", "fp32_parameters", "gathered", "is_sharded_model", "full_state_dict",
           "full_optimizer_state_dict", "load_full_state_dict", "load_full_optimizer_state_dict"]

def fp32_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """{qualified name: parameter} of every parameter that a module of ``module`` names in ``_fp32_params``
    (:class:`dsv4attn.layers.common.KeepFp32Params`): the ones that stay fp32 (fp64) under any cast."""
    found = {}
    for prefix, m in module.named_modules():
        for name in getattr(m, "_fp32_params", ()):
            p = m._parameters.get(name)
            if p is not None:
                found[f"{prefix}.{name}" if prefix else name] = p
    return found


def _as_mesh(mesh_or_group) -> DeviceMesh | None:
    if mesh_or_group is None or isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    return DeviceMesh.from_group(mesh_or_group, _device_type_of(mesh_or_group))


def _device_type_of(group) -> str:
    # The group's backend decides where its collectives run: gloo -> cpu, nccl -> cuda.
    backend = torch.distributed.get_backend(group)
    return "cpu" if backend == "gloo" else "cuda"


def _unit_modules(unit: nn.Module) -> list[nn.Module]:
    """``unit`` and its submodules outside every FSDP unit already made below it (their parameters are taken)."""
    found, stack = [], [unit]
    while stack:
        m = stack.pop()
        found.append(m)
        stack.extend(c for c in reversed(list(m.children())) if not isinstance(c, FSDPModule))
    return found


def shard_unit(unit: nn.Module, mesh=None, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool | None = None) -> nn.Module:
    """``fully_shard(unit, ...)`` such that the fp32-required parameters among the unit's own (those not in a
    unit made earlier) reach the forward in their stored dtype; returns ``unit`` (now an FSDPModule).

    ``mesh``: a 1-D DeviceMesh or a ProcessGroup (its devices: gloo -> cpu, nccl -> cuda); None: the default
    group. When the policy casts (``param_dtype`` is not a full-precision dtype equal to theirs) or the unit
    stores several dtypes, the unit is split as the module docstring says; a module holding both kinds of
    parameters directly cannot be split and raises ValueError.
    """
    mesh = _as_mesh(mesh)
    policy = mp_policy or MixedPrecisionPolicy()
    # Passed only when set, so that fully_shard's own default applies (root units keep their parameters).
    extra = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    modules = _unit_modules(unit)
    keep = {id(p) for m in modules for p in fp32_parameters(m).values()}   # this unit's fp32-required params
    own = [p for m in modules for p in m.parameters(recurse=False)]
    kept = [p for p in own if id(p) in keep]
    others = [p for p in own if id(p) not in keep]
    casts = policy.param_dtype is not None and any(p.dtype != policy.param_dtype for p in kept)
    mixed = len({p.dtype for p in own}) > 1
    if not kept or not others or not (casts or mixed):
        return fully_shard(unit, mesh=mesh, mp_policy=policy, **extra)
    if len({p.dtype for p in kept}) > 1:
        raise ValueError(f"the fp32-required parameters of {type(unit).__name__} have several dtypes "
                         f"{sorted(str(p.dtype) for p in kept)}; FSDP2 gathers one dtype per unit")
    holders = {"fp32": [], "other": []}
    for m in modules:
        direct = list(m.parameters(recurse=False))
        n_kept = sum(id(p) in keep for p in direct)
        if n_kept and n_kept < len(direct):
            raise ValueError(f"{type(m).__name__} holds fp32-required and other parameters side by side; FSDP2 "
                             f"cannot give them different dtypes within one unit (move one kind into a "
                             f"submodule)")
        if direct:
            holders["fp32" if n_kept else "other"].append(m)
    # The root of the split keeps the kind it holds itself (a unit with no parameters of its own keeps the fp32
    # ones: the smaller group); the other kind becomes one grouped unit of the modules that hold it.
    root_kind = "other" if unit in holders["other"] else "fp32"
    grouped_kind = "fp32" if root_kind == "other" else "other"
    full = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=policy.output_dtype,
                                cast_forward_inputs=False)
    policies = {"other": policy, "fp32": full}
    group = [m for m in holders[grouped_kind] if m is not unit]
    fully_shard(group, mesh=mesh, mp_policy=policies[grouped_kind], **extra)
    return fully_shard(unit, mesh=mesh, mp_policy=policies[root_kind], **extra)


def shard_model(model: nn.Module, mesh=None, *, mp_policy: MixedPrecisionPolicy | None = None, units=(),
                reshard_after_forward: bool | None = None) -> nn.Module:
    """Apply FSDP2 to ``model``: every HybridAttention layer as its own unit (:func:`shard_unit`), then each
    module of ``units`` (e.g. the decoder blocks; what their layers left), then ``model`` itself (embedding,
    head, everything else). Returns ``model``; build the optimizer after this call (over the DTensor parameters).

    ``mesh``: 1-D DeviceMesh or ProcessGroup of the data-parallel ranks (None: the default group);
    ``mp_policy``: FSDP2's MixedPrecisionPolicy for every unit (the fp32-required parameters keep fp32, see the
    module docstring); ``reshard_after_forward``: as for ``fully_shard`` (None: FSDP's default).
    """
    from ..layers import HybridAttention
    mesh = _as_mesh(mesh)
    kw = dict(mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for m in list(model.modules()):
        if isinstance(m, HybridAttention) and m is not model:
            shard_unit(m, mesh, **kw)
    for m in units:
        shard_unit(m, mesh, **kw)
    return shard_unit(model, mesh, **kw)


def is_sharded_model(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule is an FSDP2 unit."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextmanager
def gathered(module: nn.Module):
    """Within the block, every FSDP2 unit of ``module`` holds its full (unsharded) parameters, so code that reads
    parameters outside ``module.forward`` (``HybridAttention.indexer_inputs``, probes) sees plain tensors;
    resharded on exit. Collective: every rank of the mesh enters it. A no-op for a model without FSDP."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield module
    finally:
        for m in units:
            m.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered into its full tensor (detached; same names, shapes and
    dtypes as the model without FSDP). Collective: every rank calls it and gets the full dict."""
    return {k: full_value(v).detach() for k, v in model.state_dict().items()}


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every DTensor (the per-parameter moments of sharded parameters) gathered
    into its full tensor: the dict the optimizer of the unsharded model holds. Collective, like
    :func:`full_state_dict`."""
    sd = optimizer.state_dict()
    state = {k: {name: full_value(v) for name, v in entry.items()} for k, entry in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def _local_like(value: torch.Tensor, target: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value`` (a full tensor) as ``target`` holds it, in ``dtype`` (default ``target``'s): this rank's shard
    when ``target`` is a DTensor."""
    value = value.to(device=target.device, dtype=dtype or target.dtype)
    if isinstance(target, DTensor):
        # Every rank holds the full value: take the local shard without communication.
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict (as :func:`full_state_dict` or the unsharded model's ``state_dict()`` gives it;
    every key present, every shape the full one) into ``model``, sharded or not. Raises KeyError / ValueError
    naming the first key that does not fit, before anything is copied."""
    own = model.state_dict()
    for k, target in own.items():
        if k not in state_dict:
            raise KeyError(f"state dict has no {k!r}")
        if tuple(state_dict[k].shape) != tuple(target.shape):
            raise ValueError(f"{k}: shape {tuple(state_dict[k].shape)}, the model's is {tuple(target.shape)}")
    for k, target in own.items():
        copy_full_(target, state_dict[k])


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a full optimizer state dict (:func:`full_optimizer_state_dict`, or the unsharded optimizer's) into
    ``optimizer`` over sharded parameters: each state tensor of a parameter's full shape is sharded like it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for k, entry in state_dict["state"].items():
        p = params[int(k)] if int(k) < len(params) else None
        state[k] = {name: (_local_like(v, p, v.dtype) if p is not None and isinstance(v, torch.Tensor)
                           and isinstance(p, DTensor) and tuple(v.shape) == tuple(p.shape) else v)
                    for name, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
