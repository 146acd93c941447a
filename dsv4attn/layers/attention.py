"""HybridAttention: one DeepSeek-V4 attention layer (window-only, CSA or HCA) on a packed THD batch."""
from __future__ import annotations

import torch
from torch import nn

from .. import checks
from ..checkpoints import load_attention_state_dict
from ..config import AttentionConfig, check_phase, check_ratio
from ..ops import (indexer_kl, indexer_kl_from_attention, indexer_topk, qnorm_rope_stats, sparse_attention,
                   sparse_attention_lse)
from ..ops.index_sets import Concat, Explicit, Rows, VisibleCompressed, Window
from ..packing import PackedBatch, cached
from ..parallel.setup import halo_rows, layer_frame
from ..parallel.tensor import TensorParallel
from ..rope import layer_rope_frequencies
from .common import (AttachLoss, GradientHandle, GroupedLinear, KeepFp32Params, RMSNorm, can_project_together,
                     is_sharded, project_together, rope_rows)
from .compressor import Compressor
from .indexer import Indexer


class HybridAttention(KeepFp32Params):
    """DeepSeek-V4 hybrid attention for ``compress_ratio`` 0 (window), 4 (CSA) or 128 (HCA).

    ``layer(x, cu_seqlens=cu, max_seqlen=m, phase="sparse")`` maps packed rows ``x`` (T, hidden) to (T, hidden).
    Per query row t of a document: one softmax (scale ``head_dim ** -0.5``) over the raw keys of its sliding
    window, its compressed candidates and a per-head sink; queries are a shared low-rank path with per-head
    RMSNorm and partial RoPE, keys = values = one RoPE'd KV head; the output gets inverse RoPE at t, then the
    grouped and final projections. Compressed candidates: none (ratio 0); every visible entry (ratio 128, and
    ratio 4 in the ``dense`` phase); the indexer's top-k (ratio 4, ``warmup`` and ``sparse``).

    In training (``self.training`` and grad enabled) ratio-4 layers train the indexer with its KL loss inside
    ``loss.backward()``: in the ``dense`` and ``warmup`` phases the loss is attached to the attention output; in the
    ``sparse`` phase the attention's backward hands the teacher (its own probabilities of the top-k slots) to the
    loss, which forms the KL and its gradients there (:func:`dsv4attn.ops.indexer_kl_from_attention`).
    ``self.indexer_loss`` holds the detached value ``coeff * sum KL / real rows`` (in the ``dense`` phase a zero that
    gives the indexer exact-zero gradients); in the ``sparse`` phase it is the layer's own () tensor, which the
    backward writes: read it after ``backward()`` (before the layer's first sparse backward it is NaN; between a
    forward and its backward it still holds the previous backward's value), and clone it to keep it (the next sparse
    backward writes the same tensor); with a frozen indexer (no parameter requiring grad) the sparse phase forms no
    loss and it is None. A forward does not reset it: a write in the forward as well as in the backward is one
    that torch.compile cannot place in either graph. It is None after a forward that raised, and after any forward
    of a layer that has no indexer loss.
    Capacity-padding rows (past ``cu_seqlens[-1]``) output 0 and get zero gradient.

    Tensor parallelism (``tp_group``: a ProcessGroup or 1-D DeviceMesh of W ranks; docs/tensor_parallel.md): the
    layer holds the H / W query heads of its rank (``q_b_proj`` rows, ``sinks``) and the output-projection groups
    made of them (``o_a_proj`` groups, ``o_b_proj`` columns); the KV head, compressors, norms, ``q_a_proj`` and the
    indexer are replicated. ``x`` is the same on every rank of the group and so is the output (one all-reduce of
    (rows, hidden) after ``o_b_proj``); replicated parameters get the same, full gradient on every rank; the
    indexer runs whole on every rank (identical top-k) and its KL teacher sums every rank's heads.
    ``indexer_loss`` is the same on every rank of the group. ``state_dict()`` holds this rank's shards;
    ``load_hf_state_dict`` takes full tensors and ``dsv4attn.checkpoints.to_hf_state_dict`` returns them.

    ``torch.compile(layer, fullgraph=True)`` traces the whole forward and backward without a graph break, for every
    ratio and phase (give it a prebuilt ``pack``). ``indexer_loss`` works the same way there: the loss is attached
    (or, in the sparse phase, its value written by the backward) inside the graph, and setting the attribute is a
    side effect that dynamo replays after the graph has run. Each phase is its own graph; a new pack with the same
    ``total_rows``, document count and ``max_seqlen`` reuses it without a recompile (docs/packing.md, "Under
    torch.compile").

    Checks (:mod:`dsv4attn.checks`): arguments are checked for type, shape, dtype and device on every call; the
    batch metadata once per batch where the pack is built (inside the call when ``cu_seqlens`` is passed, in
    :func:`dsv4attn.pack_batch` when ``pack`` is); with a prebuilt pack and the default mode a forward reads no
    device value. ``dsv4attn.set_checks("values")`` adds NaN/Inf scans of the inputs, of every intermediate an op
    receives and of the layer's parameters (naming the first non-finite one). While ``torch.compile`` traces, the
    checks that read a device value are skipped (the value scans; the metadata validation of a pack built inside
    the call, which is why the pack should be built outside; comparing a ``cu_seqlens`` other than
    ``pack.cu_seqlens`` with the pack, which then raises); the free checks run at trace time.
    """

    _fp32_params = ("sinks",)
    # Parameters split over tensor-parallel ranks, and along which dim (the rest are replicated).
    tp_sharded = {"q_b_proj.weight": 0, "sinks": 0, "o_a_proj.weight": 0, "o_b_proj.weight": 1}

    def __init__(self, config: AttentionConfig, compress_ratio: int, *, tp_group=None):
        super().__init__()
        self.config = config
        self.compress_ratio = check_ratio(compress_ratio)
        self.tp = TensorParallel(tp_group)
        c, H, D = config, config.num_attention_heads, config.head_dim
        # Checked before any parameter exists: heads, and the output groups made of them, split evenly.
        self.local_heads = self.tp.split(H, "num_attention_heads")
        self.local_groups = self.tp.split(c.o_groups, "o_groups")
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, c.rms_norm_eps)
        self.o_a_proj = GroupedLinear(H * D // c.o_groups, c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = Compressor(c.hidden_size, D, compress_ratio, c.rms_norm_eps) if compress_ratio else None
        self.indexer = (Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.rms_norm_eps)
                        if compress_ratio == 4 else None)
        self._inv_freq = layer_rope_frequencies(config, compress_ratio)   # float64, not a buffer: never cast
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}           # per-device copies (no H2D per call)
        self._rope_table(self.sinks.device)
        # The sparse phase's loss value, written by the backward (one () tensor per device and dtype, made eagerly).
        self._kl_value_on: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._kl_values(self.sinks.device)
        # What indexer_loss reads: the last forward's detached loss, or the (device, dtype) key of the () tensor its
        # backward writes (the sparse phase). Plain attributes, so that a compiled forward only replays their setting
        # (a tensor set here would be a graph output that the backward writes: no partition of the graph places it).
        self._loss_value: torch.Tensor | None = None
        self._loss_written: tuple[torch.device, torch.dtype] | None = None
        self.reset_parameters()
        self._keep_own_shards()

    def _keep_own_shards(self) -> None:
        """Under tensor parallelism, cut the full parameters (initialised as on one rank with the same RNG
        state) down to this rank's shards."""
        if self.tp.world == 1:
            return
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, dim in self.tp_sharded.items():
                params[name].data = self.tp.shard(params[name].data, dim).clone()
        self.o_a_proj.groups = self.local_groups

    def reset_parameters(self) -> None:
        """Megatron's init: projections and positional biases N(0, initializer_range), norms 1, sinks 0."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name == "sinks":
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def load_hf_state_dict(self, state_dict, strict: bool = True):
        """Load Hugging Face ``DeepseekV4Attention`` names or DeepSeek's released names
        (docs/semantics.md, decision 12).

        Every key, shape and dtype (a floating-point tensor; its values are cast to the parameter's dtype) is
        checked before anything is copied: a refused state dict leaves the layer unchanged. Returns
        ``(missing, unexpected)`` key lists; with ``strict`` they raise a ValueError naming them.
        """
        return load_attention_state_dict(self, state_dict, strict=strict)

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None, phase: str = "sparse", cp_group=None,
                pack: PackedBatch | None = None, cp_partition: str | None = None) -> torch.Tensor:
        """Args:
            hidden_states: (T, hidden_size) packed rows (documents back to back, then capacity padding); under
                context parallelism this rank's rows (``dsv4attn.parallel.shard(x, group, cp_partition)``).
            cu_seqlens: (N+1,) int32 document boundaries of the *global* batch; ``None`` = one document (or the
                pack's). Validated here (one host read of its N+1 values) unless ``pack`` is given.
            max_seqlen: host int >= the longest document (``None`` computes it from the same read).
            phase: ``"dense"`` | ``"warmup"`` | ``"sparse"`` (docs/semantics.md, decision 8; only ratio-4 layers behave
                differently).
            cp_group: a torch.distributed process group for context parallelism
                (docs/semantics.md, decision 10), or None.
            pack: a prebuilt :func:`dsv4attn.packing.pack_batch` of the global batch, shared by all layers (built
                and validated once per batch; the layer then reads nothing). A pack built with ``cp_group`` carries
                the group, partition and frames: ``layer(x_local, pack=pack, phase=...)`` is the whole call, with no
                per-layer agreement (passing another ``cp_group`` / ``cp_partition`` with it raises).
                ``cu_seqlens`` / ``max_seqlen`` may be passed too if they are the pack's: ``pack.cu_seqlens`` itself is
                free, another tensor with the same values costs one host read on first use (remembered by the pack),
                anything else raises.
            cp_partition: which rows each rank holds, ``"contiguous"`` (the default under CP) or ``"head_tail"``
                (:mod:`dsv4attn.parallel.partition`); the same on every rank and in ``shard``/``unshard``. Only with
                ``cp_group`` (or, equal to its own, with a CP pack).
        Returns (T, hidden_size): this call's rows.
        """
        self._loss_value = self._loss_written = None  # a forward that raises leaves no stale value behind
        x = hidden_states
        phase, failed = self._checked_arguments(x, cu_seqlens, max_seqlen, phase, cp_group, pack, cp_partition)
        try:
            frame, x_keys = layer_frame(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, pack=pack,
                                        cp_group=cp_group, cp_partition=cp_partition, halo=self.halo_rows,
                                        phase=phase, compress_ratio=self.compress_ratio, failed=failed)
        finally:
            failed = None   # raised through this frame when set: no local may hold it (parallel/setup.py, _agree)
        return self._forward_frame(x, x_keys, frame, phase)

    def _checked_arguments(self, x, cu_seqlens, max_seqlen, phase, cp_group, pack, cp_partition):
        """(phase, failed): the call's arguments checked on this rank. Under the per-call CP agreement an error is
        returned as ``failed`` (raised after the ranks' agreement, so no other rank waits for this one); otherwise
        it is raised here."""
        if cp_partition is not None and cp_group is None and getattr(pack, "cp_group", None) is None:
            raise ValueError(f"cp_partition={cp_partition!r} needs cp_group (it says how context-parallel ranks "
                             f"split the rows); without cp_group the layer computes the whole batch, so leave "
                             f"cp_partition out")
        try:
            phase = check_phase(phase)
            self._check_input(x, cu_seqlens)
            if pack is not None:
                self._check_pack(pack, cu_seqlens, max_seqlen, x.device)
            if checks.values_readable():
                self._check_parameters()
        except (ValueError, TypeError) as err:
            if cp_group is None or not isinstance(x, torch.Tensor):
                raise
            return phase, err
        return phase, None

    @property
    def halo_rows(self) -> int:
        """Rows of hidden states a context-parallel chunk needs from the chunk left of it
        (docs/semantics.md, decision 10)."""
        return halo_rows(self.config, self.compress_ratio)

    def _forward_frame(self, x, x_keys, frame, phase):
        c, T, D, tp = self.config, x.shape[0], self.config.head_dim, self.tp
        pack, inv_freq = frame.pack, self._rope_table(x.device)
        pos_q, pos_k = pack.row_position[frame.query_rows()], pack.row_position[frame.key_rows()]
        n_keys = x_keys.shape[0]

        q_a, kv_raw, pool_inputs = self._input_projections(x, x_keys)
        qr, q, query_norm = self._queries(x, pos_q, inv_freq, q_a)
        # Replicated activations that this rank's heads consume enter through tp.copy: the backward sums the
        # ranks' partial gradients, so every replicated parameter before them gets the full gradient everywhere.
        kv = tp.copy(rope_rows(self.kv_norm(kv_raw), pos_k, inv_freq))   # raw keys incl. the halo

        # Index sets in key coordinates: raw key rows first, then the gathered compressed rows.
        window = frame.local_keys(Window(pack, c.sliding_window))
        keys, index_set, compressed = kv, window, None
        # Sharded compressed memory (pack_batch(..., cp_compressed="sharded")): only the sparse phase of ratio 4
        # selects a subset of the entries; everything else attends to (or teaches over) all of them and gathers.
        sharded = frame.compressed == "sharded" and self.indexer is not None and phase == "sparse"
        if self.compress_ratio:
            owned, lowering = frame.owned_entries(self.compress_ratio)
            local_compressed = tp.copy(self.compressor(x_keys, owned, inv_freq) if pool_inputs is None else
                                       self.compressor.from_projections(*pool_inputs, owned, inv_freq))
            if sharded:                          # fetched after the top-k, below
                n_gathered = local_compressed.shape[0] * frame.world
            else:
                compressed = frame.gather(local_compressed, "main_kv")
                keys, n_gathered = torch.cat([kv, compressed.to(kv.dtype)], dim=0), compressed.shape[0]
            visible = frame.local_compressed(VisibleCompressed(pack.compressed(self.compress_ratio),
                                                               pack.total_rows), lowering,
                                             table_rows=n_gathered)                          # compressed rows
            if self.indexer is None or phase == "dense":
                index_set = Concat(window, Rows(visible, 0, T, shift=n_keys))

        loss = None
        train_indexer = self.indexer is not None and self.training and torch.is_grad_enabled()
        if self.indexer is not None:
            if phase == "dense":
                if train_indexer:  # indexer not run; its parameters still get exact-zero gradients
                                   # (docs/semantics.md, decision 8)
                    loss = sum(p.sum() for p in self.indexer.parameters()) * 0.0
            else:
                index_q, index_k, index_w = self.indexer(x.detach(), qr.detach(), pos_q, x_keys.detach(), owned,
                                                         inv_freq)
                index_k = frame.gather(index_k, "index_k")
                if train_indexer and phase == "warmup":
                    # The teacher spans every visible entry, the attention the top-k: the loss selects the top-k
                    # from the student scores it forms over them anyway (indexer_kl's select_topk, bit for bit
                    # indexer_topk's result).
                    loss, topk, topk_scores = self._indexer_loss(q, kv, compressed, window, index_q, index_k,
                                                                 index_w, visible, pack, select_topk=c.index_topk)
                else:
                    # The scores the top-k ranked are the sparse teacher's student logits: the KL takes them as they
                    # are.
                    topk, topk_scores = indexer_topk(index_q.detach(), index_k.detach(), index_w.detach(), visible,
                                                     c.index_topk, return_scores=True)
                if sharded:
                    # The distinct selected rows, from their owners; top-k renumbered to rows of `compressed`, and
                    # the indexer keys cut to the same rows so that the teacher's candidates address both alike.
                    compressed, needed, topk = frame.fetch(local_compressed, topk, "main_kv")
                    keys, index_k = torch.cat([kv, compressed.to(kv.dtype)], dim=0), index_k[needed]
                # Top-k rows are rows of index_k by construction: that bound lets the ops skip any range work.
                index_set = Concat(window, Explicit(topk, offset=n_keys, bound=index_k.shape[0]))

        probe = kl_value = None
        if train_indexer and phase == "sparse":
            # The teacher's candidates are exactly the attention's top-k slots, normalised by its own denominator:
            # the attention backward hands their head-summed probabilities to the probe, whose backward forms the
            # KL and its gradients (docs/semantics.md, decision 7) and writes the loss value into kl_value.
            if (q.device, torch.float32) not in self._kl_value_on:
                self._place_kl_values(q.device)
            kl_value = self._kl_value_on[(q.device, torch.promote_types(q.dtype, torch.float32))]
            weight = c.indexer_loss_coeff / pack.num_real_rows.clamp(min=1).to(kl_value.dtype)
            probe = indexer_kl_from_attention(index_q, index_k, index_w, topk, topk_scores, weight, kl_value,
                                              probe_dtype=kl_value.dtype,
                                              head_sum=None if tp.world == 1 else tp.sum_)
        # The output comes rotated back by the query's angle (the inverse RoPE, fused into the kernels' epilogue;
        # always a new tensor: docs/semantics.md, invariant 9.1).
        out, lse = sparse_attention(q, keys, index_set, self.sinks, c.softmax_scale, output_rope=(pos_q, inv_freq),
                                    mass_probe=probe, mass_offset=window.width, query_norm=query_norm)
        if loss is not None:
            out = AttachLoss.apply(out, loss)
        G = self.local_groups                      # this rank's heads make exactly these groups
        grouped = self.o_a_proj(out.reshape(T, G, self.local_heads * D // G))
        y = tp.reduce(self.o_b_proj(grouped.reshape(T, G * c.o_lora_rank)))   # partial sums -> the full output
        # Only once the whole forward succeeded; in the sparse phase the backward writes the value.
        self._loss_value = None if loss is None else loss.detach()
        # A frozen indexer (no parameter requires grad) makes a probe without grad: the attention's backward forms no
        # mass and the loss is never written, so there is none to report.
        written = probe is not None and probe.requires_grad
        self._loss_written = (kl_value.device, kl_value.dtype) if written else None
        return y

    @property
    def indexer_loss(self) -> torch.Tensor | None:
        """The last training forward's indexer loss, detached (class docstring); None if it had none or raised."""
        if self._loss_written is not None:
            return self._kl_value_on[self._loss_written]
        return self._loss_value

    @indexer_loss.setter
    def indexer_loss(self, value: torch.Tensor | None) -> None:
        self._loss_value, self._loss_written = value, None

    def _apply(self, fn, recurse=True):
        # The table on the parameters' new device is made here, eagerly: a compiled forward finds it (a miss
        # inside torch.compile builds it in the graph every call, see packing.cached).
        super()._apply(fn, recurse)
        self._rope_table(self.sinks.device)
        self._kl_values(self.sinks.device)
        return self

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        # Kept per device (no host-to-device copy per call); not stored while compiling (packing.cached).
        return cached(self._inv_freq_on, device, lambda: self._inv_freq.to(device))

    def _kl_values(self, device: torch.device) -> dict[torch.dtype, torch.Tensor]:
        # The () tensors the sparse phase's backward writes its loss value into, fp32 and fp64 (the compute dtypes),
        # per device; made eagerly (in __init__ and _apply) so that a compiled forward finds them as inputs.
        return {dtype: cached(self._kl_value_on, (device, dtype),
                              lambda: torch.full((), float("nan"), dtype=dtype, device=device))
                for dtype in (torch.float32, torch.float64)}

    @torch.compiler.disable(reason="dsv4attn: the layer's parameters moved without Module._apply, so its "
                            "indexer-loss buffers are made eagerly; call layer.to(device) before a "
                            "fullgraph compile")
    def _place_kl_values(self, device: torch.device) -> None:
        # Parameters placed on a device without Module._apply (assigned directly, as some loaders do) find no loss
        # buffers there. Made in a compiled graph, the buffer would be one the caller never sees (the loss value
        # lost), so they are made here, outside any graph: one graph break on the first compiled call that needs
        # them (fullgraph=True refuses it: move the layer with .to(device) first).
        self._kl_values(device)

    def _input_projections(self, x, x_keys):
        """(q_a_proj(x), kv_proj(x_keys), the compressor's (kv_proj, gate_proj) of x_keys or None): the projections
        of the layer's input rows. Those of one input are formed together where they can be
        (:func:`.common.project_together`: d x accumulated by the products themselves instead of summed in passes of
        its own); on one device x_keys is x, so all four. Where they cannot (hooks, wrappers, adapters, FSDP2 shards,
        torch.compile tracing), each module runs itself, the compressor whole (None)."""
        c = self.compressor
        keys = [self.kv_proj] + ([c.kv_proj, c.gate_proj] if c is not None else [])
        together = ([self.q_a_proj] if x_keys is x else []) + keys
        owners = [] if c is None else [c]
        own = c is None or type(c).forward is Compressor.forward     # a subclass's own forward must run
        if len(together) < 2 or not own or not can_project_together(x_keys, together + owners):
            return self.q_a_proj(x), self.kv_proj(x_keys), None
        out = project_together(x_keys, together)
        q_a = out.pop(0) if x_keys is x else self.q_a_proj(x)
        return q_a, out[0], (tuple(out[1:]) if c is not None else None)

    def _queries(self, x, positions, inv_freq, q_a=None):
        """(qr, q, query_norm): the normalised low-rank query (T, q_lora_rank), the RoPE'd queries (T, H, head_dim)
        without a graph of their own, and ``(queries before the norm, rstd)`` for ``sparse_attention(...,
        query_norm=)``, whose backward gives the gradient of those (the norm's backward inside the attention's,
        not a pass of its own over dq and q); the queries before the norm as a :class:`.common.GradientHandle`
        (the op never reads them: their storage is freed here, as when the norm was its own node); ``q_a``:
        ``q_a_proj(x)`` if the caller formed it."""
        c = self.config
        qr = self.q_a_norm(self.q_a_proj(x) if q_a is None else q_a)
        q = self.q_b_proj(self.tp.copy(qr)).view(x.shape[0], self.local_heads, c.head_dim)
        # per-head RMSNorm, then RoPE (docs/semantics.md, "Query path")
        q_normed, rstd = qnorm_rope_stats(q, positions, inv_freq, c.rms_norm_eps)
        return qr, q_normed, (GradientHandle.apply(q), rstd)

    @torch.no_grad()
    def _outside_lse(self, q, kv, window):
        """(T, H) log attention mass outside the compressed candidates: the window keys plus the sink (the window's
        lse alone: no attention output is formed for it)."""
        window_lse = sparse_attention_lse(q.detach(), kv.detach(), window, self.config.softmax_scale)
        return torch.logaddexp(window_lse, self.sinks.detach().to(window_lse.dtype))

    @torch.no_grad()
    def indexer_inputs(self, hidden_states: torch.Tensor, pack: PackedBatch) -> dict:
        """What the indexer and its teacher see for ``hidden_states`` (T, hidden) of a single-device ``pack``
        (ratio-4 layers; for evaluation and analysis, no gradients). Keys: ``q`` (T, H, D) RoPE'd queries,
        ``compressed`` (capacity, D) compressed KV, ``outside_lse`` (T, H) window + sink mass, ``index_q``,
        ``index_k``, ``index_weights`` (the indexer's scoring inputs) and ``layout`` (the ratio-4 layout).

        Under tensor parallelism every rank of the group calls it with the same rows (it all-gathers ``q`` and
        ``outside_lse`` over the group) and gets every head."""
        if self.indexer is None:
            raise ValueError(f"indexer_inputs needs a ratio-4 layer, this one has compress_ratio "
                             f"{self.compress_ratio}")
        if not isinstance(pack, PackedBatch):
            raise TypeError(f"pack must be a PackedBatch from dsv4attn.pack_batch, got {type(pack).__name__}")
        checks.check_tensor("hidden_states", hidden_states, shape=(pack.total_rows, self.config.hidden_size),
                            dtypes=checks.FLOATS, device=pack.device)
        x, inv_freq, pos = hidden_states, self._rope_table(hidden_states.device), pack.row_position
        layout = pack.compressed(4)
        qr, q, _ = self._queries(x, pos, inv_freq)
        kv = rope_rows(self.kv_norm(self.kv_proj(x)), pos, inv_freq)
        compressed = self.compressor(x, layout, inv_freq).to(q.dtype)
        index_q, index_k, index_w = self.indexer(x, qr, pos, x, layout, inv_freq)
        outside_lse = self._outside_lse(q, kv, Window(pack, self.config.sliding_window))
        if self.tp.world > 1:           # this rank's heads -> all of them, in head order
            q, outside_lse = self.tp.gather(q, 1), self.tp.gather(outside_lse, 1)
        return dict(q=q, compressed=compressed, outside_lse=outside_lse, index_q=index_q, index_k=index_k,
                    index_weights=index_w, layout=layout)

    def _indexer_loss(self, q, kv, compressed, window, index_q, index_k, index_w, candidates, pack, select_topk):
        """The warm-up's KL loss: (coeff * sum_t KL_t / real rows of the global batch (under CP this rank's share),
        the top-k, its scores). The teacher spans every visible entry (``candidates``) with the window + sink mass
        formed here; its operands are detached (docs/semantics.md, invariant 9.9). (The sparse phase's loss comes
        from the attention's backward: :func:`dsv4attn.ops.indexer_kl_from_attention`.)"""
        # Under tensor parallelism q holds this rank's heads: head_sum adds the other ranks' teacher mass.
        kl, *chosen = indexer_kl(index_q, index_k, index_w, q.detach(), compressed.detach(), candidates,
                                 self._outside_lse(q, kv, window), self.config.softmax_scale,
                                 head_sum=None if self.tp.world == 1 else self.tp.sum_, select_topk=select_topk)
        loss = self.config.indexer_loss_coeff * kl.sum() / pack.num_real_rows.clamp(min=1).to(kl.dtype)
        return (loss, *chosen)

    def _check_input(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
        hidden = self.config.hidden_size
        checks.check_tensor("hidden_states", x, shape=(None, hidden),
                            dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
        weight = self.q_a_proj.weight
        weight_dtype = weight.dtype
        # A weight sharded by FSDP2 is gathered (and cast) by its unit only when q_a_proj runs: nothing to compare.
        if x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type) and not is_sharded(weight):
            raise ValueError(f"hidden_states has dtype {x.dtype} but the layer's parameters are {weight_dtype}; "
                             f"cast one of them or run under torch.autocast")
        if cu_seqlens is not None:
            checks.check_tensor("cu_seqlens", cu_seqlens, device=x.device)
        checks.check_finite("hidden_states", x)

    def _check_pack(self, pack, cu_seqlens, max_seqlen, device) -> None:
        """A prebuilt pack: its type and device, and agreement with ``cu_seqlens`` / ``max_seqlen`` if those are
        given too (free unless ``cu_seqlens`` is another tensor than ``pack.cu_seqlens``: one read, once)."""
        if not isinstance(pack, PackedBatch):
            raise TypeError(f"pack must be a PackedBatch from dsv4attn.pack_batch, got {type(pack).__name__}")
        if pack.device != device:
            raise ValueError(f"pack must be on {device} (the device of hidden_states), got {pack.device}")
        if cu_seqlens is not None and not pack.same_cu_seqlens(cu_seqlens):
            raise ValueError("cu_seqlens and pack disagree: cu_seqlens must be the pack's own boundaries "
                             "(pack.cu_seqlens, or a tensor of equal values); pass only pack, or only cu_seqlens "
                             "and max_seqlen")
        if max_seqlen is not None and max_seqlen != pack.max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen!r} and pack disagree: the pack was built with max_seqlen="
                             f"{pack.max_seqlen}; pass only pack, or the same value")

    def _check_parameters(self) -> None:
        """Debug mode ("values"): every parameter finite, else a ValueError naming the first one that is not."""
        for name, p in self.named_parameters():
            checks.check_finite(f"parameter {name}", p)
