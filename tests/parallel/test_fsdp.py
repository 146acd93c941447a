"""FSDP2 (``fully_shard`` per layer, DTensor parameters) on the CPU: gloo, 2 spawned processes, one spawn.

- A decoder of HybridAttention layers (ratios 0, 4, 128) in float64, sharded by ``dsv4attn.parallel.fsdp.
  shard_model`` (each attention layer, each block, the root): three AdamW steps (dense, warm-up, sparse phases),
  rank r on batch r. Each step's loss, every gradient (gathered) and every parameter after the step equal one
  process doing the same steps on both batches (gradients averaged over them, as data parallelism does). Twice:
  all float64 (one unit per layer), and with the sinks and biases stored in fp32 (each layer split in two
  units; the dense and sparse steps: the idle indexer, then every module).
- Under a bf16 MixedPrecisionPolicy the forward sees the sinks and positional biases in fp32 and the other
  parameters in bf16 (forward pre-hooks record what each module holds when it runs); the sharded parameters
  stay fp32, a step trains. A model *stored* in bf16 (sinks and biases fp32 by the layers' cast rule) shards
  too, where a single unit per layer would mix two dtypes (FSDP2 refuses that).
- The full-state helpers: gathered state dicts equal the single-process ones; loading them back into another
  sharded model gives equal parameters and optimizer state; ``gathered`` lets code outside ``forward``
  (``indexer_inputs``) read the layers.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from dsv4attn.train.model import DecoderLM, lm_loss, model_config
from tests.spawned_ranks import run_ranks

T = 256
CU = torch.tensor([0, 30, 161, 256], dtype=torch.int32)        # a document long enough for an HCA entry
MAX_SEQLEN = 131


def _model(dtype=torch.float64, fp32_kept=False):
    """The test decoder in ``dtype``; ``fp32_kept``: its sinks and positional biases stored in fp32 (a layer of
    two dtypes: shard_model must split it; the ops take fp32 sinks and biases with fp64 activations)."""
    torch.manual_seed(0)
    model = DecoderLM(model_config("tiny", (0, 4, 128), indexer_loss_coeff=0.3))
    with torch.no_grad():                  # non-trivial fp32 parameters, so that their gradients matter
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.normal_(0.0, 0.5)
    model = model.to(dtype).train()
    if fp32_kept:
        from dsv4attn.parallel.fsdp import fp32_parameters
        for p in fp32_parameters(model).values():
            p.data = p.data.float()
    return model


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randint(0, 256, (T,), generator=g)
    targets = torch.randint(0, 256, (T,), generator=g)
    return tokens, targets


def _loss(model, rank, phase):
    tokens, targets = _batch(rank)
    return lm_loss(model(tokens, CU, MAX_SEQLEN, phase), targets, T)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _step_equals_one_process(ref, sharded, opts, loss_of, world, rank, phase, tol, where, params_after):
    """One step of ``phase``: ``sharded`` on rank ``rank``'s batch against ``ref`` (one process) on every rank's
    batch with its gradients averaged: the loss, every gradient (an idle indexer's exactly zero), then both
    optimizers step; ``params_after``: every parameter after the step equal too."""
    losses = []
    for r in range(world):                  # the indexer loss feeds gradient 1 per forward
        loss = loss_of(ref, r, phase)
        loss.backward()
        losses.append(loss.detach())
    for p in ref.parameters():
        p.grad /= world
    loss = loss_of(sharded, rank, phase)
    loss.backward()
    got_loss = loss.detach().clone()
    dist.all_reduce(got_loss)
    torch.testing.assert_close(got_loss / world, torch.stack(losses).mean(), **tol,
                               msg=lambda m: f"{where} loss: {m}")
    want = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), want[name].grad, **tol,
                                   msg=lambda m: f"{where} grad {name}: {m}")
        if phase == "dense" and ".indexer." in name:
            assert not p.grad.full_tensor().any(), f"{where}: idle indexer {name} got a gradient"
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)
    if params_after:
        for name, p in sharded.named_parameters():
            assert p.dtype == want[name].dtype, name
            torch.testing.assert_close(p.full_tensor(), want[name].detach(), **tol,
                                       msg=lambda m: f"{where} parameter {name} after the step: {m}")


def _check_equals_one_process(world, rank, fp32_kept=False):
    from dsv4attn.parallel.fsdp import full_optimizer_state_dict, full_state_dict, shard_model
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    ref, sharded = _model(fp32_kept=fp32_kept), _model(fp32_kept=fp32_kept)
    shard_model(sharded, units=sharded.blocks)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    # Two units per layer exactly when it stores two dtypes (the projections' group, the layer's fp32 unit).
    assert all(isinstance(l.q_a_proj, FSDPModule) == fp32_kept for l in sharded.attention_layers())
    opt_ref, opt = _optimizer(ref), _optimizer(sharded)
    tol = dict(rtol=1e-10, atol=1e-12)
    # The split layers: the idle indexer (dense) and every module running (sparse) are enough (test time).
    for phase in ("dense", "sparse") if fp32_kept else ("dense", "warmup", "sparse"):
        _step_equals_one_process(ref, sharded, (opt_ref, opt), _loss, world, rank, phase, tol,
                                 f"{phase} rank {rank}{' fp32 kept' if fp32_kept else ''}", params_after=True)
    # The gathered state dicts are the unsharded ones (same keys, order, shapes, dtypes; values to rounding).
    full, own = full_state_dict(sharded), ref.state_dict()
    assert list(full) == list(own)
    for k in own:
        assert full[k].dtype == own[k].dtype and not isinstance(full[k], DTensor), k
        torch.testing.assert_close(full[k], own[k], **tol)
    opt_full, opt_own = full_optimizer_state_dict(opt), opt_ref.state_dict()
    assert opt_full["param_groups"] == opt_own["param_groups"]
    assert opt_full["state"].keys() == opt_own["state"].keys()
    for k, entry in opt_own["state"].items():
        for name, v in entry.items():
            torch.testing.assert_close(opt_full["state"][k][name], v, **tol)
    return ref, opt_ref


def _check_load_full_state(ref, opt_ref):
    """A fresh sharded model and optimizer given the single process's full dicts continue exactly like it."""
    from dsv4attn.parallel.fsdp import (full_optimizer_state_dict, full_state_dict, load_full_optimizer_state_dict,
                                        load_full_state_dict, shard_model)
    model = shard_model(_model())
    opt = _optimizer(model)
    load_full_state_dict(model, ref.state_dict())
    load_full_optimizer_state_dict(opt, opt_ref.state_dict())
    got = full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    got_opt = full_optimizer_state_dict(opt)
    for k, entry in opt_ref.state_dict()["state"].items():
        for name, v in entry.items():
            assert torch.equal(got_opt["state"][k][name], v), (k, name)
    # A layer's Hugging Face state dict: exported gathered, loaded into the shards (here: the trained layer's
    # values into a fresh sharded model's layer, both ways full tensors).
    from dsv4attn.checkpoints import to_hf_state_dict
    fresh = shard_model(_model())
    for layer, trained in zip(fresh.attention_layers(), ref.attention_layers()):
        hf = to_hf_state_dict(trained)
        layer.load_hf_state_dict(hf)
        got = to_hf_state_dict(layer)
        assert got.keys() == hf.keys() and all(torch.equal(got[k], hf[k]) for k in hf)
    # The debug value checks scan sharded parameters too (same decision on every rank).
    import dsv4attn
    with dsv4attn.checks.checks("values"):
        assert torch.isfinite(_loss(fresh, 0, "sparse"))


def _check_bf16_policy(rank):
    """Forward pre-hooks record the dtype each module's parameters have when it runs (FSDP's own pre-hook, which
    gathers and casts them, was registered first)."""
    from dsv4attn.layers import HybridAttention
    from dsv4attn.parallel.fsdp import fp32_parameters, gathered, shard_model
    from torch.distributed.fsdp import MixedPrecisionPolicy
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_model(_model(torch.float32), mp_policy=bf16)
    kept = set(fp32_parameters(model))
    # 3 sinks, the compressors' biases of the ratio-4 and ratio-128 layers, the ratio-4 indexer's compressor's
    assert {k.rsplit(".", 1)[1] for k in kept} == {"sinks", "position_bias"} and len(kept) == 6
    seen = {}

    def record(prefix):
        def hook(module, args):
            for name, p in module.named_parameters(recurse=False):
                seen.setdefault(f"{prefix}.{name}" if prefix else name, set()).add(p.dtype)
        return hook
    for prefix, m in model.named_modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(record(prefix))
    opt = _optimizer(model)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    for phase in ("dense", "sparse"):        # the idle indexer first (its unit still reduces), then all
        loss = _loss(model, rank, phase)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert set(seen) == {n for n, _ in model.named_parameters()}, set(before) - set(seen)
    for name, dtypes in seen.items():
        want = torch.float32 if name in kept else torch.bfloat16
        assert dtypes == {want}, (name, dtypes)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name                       # the sharded masters stay fp32
        assert not torch.equal(p.full_tensor(), before[name]) or ".indexer." in name, f"{name} did not train"
    # Code outside forward: gathered() gives it the full parameters (in the gathered dtype).
    layer = next(m for m in model.modules() if isinstance(m, HybridAttention) and m.indexer is not None)
    import dsv4attn
    pack = dsv4attn.pack_batch(CU, T, MAX_SEQLEN)
    with gathered(layer), torch.no_grad():
        seen_inputs = layer.indexer_inputs(torch.randn(T, 128, dtype=torch.bfloat16), pack)
        assert layer.sinks.dtype == torch.float32 and layer.q_a_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(seen_inputs["outside_lse"]).all()
    assert isinstance(layer.sinks, torch.distributed.tensor.DTensor)       # resharded on exit
    # A model stored in bf16: its sinks and biases are fp32 by the layers' cast rule; a single unit per layer
    # would hold two dtypes (FSDP2 refuses), shard_model splits it.
    stored = shard_model(_model(torch.float32).to(torch.bfloat16))
    loss = _loss(stored, rank, "sparse")
    loss.backward()
    for name, p in stored.named_parameters():
        assert p.dtype == (torch.float32 if name in kept else torch.bfloat16), name
        assert p.grad is not None and p.grad.dtype == p.dtype, name


def _worker(rank, world, init_file, result_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(1)
        started = time.monotonic()
        _check_equals_one_process(world, rank, fp32_kept=True)
        ref, opt_ref = _check_equals_one_process(world, rank)
        _check_load_full_state(ref, opt_ref)
        _check_bf16_policy(rank)
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"ok\n{time.monotonic() - started:.1f} s")
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


def test_fsdp2_per_layer_equals_one_process_and_keeps_fp32_params():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker, world, tmp, deadline_s=240)


# ------------------------------------------------------------------------------------- CUDA: NCCL, the kernels
def _gpu_worker(rank, world, init_file, result_dir):
    """FSDP2 on CUDA (NCCL, one GPU per rank, the Triton / Gluon kernels): float32 parameters and activations, so
    that the sharded run and one process on this rank's GPU differ only by the summation order of the gradient
    reduction. Three AdamW steps (dense, warm-up, sparse), rank r on batch r; then a bf16 MixedPrecisionPolicy model
    trains a step with its sinks and positional biases reaching the forward in fp32."""
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        from dsv4attn.parallel.fsdp import fp32_parameters, shard_model
        from torch.distributed.fsdp import MixedPrecisionPolicy
        device = torch.device("cuda", rank)
        cu = CU.to(device)

        def loss_of(model, r, phase):
            tokens, targets = (t.to(device) for t in _batch(r))
            return lm_loss(model(tokens, cu, MAX_SEQLEN, phase), targets, T)

        ref, sharded = _model(torch.float32).to(device), _model(torch.float32).to(device)
        shard_model(sharded, units=sharded.blocks)
        opt_ref, opt = _optimizer(ref), _optimizer(sharded)
        # Parameters after the steps are not compared here: the float atomics' order varies the gradients in their
        # last bits, and AdamW turns such a difference on a near-zero gradient into up to one learning rate. The
        # next phase then starts from parameters up to 6e-4 apart, and its gradients differ by more than summation
        # order (H100, one rank, Triton 3.7.1: 10 warm-up and 5450 sparse gradient elements beyond the bound). So
        # each phase starts the one process from the sharded model's parameters (then none is beyond it on Triton
        # 3.6.0, 3.7.1 or 3.9.0): gradients are compared at equal parameters; the optimizer's sharded step is the
        # CPU test's (float64, exact).
        want = dict(ref.named_parameters())
        for phase in ("dense", "warmup", "sparse"):
            _step_equals_one_process(ref, sharded, (opt_ref, opt), loss_of, world, rank, phase,
                                     dict(rtol=1e-4, atol=1e-6), f"{phase} rank {rank}", params_after=False)
            with torch.no_grad():
                for name, p in sharded.named_parameters():
                    want[name].copy_(p.full_tensor())
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mixed = shard_model(_model(torch.float32).to(device), mp_policy=bf16)
        kept, seen = set(fp32_parameters(mixed)), {}
        for prefix, m in mixed.named_modules():
            def hook(module, args, prefix=prefix):
                for name, p in module.named_parameters(recurse=False):
                    seen[f"{prefix}.{name}" if prefix else name] = p.dtype
            m.register_forward_pre_hook(hook)
        loss = loss_of(mixed, rank, "sparse")
        loss.backward()
        assert torch.isfinite(loss)
        assert all(dtype == (torch.float32 if name in kept else torch.bfloat16) for name, dtype in seen.items())
        assert all(p.grad is not None and p.dtype == torch.float32 for p in mixed.parameters())
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok")
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA GPUs and NCCL")
def test_gpu_fsdp2_equals_one_process():
    """As the CPU test, on every GPU of the machine (up to 2; one GPU still shards through NCCL, world size 1)."""
    world = min(2, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_gpu_worker, world, tmp, deadline_s=300)
