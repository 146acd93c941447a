"""``--cuda-graphs``: the forward and backward of a training step captured in CUDA graphs, replayed for every batch.

A graph replays the same kernels on the same memory, so every batch reaches it through fixed buffers of fixed
shapes (docs/packing.md, "Under CUDA graphs"): the tokens and targets of ``rows`` rows, the target count as a
device scalar, and a pack built with ``num_docs = rows`` (every batch fits: a document has at least one row) that
:meth:`PackedBatch.copy_` refills with each batch's validated pack.

**One graph per (phase, span).** A pack's ``max_seqlen`` sizes the work: the dense and warm-up phases' "every
visible entry" sets hold ``max_seqlen / 4`` slots per query, the HCA layers' ``max_seqlen / 128``, the top-k at
most ``max_seqlen / 4``. One graph per phase would have to take ``max_seqlen = rows`` for every batch: on the
H200, ``--model small --capacity 32768``, that ran the dense phase at 0.15x and the sparse phase at 0.86x the
eager step (BENCHMARKS.md). So a batch goes to the graph of its *span* (:func:`span_of`), the smallest power of
two or 1.5 times a power of two (at least :data:`MIN_SPAN`, at most ``rows``) not below its longest document:
the span-sized work is at most 1.5x the eager step's, and a run captures at most ``2 * log2(rows / MIN_SPAN) + 2``
graphs per phase, in practice the few spans its data reaches.

**Memory.** Every graph draws from one shared pool: they never run concurrently, and the training step reads
what a replay returns (the losses, the gradients) before the next replay, which may overwrite it (so may any
capture's intermediate tensors, such as a layer's ``indexer_loss`` attribute, which is cleared after capture). All
graphs write the same gradient tensors: each zeroes the gradients of the parameters its step trains, then its
backward accumulates into them in place. Parameters an eager backward of that step would not reach get
``.grad = None`` after its replay.

The first batch of each (phase, span) runs one eager step with the gradients set to None (it finds which
parameters that step trains; their eager gradients are freed right after), then, when capturing, one eager step
into the shared gradients (both on a side stream; they build the kernels and the pack's tables) before the capture
records zeroing, forward, loss and backward. Clipping, the finite check and the optimizer step run eagerly after
the replay (:func:`dsv4attn.train.step.train_step`). Autocast runs with its weight-cast cache off (a cached cast
would be a tensor of the capture, stale at replay). One process only: the training job refuses ``--cuda-graphs``
with data, context or tensor parallelism and FSDP.

``capture=False`` runs the same buffers, spans and gradient bookkeeping eagerly (what the CPU tests compare with a
plain run).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..packing import PackedBatch, pack_batch
from .data import IGNORE
from .model import DecoderLM, lm_loss

MIN_SPAN = 128      # the sliding window: shorter spans would only multiply graphs


def span_of(max_seqlen: int, rows: int) -> int:
    """The ``max_seqlen`` a batch whose longest document has ``max_seqlen`` rows is run with: the smallest power
    of two or 1.5 times a power of two (128, 192, 256, 384, 512, 768, ...) not below it, within
    [:data:`MIN_SPAN`, ``rows``]."""
    if max_seqlen <= MIN_SPAN:
        return min(rows, MIN_SPAN)
    power = 1 << (max_seqlen - 1).bit_length()               # the power of two at or above
    return min(rows, power * 3 // 4 if max_seqlen <= power * 3 // 4 else power)


@dataclass
class _Step:
    """The forward + backward of one (phase, span): its graph (None when not capturing), its outputs, and the
    parameters that receive gradients (those an eager backward of the step reaches; the others keep None)."""
    graph: torch.cuda.CUDAGraph | None
    pack: PackedBatch
    trained: list[torch.nn.Parameter]
    loss: torch.Tensor | None = None
    indexer_loss: torch.Tensor | None = None


class GraphedSteps:
    """The forward + backward of training steps over fixed buffers of ``rows`` rows (module docstring)."""

    def __init__(self, model: DecoderLM, rows: int, device: torch.device, capture: bool = True):
        self.model, self.rows, self.device, self.capture = model, rows, device, capture
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.targets = torch.full((rows,), IGNORE, dtype=torch.long, device=device)
        self.num_targets = torch.zeros((), dtype=torch.long, device=device)
        self.packs: dict[int, PackedBatch] = {}                 # span -> its pack, refilled per batch
        self.steps: dict[tuple[str, int], _Step] = {}           # (phase, span) -> its captured step
        self.grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # the gradient tensors every step writes
        self.pool = None
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
                         if device.type == "cuda" else nullcontext())

    @property
    def captured(self) -> list[tuple[str, int]]:
        """The (phase, span) pairs that have a step, in the order they were first met."""
        return list(self.steps)

    def run(self, batch, phase: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LM loss, summed indexer loss or None) of ``batch`` in ``phase``, its gradients left in the model's
        ``.grad``: what :func:`dsv4attn.train.step.loss_and_grads` returns for one process. All of it is valid until
        the next call, which may overwrite it (module docstring, "Memory")."""
        span = self._load(batch)
        key = (phase, span)
        if key not in self.steps:
            self.steps[key] = self._prepared(phase, self.packs[span])
        step = self.steps[key]
        if step.graph is not None:
            step.graph.replay()
        else:
            step.loss, step.indexer_loss = self._zeroed_forward_backward(step, phase)
        self._point_grads(step)
        return step.loss, step.indexer_loss

    def _load(self, batch) -> int:
        """Copy ``batch`` into the buffers and its span's pack; return the span."""
        if batch.tokens.shape[0] != self.rows:
            raise ValueError(f"--cuda-graphs: the batch has {batch.tokens.shape[0]} rows, the captured buffers "
                             f"{self.rows}")
        span = span_of(batch.max_seqlen, self.rows)
        # Validated here, outside any graph (the batch's one host read of its boundaries).
        pack = pack_batch(batch.cu_seqlens, self.rows, span, device=self.device, num_docs=self.rows)
        if span in self.packs:
            self.packs[span].copy_(pack)
        else:
            self.packs[span] = pack
        self.tokens.copy_(batch.tokens)
        self.targets.copy_(batch.targets)
        self.num_targets.fill_(batch.num_targets)
        return span

    def _forward_backward(self, phase: str, pack: PackedBatch):
        with self.autocast:
            logits = self.model(self.tokens, None, None, phase, pack=pack)
            loss = lm_loss(logits, self.targets, self.num_targets)
        loss.backward()
        return loss.detach(), self.model.indexer_loss()

    def _zeroed_forward_backward(self, step: _Step, phase: str):
        """What a step's graph records: its gradients zeroed, then forward and backward accumulating into them
        (a replay writes the same tensors whatever ``.grad`` holds by then; an eager run rebinds them first)."""
        self._point_grads(step)
        for p in step.trained:
            p.grad.zero_()
        return self._forward_backward(phase, step.pack)

    def _point_grads(self, step: _Step) -> None:
        trained = set(step.trained)
        for p in self.model.parameters():
            p.grad = self.grads[p] if p in trained else None

    def _prepared(self, phase: str, pack: PackedBatch) -> _Step:
        """The step of (phase, pack's span): its warm-up and, when capturing, its graph."""
        side = torch.cuda.Stream() if self.capture else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else nullcontext():
            # Which parameters this (phase, span) trains, as an eager backward from None gradients shows (a span may
            # reach parameters another span of the phase does not, e.g. a compressor with no entry of its own).
            self.model.zero_grad(set_to_none=True)
            self._forward_backward(phase, pack)
            trained = [p for p in self.model.parameters() if p.grad is not None]
            self.model.zero_grad(set_to_none=True)
            for p in trained:
                if p not in self.grads:
                    self.grads[p] = torch.zeros_like(p)
            step = _Step(graph=None, pack=pack, trained=trained)
            if side is not None:
                self._zeroed_forward_backward(step, phase)    # builds kernels and tables, accumulating in place
        if side is None:
            return step
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, pool=self.pool):
            step.loss, step.indexer_loss = self._zeroed_forward_backward(step, phase)
        moved = [p for p in step.trained if p.grad is not self.grads[p]]
        if moved:     # the backward replaced a .grad instead of adding into it: replays would train on stale zeros
            raise RuntimeError(f"--cuda-graphs: the captured backward rebound .grad of {len(moved)} parameters "
                               f"instead of accumulating into the shared gradient tensors")
        for layer in self.model.attention_layers():
            layer.indexer_loss = None                         # a tensor of the capture, overwritten by other graphs
        return step
