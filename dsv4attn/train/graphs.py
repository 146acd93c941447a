"""``--cuda-graphs``: each phase's forward and backward captured once in a CUDA graph, replayed for every batch.

A graph replays the same kernels on the same memory, so every batch reaches it through fixed buffers of fixed
shapes (docs/packing.md, "Under CUDA graphs"): the tokens and targets of ``rows`` rows, the target count as a
device scalar, and one pack built with ``max_seqlen = rows`` and ``num_docs = rows`` (every batch fits: a document
has at least one row) that :meth:`PackedBatch.copy_` refills with each batch's validated pack. The fixed
``max_seqlen`` widens the dense and warm-up phases' "every visible entry" sets to ``rows / 4`` slots per query for
every batch (eager runs size them by the batch's longest document): the price of one graph per phase.

Per phase, the first batch warms up on a side stream (two eager steps, which build the kernels and the pack's
tables), then the capture records forward, loss and backward with the gradients set to None, so the graph writes
them to its own tensors; each replay points the parameters' ``.grad`` back at those. Clipping, the finite check and
the optimizer step run eagerly after the replay (:func:`dsv4attn.train.step.train_step`). Autocast runs with its
weight-cast cache off (a cached cast would be a tensor of the capture, stale at replay). One process only: the
training job refuses ``--cuda-graphs`` with data, context or tensor parallelism and FSDP.

``capture=False`` runs the same buffers and steps eagerly (what the CPU tests compare with a plain run).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..packing import pack_batch
from .data import IGNORE
from .model import DecoderLM, lm_loss


class GraphedSteps:
    """The forward + backward of training steps over fixed buffers of ``rows`` rows (module docstring)."""

    def __init__(self, model: DecoderLM, rows: int, device: torch.device, capture: bool = True):
        self.model, self.rows, self.capture = model, rows, capture
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.targets = torch.full((rows,), IGNORE, dtype=torch.long, device=device)
        self.num_targets = torch.zeros((), dtype=torch.long, device=device)
        self.pack = pack_batch(None, rows, rows, device=device, num_docs=rows)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
                         if device.type == "cuda" else nullcontext())
        self.graphs: dict[str, tuple] = {}      # phase -> (graph, loss, indexer loss, [(param, its grad)])

    def run(self, batch, phase: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LM loss, summed indexer loss or None) of ``batch`` in ``phase``, its gradients left in the model's
        ``.grad``: what :func:`dsv4attn.train.step.loss_and_grads` returns for one process."""
        self._load(batch)
        if not self.capture:
            self.model.zero_grad(set_to_none=True)
            return self._forward_backward(phase)
        if phase not in self.graphs:
            self.graphs[phase] = self._captured(phase)
        graph, loss, indexer_loss, grads = self.graphs[phase]
        graph.replay()
        for p, grad in grads:
            p.grad = grad
        return loss, indexer_loss

    def _load(self, batch) -> None:
        if batch.tokens.shape[0] != self.rows:
            raise ValueError(f"--cuda-graphs: the batch has {batch.tokens.shape[0]} rows, the captured buffers "
                             f"{self.rows}")
        # Validated here, outside any graph (the batch's one host read of its boundaries).
        self.pack.copy_(pack_batch(batch.cu_seqlens, self.rows, self.rows, num_docs=self.rows))
        self.tokens.copy_(batch.tokens)
        self.targets.copy_(batch.targets)
        self.num_targets.fill_(batch.num_targets)

    def _forward_backward(self, phase: str):
        with self.autocast:
            logits = self.model(self.tokens, None, None, phase, pack=self.pack)
            loss = lm_loss(logits, self.targets, self.num_targets)
        loss.backward()
        return loss.detach(), self.model.indexer_loss()

    def _captured(self, phase: str) -> tuple:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.zero_grad(set_to_none=True)
                self._forward_backward(phase)
        torch.cuda.current_stream().wait_stream(side)
        self.model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss, indexer_loss = self._forward_backward(phase)
        grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        return graph, loss, indexer_loss, grads
