"""Context parallelism on the CPU (gloo, spawned processes): CP == the single-process run.

One spawn per world size runs every case in its workers (process start-up dominates the cost):
ratios 0/4/128 x phases dense/warmup/sparse in float64 (tight) and one float32 pass, on a pack where documents
straddle ranks, a ratio-4 and a ratio-128 group cross a seam, documents start inside a halo, one document spans
three ranks, with an empty document and capacity padding. Compared: outputs, input gradients, CP-summed parameter
gradients and the (CP-summed) indexer loss. Also the primitives on their own, the too-few-rows error, and the
ranks' agreement on the batch metadata: rank 1 passing other cu_seqlens, cp_partition, phase or max_seqlen, or
failing its own argument checks (a bad phase, a pack of other rows), gives one clear error on every rank and leaves
the group in step, and that error is freed as soon as it is handled (no reference cycle keeps the group alive).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import tempfile
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist

import dsv4attn
from dsv4attn.parallel import gather_rows, left_halo, segments, shard, unshard, with_left_halos
from tests.layers.layer_helpers import forward_backward, spread_parameters_
from tests.spawned_ranks import run_ranks

# Starts 0 1 4 8 13 13 99 399 408 425; 555 real rows, 5 padding rows -> 560 = 2 x 280 = 4 x 140.
LENGTHS = (1, 3, 4, 5, 0, 86, 300, 9, 17, 130)
TOTAL_ROWS = 560


def _pack():
    cu = torch.tensor((0,) + LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    return cu, max(LENGTHS)


def _layer(ratio, dtype, seed=0):
    torch.manual_seed(seed)
    layer = dsv4attn.HybridAttention(dsv4attn.AttentionConfig.tiny(), ratio)
    spread_parameters_(layer)
    return layer.to(dtype).train()


def _check_primitives(group, world, rank):
    rows, width = 6, 3
    x = (torch.arange(world * rows * 2, dtype=torch.float64).view(world * rows, 2) + 1).requires_grad_(False)
    x_local = shard(x, group).clone().requires_grad_(True)
    halo = left_halo(x_local, width, group)
    want = x[rank * rows - width:rank * rows] if rank else x[:0]
    assert torch.equal(halo, want)
    (halo * 2.0).sum().backward()
    grad = torch.zeros(rows, 2, dtype=torch.float64)
    if rank + 1 < world:
        grad[rows - width:] = 2.0
    assert torch.equal(x_local.grad, grad), (rank, x_local.grad)
    x_local.grad = None
    full = unshard(x_local, group)
    assert torch.equal(full, x)
    (full * torch.arange(world * rows, dtype=torch.float64)[:, None]).sum().backward()
    want_grad = float(world) * torch.arange(rank * rows, (rank + 1) * rows, dtype=torch.float64)[:, None]
    assert torch.equal(x_local.grad, want_grad.expand(rows, 2))
    _check_head_tail_primitives(group, world, rank)


def _check_head_tail_primitives(group, world, rank):
    """Head-tail: shard/unshard round trip; each segment gets the rows left of it (from whichever rank holds the
    previous chunk) and the halo gradients come back to their owners."""
    chunk, width = 6, 3
    total = 2 * world * chunk
    x = torch.arange(total * 2, dtype=torch.float64).view(total, 2) + 1
    x_local = shard(x, group, "head_tail").clone().requires_grad_(True)
    spans = segments("head_tail", world, rank, total)
    assert torch.equal(x_local, torch.cat([x[a:b] for a, b in spans]))
    keys = with_left_halos(x_local, width, group, "head_tail")
    key_rows = torch.cat([torch.arange(max(a - width, 0), b) for a, b in spans])
    assert torch.equal(keys, x[key_rows]), (rank, keys)
    (keys * key_rows[:, None].to(keys.dtype)).sum().backward()
    rows = torch.arange(total)
    in_a_halo = ((rows % chunk) >= chunk - width) & (rows < total - chunk)      # left of a later chunk
    want = (rows * (1 + in_a_halo.long())).to(torch.float64)[:, None].expand(total, 2)
    assert torch.equal(x_local.grad, shard(want, group, "head_tail")), (rank, x_local.grad)
    full = unshard(x_local.detach(), group, "head_tail")
    assert torch.equal(full, x)


def _check_parity(group, world, rank, dtype, cases, tol, partition="contiguous"):
    cu, max_len = _pack()
    for ratio, phase in cases:
        layer = _layer(ratio, dtype)
        torch.manual_seed(100 + ratio)
        x = torch.randn(TOTAL_ROWS, 128, dtype=dtype)
        g = torch.randn(TOTAL_ROWS, 128, dtype=dtype)
        y, dx, grads, loss = forward_backward(layer, x, g, phase, cu_seqlens=cu, max_seqlen=max_len)
        y_l, dx_l, grads_l, loss_l = forward_backward(layer, shard(x, group, partition), shard(g, group, partition),
                                                      phase, cu_seqlens=cu, max_seqlen=max_len, cp_group=group,
                                                      cp_partition=partition)
        where = f"ratio {ratio} {phase} {dtype} {partition} rank {rank}/{world}"
        torch.testing.assert_close(y_l, shard(y, group, partition), **tol, msg=lambda m: f"{where} output: {m}")
        torch.testing.assert_close(dx_l, shard(dx, group, partition), **tol,
                                   msg=lambda m: f"{where} input grad: {m}")
        for name, grad in grads_l.items():
            dist.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, grads[name], **tol, msg=lambda m: f"{where} grad {name}: {m}")
        if loss is not None:
            dist.all_reduce(loss_l, group=group)
            torch.testing.assert_close(loss_l, loss, **tol, msg=lambda m: f"{where} indexer loss: {m}")
            if phase != "dense":
                assert float(loss) > 0, where


def _check_too_few_rows(group, world, partition="contiguous"):
    layer = _layer(128, torch.float64)
    x = torch.randn(64 * world, 128, dtype=torch.float64)
    try:
        layer(shard(x, group, partition), cu_seqlens=torch.tensor([0, 64 * world], dtype=torch.int32),
              max_seqlen=64 * world, cp_group=group, cp_partition=partition)
    except ValueError as err:
        return str(err)
    return "no error"


class _Marker:
    pass


def _refused(call) -> str:
    """The message of the ValueError that ``call()`` raises, asserting that the error is freed as soon as it is
    handled (the garbage collector off, so that only reference counts free it). A reference cycle through the
    frames of its traceback kept their locals, the process group among them, alive until a collection: a
    script that caught the error and called ``destroy_process_group()`` then left the gloo group and its worker
    threads running into interpreter exit, and the process died with SIGABRT about one run in 20."""
    gc.disable()
    try:
        try:
            call()
        except ValueError as err:
            message, err.marker = str(err), _Marker()       # an exception takes no weak reference: its marker does
            ref = weakref.ref(err.marker)
        else:
            raise AssertionError("no ValueError raised")
        assert ref() is None, f"the error is kept alive by a reference cycle: {message}"
        return message
    finally:
        gc.enable()


def _check_disagreements(group, world, rank):
    """Rank 1 differs from the others in one thing per case: every rank raises, before any other collective, the
    same ValueError naming the field and each rank's value. Returns {case: message} (the parent compares ranks)."""
    cu, max_len = _pack()
    other_cu = torch.tensor((0,) + (1, 3, 5, 4) + LENGTHS[4:], dtype=torch.int32).cumsum(0).to(torch.int32)
    odd = rank == 1
    cases = {      # case -> (keyword arguments of this rank, what every rank's message must contain)
        "cu_seqlens": (dict(cu_seqlens=other_cu if odd else cu), "ranks disagree on cu_seqlens (rank 0: [0, 1, 4"),
        "cp_partition": (dict(cp_partition="head_tail" if odd else "contiguous"),
                         "cp_partition (rank 0: 'contiguous', rank 1: 'head_tail'"),
        "phase": (dict(phase="dense" if odd else "sparse"), "phase (rank 0: 'sparse', rank 1: 'dense'"),
        "max_seqlen": (dict(max_seqlen=max_len + 1 if odd else max_len),
                       f"max_seqlen (rank 0: {max_len}, rank 1: {max_len + 1}"),
        # A rank whose own checks fail raises its error; the others learn of it instead of waiting.
        "local": (dict(phase="bogus" if odd else "sparse"),
                  "phase must be one of" if odd else "rank(s) 1 of cp_group failed their own argument checks"),
        "rows": (dict(pack=dsv4attn.pack_batch(cu, 2 * TOTAL_ROWS if odd else TOTAL_ROWS, max_len)),
                 "pack must describe the global batch" if odd else "rank(s) 1 of cp_group failed their own"),
    }
    layer = _layer(4, torch.float64)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    x = torch.randn(TOTAL_ROWS, 128, dtype=torch.float64)
    messages = {}
    for case, (kw, expected) in cases.items():
        kw = dict(dict(cu_seqlens=cu, max_seqlen=max_len, phase="sparse", cp_partition="contiguous"), **kw)
        message = _refused(lambda: layer(shard(x, group, kw["cp_partition"]), cp_group=group, **kw))
        assert expected in message, (case, rank, message)
        assert layer.indexer_loss is None
        messages[case] = message
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None, name
    return messages


def _check_cp_packs(group, world, rank):
    """A pack built with cp_group: ``layer(x, pack=pack, phase=...)`` equals the per-call CP run (cu_seqlens=),
    layers of one halo share one frame, another group or partition with the pack raises, a pack the ranks disagree
    on raises on every rank, and a model forward reads the host only to build its pack (not once per layer)."""
    cu, max_len = _pack()
    for partition, cases in (("contiguous", [(0, "sparse"), (4, "warmup"), (4, "sparse"), (128, "sparse")]),
                             ("head_tail", [(4, "sparse")] + ([(128, "sparse")] if world == 2 else []))):
        pack = dsv4attn.pack_batch(cu, TOTAL_ROWS, max_len, cp_group=group, cp_partition=partition)
        for ratio, phase in cases:
            layer = _layer(ratio, torch.float64)
            torch.manual_seed(200 + ratio)
            x, g = torch.randn(TOTAL_ROWS, 128, dtype=torch.float64), torch.randn(TOTAL_ROWS, 128, dtype=torch.float64)
            x, g = shard(x, group, partition), shard(g, group, partition)
            want = forward_backward(layer, x, g, phase, cu_seqlens=cu, max_seqlen=max_len, cp_group=group,
                                    cp_partition=partition)
            got = forward_backward(layer, x, g, phase, pack=pack)
            where = f"CP pack ratio {ratio} {phase} {partition} rank {rank}/{world}"
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, msg=lambda m: f"{where} output: {m}")
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, msg=lambda m: f"{where} input grad: {m}")
            for name in want[2]:
                torch.testing.assert_close(got[2][name], want[2][name], rtol=0, atol=0, msg=lambda m: f"{where} {name}")
        # One frame per distinct halo (tiny(): window 16, so ratios 0 and 4 share 16 rows, ratio 128 needs 128).
        halos = {_layer(r, torch.float64).halo_rows for r, _ in cases}
        assert set(pack._frames) == halos, (set(pack._frames), halos)
        frame = pack._frames[16]
        _layer(0, torch.float64)(x, pack=pack, cp_group=group)            # the pack's own group is fine
        assert pack._frames[16] is frame and set(pack._frames) == halos
    other = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match="cp_group differs from the group the pack was built with"):
        _layer(0, torch.float64)(x, pack=pack, cp_group=other)
    with pytest.raises(ValueError, match="cp_partition='contiguous' differs from the pack's 'head_tail'"):
        _layer(0, torch.float64)(x, pack=pack, cp_partition="contiguous")
    other_cu = cu.clone()
    other_cu[1:4] += 1 if rank == 1 else 0
    with pytest.raises(ValueError, match=r"ranks disagree on cu_seqlens \(rank 0: \[0, 1, 4"):
        dsv4attn.pack_batch(other_cu, TOTAL_ROWS, max_len, cp_group=group)
    # Rank 1's own check fails (561 rows are not equal chunks): its error there, the others name it.
    message = _refused(lambda: dsv4attn.pack_batch(cu, TOTAL_ROWS + (rank == 1), max_len, cp_group=group))
    assert ("total_rows=561 is not" if rank == 1 else "rank(s) 1 of cp_group failed their own") in message, message
    from tests.test_host_reads import HostReads
    from dsv4attn.train.model import DecoderLM, model_config
    torch.manual_seed(0)
    model = DecoderLM(model_config("tiny", ratios=(0, 4, 128, 4, 128))).double()
    tokens = torch.randint(0, 256, (TOTAL_ROWS,))
    with dsv4attn.checks.checks("default"), HostReads() as counted:
        model(tokens, cu, max_len, "sparse", cp_group=group)
    # Building the pack: the validation's read of cu_seqlens and the agreement's read; the 5 layers add none.
    assert dict(counted.reads) == {"tolist": 2} and not counted.scans, (rank, counted.reads, counted.scans)


def _worker(rank, world, init_file, result_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        group = dist.group.WORLD
        torch.set_num_threads(1)
        _check_primitives(group, world, rank)
        # Before the parity checks: after every refused call the ranks are still in step (no stray collective).
        disagreements = _check_disagreements(group, world, rank)
        with open(os.path.join(result_dir, f"rank{rank}.disagree.json"), "w") as f:
            json.dump(disagreements, f)
        cases = [(r, p) for r in (0, 4, 128) for p in ("dense", "warmup", "sparse") if r == 4 or p == "sparse"]
        _check_parity(group, world, rank, torch.float64, cases, dict(rtol=1e-9, atol=1e-11))
        _check_parity(group, world, rank, torch.float32, [(4, "warmup"), (128, "sparse")],
                      dict(rtol=1e-4, atol=2e-5))
        # Head-tail: 2W chunks of 140 (W=2) / 70 (W=4) rows; a 70-row chunk is too narrow for ratio 128's halo.
        balanced = [case for case in cases if world == 2 or case[0] != 128]
        _check_parity(group, world, rank, torch.float64, balanced, dict(rtol=1e-9, atol=1e-11), "head_tail")
        _check_cp_packs(group, world, rank)
        message = _check_too_few_rows(group, world)
        assert "two chunks of 32 rows" in _check_too_few_rows(group, world, "head_tail")
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok\n" + message)
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_context_parallel_equals_single_process(world):
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_ranks(_worker, world, tmp, deadline_s=420)
        agreed = [json.load(open(os.path.join(tmp, f"rank{rank}.disagree.json"))) for rank in range(world)]
        for case in agreed[0]:
            # The same message on every rank, except the failing rank of the "local" and "rows" cases (it raises
            # its own error).
            texts = {r: a[case] for r, a in enumerate(agreed) if not (case in ("local", "rows") and r == 1)}
            assert len(set(texts.values())) == 1, (case, texts)
            if case not in ("local", "rows"):
                assert all(f"rank {r}:" in texts[0] for r in range(world)), texts[0]
        messages = {text.split("\n", 1)[1] for text in reports.values()}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert "too few rows per context-parallel rank" in message and "128" in message


def _absent_peer_worker(rank, world, init_file, result_dir):
    """Rank 1 stays alive but never makes the layer call (it failed in code of its own); rank 0 must stop waiting
    at the group's timeout with an error that says which step waited and why, not only gloo's own text."""
    import time
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=5))
        torch.set_num_threads(1)
        report = "ok"
        if rank == 0:
            cu, max_len = _pack()
            layer = _layer(4, torch.float32)
            x = torch.randn(TOTAL_ROWS // world, 128)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"context parallelism: rank 0 of cp_group waited in vain for the "
                                                   r"other ranks to agree on the batch metadata") as err:
                layer(x, cu_seqlens=cu, max_seqlen=max_len, cp_group=dist.group.WORLD)
            assert "Backend error:" in str(err.value) and layer.indexer_loss is None
            report += f"\n{time.monotonic() - start:.1f}"
        else:
            _alive_until_rank0_reports(result_dir)      # not calling: a rank stuck in its own code
        _report(result_dir, rank, report)
    except Exception:
        _report(result_dir, rank, "error\n" + traceback.format_exc())
        raise


def _alive_until_rank0_reports(result_dir, limit_s: float = 30.0) -> None:
    import time
    done, start = os.path.join(result_dir, "rank0.txt"), time.monotonic()
    while not os.path.exists(done) and time.monotonic() - start < limit_s:
        time.sleep(0.1)


def _report(result_dir, rank, text) -> None:
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(text)


def _failed_peer_with_pack_worker(rank, world, init_file, result_dir):
    """With a pack built with cp_group (no agreement per layer call), rank 1 fails its own check (x of other rows)
    and stays alive; rank 0 must stop waiting at the group's timeout with an error that names the layer's
    collective and the likely cause, not only gloo's own text."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=5))
        torch.set_num_threads(1)
        cu, max_len = _pack()
        pack = dsv4attn.pack_batch(cu, TOTAL_ROWS, max_len, cp_group=dist.group.WORLD)
        layer = _layer(4, torch.float32)
        report = "ok"
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"context parallelism: rank 0 of cp_group waited in vain for the "
                                                   r"other ranks in a layer's all-gather") as err:
                layer(torch.randn(TOTAL_ROWS // world, 128), pack=pack, phase="sparse")
            assert "Backend error:" in str(err.value) and "other rows than its share" in str(err.value)
        else:
            with pytest.raises(ValueError, match="hidden_states"):
                layer(torch.randn(TOTAL_ROWS // world + 1, 128), pack=pack, phase="sparse")
            _alive_until_rank0_reports(result_dir)
        _report(result_dir, rank, report)
    except Exception:
        _report(result_dir, rank, "error\n" + traceback.format_exc())
        raise


def test_a_rank_failing_its_own_check_under_a_cp_pack_ends_the_others_wait_clearly():
    """Before: rank 0 raised gloo's bare timeout text (or 'Connection closed by peer' when rank 1 had exited)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_failed_peer_with_pack_worker, 2, tmp, deadline_s=90)


def test_absent_rank_ends_the_wait_with_a_clear_error():
    """Before: rank 0 raised gloo's bare 'Timed out waiting 15000ms for send operation to complete' (and
    'Connection reset by peer' when the rank had exited), naming neither the CP agreement nor a cause."""
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_ranks(_absent_peer_worker, 2, tmp, deadline_s=90)
        assert float(reports[0].split("\n")[1]) < 30, reports[0]
