"""`ModelRunner`: runs transformers model modules over the paged pool, many sequences per forward.

All scheduled tokens (prefill chunks and decode tokens of every running request) go through the
model as one flat sequence with their own positions; RoPE comes from the model. The attention
function registered as `kvwise_paged` writes each layer's new keys and values into the request's
blocks, then lets each chunk attend over its whole sequence read back through its block table.
The step's layout reaches it through the attention modules themselves: for the length of one
forward, each carries the runner's `StepLayout` (`attached_step`), removed when the forward ends,
so no state outlives a step and two runners over one model never see each other's. (Not a
forward keyword: some families, StableLM among them, do not pass those down to attention.)
Decode tokens: on CPU in float32, one call of the compiled kernel (kernels/paged_decode.cpp) for
all of them, reading blocks in place; elsewhere one padded SDPA call per bucket of similar
lengths. Prefill chunks: one SDPA call each, GQA without repeat_kv. On CPU in float32, the
linear layers' inputs of a few rows (decode steps, the LM head) go through the compiled
small_linear kernel while the forward runs (cpu_linear.py). No model is rewritten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvwise.engine.block_table import Place
from kvwise.engine.compaction import Compaction
from kvwise.engine.cpu_kernel import (
    elementwise_kernels,
    paged_decode_kernel,
    prefill_attention_kernel,
    quantized_decode_kernel,
    rows_decode_kernel,
    small_linear_bf16_kernel,
    small_linear_kernel,
)
from kvwise.engine.cpu_linear import CpuLinears, onednn_linear
from kvwise.engine.fused_layers import FusedLayers
from kvwise.engine.kv_view import RunnerView
from kvwise.engine.quant_pool import QuantPool
from kvwise.engine.quantized_kernel import NO_ROLES
from kvwise.engine.scheduler import Chunk
from kvwise.engine.step_profile import StepProfile
from kvwise.hf.attention import attention_implementation
from kvwise.hf.attention_inputs import ENGINE_STEP_ATTRIBUTE, install_attention_input_hooks
from kvwise.hf.geometry import kv_geometry
from kvwise.kv.paged import PagedKVStorage

ATTENTION_NAME = "kvwise_paged"
STEP_ATTRIBUTE = ENGINE_STEP_ATTRIBUTE  # an attention module's StepLayout during a forward


@dataclass
class AttentionGroup:
    """Chunks attended together in one SDPA call. Their queries are the flat tokens [first, last):
    the runner orders tokens group by group (decode buckets, then each prefill chunk).

    blocks: [C * max_blocks] block ids, each chunk's table padded with block 0; keys_per_chunk:
    max_blocks * block_size, or the chunk's exact length for a lone prompt start; mask:
    [C, 1, queries, keys] bool, or None when plain causal attention is exact (`causal`).
    """

    first: int
    last: int
    chunks: int
    blocks: torch.Tensor
    keys_per_chunk: int
    mask: torch.Tensor | None
    query_positions: torch.Tensor  # [C, queries per chunk]: each query's position in its sequence
    causal: bool = False
    first_block: int | None = None  # one chunk whose blocks are consecutive: read them as a slice
    mixed: MixedBlocks | None = None  # one chunk whose table holds quantized blocks
    region: object = None  # one chunk whose request holds a HeadRegion: read before its blocks
    # with a region: the positions of its block keys [keys_per_chunk] and of its queries [queries]
    # (after an eviction a KV index is no longer a position, and masks go by positions)
    key_positions: torch.Tensor | None = None
    region_query_positions: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # [C] int64: CPU-kernel decode group, chunk c sees keys < lengths[c]
    # CPU-kernel decode group whose tables name blocks of this QuantPool (as -id - 1), read in place
    quantized: QuantPool | None = None
    rows: RowsDecode | None = None  # CPU-kernel decode group of requests with head regions
    quest: object = None  # one decode chunk whose request reads only its top pages (Quest): the request
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def decodes(self) -> bool:
        """Whether the group's chunks are decodes: one query each."""
        return self.last - self.first == self.chunks

    def window_mask(self, window: int) -> torch.Tensor:
        """[C, 1, queries, keys] bool: causal and within `window` positions (sliding-window layers;
        a key k is seen from position p when p - window < k <= p, as in transformers)."""
        if window not in self._windowed:
            keys = torch.arange(self.keys_per_chunk, device=self.query_positions.device)
            queries = self.query_positions[:, :, None]
            self._windowed[window] = ((keys <= queries) & (keys > queries - window))[:, None]
        return self._windowed[window]


@dataclass
class MixedBlocks:
    """A table of device blocks and quantized ones: where each kind goes."""

    device_slots: torch.Tensor  # [n_device] positions in the table
    device_ids: torch.Tensor  # [n_device] device block ids
    quantized_slots: torch.Tensor
    quantized_ids: torch.Tensor  # QuantPool ids
    pool: QuantPool
    length: int  # table entries

    def read(self, storage: PagedKVStorage, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [length, block_size, kv_heads, head_dim], quantized blocks restored."""
        template = storage.keys[layer]
        keys = template.new_empty((self.length, *template.shape[1:]))
        values = template.new_empty((self.length, *template.shape[1:]))
        keys.index_copy_(0, self.device_slots, template.index_select(0, self.device_ids))
        values.index_copy_(0, self.device_slots, storage.values[layer].index_select(0, self.device_ids))
        restored_keys, restored_values = self.pool.read(layer, self.quantized_ids)
        keys.index_copy_(0, self.quantized_slots, restored_keys)
        values.index_copy_(0, self.quantized_slots, restored_values)
        return keys, values


@dataclass
class RowsDecode:
    """Decode tokens of requests whose KV heads hold different tokens (head regions), for the CPU
    kernel that reads rows listed per KV head in place: each chunk's block keys (its shared prefix
    and tail, the same for every head) and its region's rows.

    block_cells: [C, kv_heads, B] the block keys' cells in layer 0 (a layer adds `layer_cells`);
    block_lengths: [C]; region_cells: [C, layers, kv_heads, W] (global cells);
    region_counts: [C, layers, kv_heads].
    """

    block_cells: torch.Tensor
    block_lengths: torch.Tensor
    region_cells: torch.Tensor
    region_counts: torch.Tensor
    layer_cells: int

    def at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [C, kv_heads, W + B] (each head's region rows, then the block keys) and lengths
        [C, kv_heads] for `layer`."""
        counts = self.region_counts[:, layer]
        chunks, heads, width = self.region_cells.shape[0], self.region_cells.shape[2], self.region_cells.shape[3]
        blocks = self.block_cells.shape[2]
        rows = self.block_cells.new_zeros(chunks, heads, width + blocks)
        rows[..., :width] = self.region_cells[:, layer]
        after = counts[..., None] + torch.arange(blocks, device=rows.device)  # right after the region's rows
        rows.scatter_(2, after, self.block_cells + layer * self.layer_cells)
        return rows, counts + self.block_lengths[:, None]


@dataclass
class StepLayout:
    """Where each flat token goes, for one forward: slots [T] int64 pool slot of each token, and
    the attention groups (all decode tokens together; each prefill chunk on its own, so one long
    chunk never pads every decode query to its length)."""

    storage: PagedKVStorage
    slots: torch.Tensor
    groups: list[AttentionGroup]
    compactions: list = field(default_factory=list)  # Compaction, ReconstructionPass: `apply` after each layer
    decode_kernel: object = None  # cpu_kernel.paged_decode_kernel(), for groups with `lengths`
    rows_kernel: object = None  # cpu_kernel.rows_decode_kernel(), for groups with `rows`
    quantized_kernel: object = None  # cpu_kernel.quantized_decode_kernel(), for groups with `quantized`
    prefill_kernel: object = None  # cpu_kernel.prefill_attention_kernel(), for plain prefill chunks
    # layer -> [1, T, hidden]: each layer's input, kept when a compaction scores hidden states (kvzap)
    attention_inputs: dict = field(default_factory=dict)
    profile: StepProfile | None = None  # while a bench profiles the engine: attention timed per group

    @property
    def wants_attention_inputs(self) -> bool:
        return any(getattr(compaction, "needs_hidden_states", False) for compaction in self.compactions)

    def store_attention_input(self, layer: int, hidden_states: torch.Tensor) -> None:
        self.attention_inputs[layer] = hidden_states


@dataclass
class ForwardOutput:
    """What one forward computed: logits [C, vocab] after each chunk's last token (in the order the
    chunks were given), the compactions done inside it (their kept positions filled in), and for
    prompt chunks of requests that asked for prompt logprobs, the logits after each of their
    tokens [chunk tokens, vocab], by chunk."""

    logits: torch.Tensor
    compactions: list[Compaction]
    prompt_logits: dict = field(default_factory=dict)  # chunk (by identity) -> [end - start, vocab]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, num_heads, T, head_dim]; key, value: [1, num_kv_heads, T, head_dim] (flat tokens)."""
    layout = getattr(module, STEP_ATTRIBUTE, None)
    if layout is None:
        raise RuntimeError("kvwise_paged attention runs only inside ModelRunner.forward")
    layer = module.layer_idx
    storage = layout.storage
    storage.write(layer, layout.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")  # Gemma 2/3, Mistral, Qwen2 hybrids
    outputs = []
    for group in layout.groups:
        if layout.profile is None:
            outputs.append(_group_attention(group, layout, layer, query, key, scaling, window, softcap))
            continue
        with layout.profile.attention(group.decodes):
            outputs.append(_group_attention(group, layout, layer, query, key, scaling, window, softcap))
    for compaction in layout.compactions:  # after attention: this forward's queries saw every token
        compaction.apply(storage, layer, query, scaling, layout.attention_inputs.pop(layer, None))
    return torch.cat(outputs)[None], None  # [1, T, heads, dim]


def _group_attention(group: AttentionGroup, layout, layer: int, query, key, scaling, window, softcap) -> torch.Tensor:
    """One group's attention output [tokens, heads, dim] (its keys and values already written)."""
    storage = layout.storage
    kv_heads, head_dim = key.shape[1], key.shape[3]
    if group.rows is not None:  # one query per chunk, each KV head's own rows read in place
        queries = query[0, :, group.first : group.last].transpose(0, 1)  # [C, heads, dim]
        rows, lengths = group.rows.at(layer)
        keys, values = storage.cells()
        scale = scaling if scaling is not None else head_dim**-0.5
        return layout.rows_kernel(queries, keys, values, rows, lengths, scale, softcap or 0.0)
    if group.lengths is not None:  # one query per chunk, blocks read in place by the CPU kernel
        queries = query[0, :, group.first : group.last].transpose(0, 1)  # [C, heads, dim]
        scale = scaling if scaling is not None else head_dim**-0.5
        tables = group.blocks.view(group.chunks, -1)
        keys, values = storage.keys[layer], storage.values[layer]
        capped, windowed = softcap or 0.0, window or 0
        if group.quantized is not None or layout.decode_kernel is None:  # quantized blocks, or bfloat16
            roles = group.quantized.kernel_roles[layer] if group.quantized is not None else NO_ROLES
            kernel = layout.quantized_kernel
            output = kernel(queries.float(), keys, values, tables, group.lengths, scale, capped, windowed, *roles)
            return output.to(query.dtype)
        kernel = layout.decode_kernel
        return kernel(queries, keys, values, tables, group.lengths, scale, capped, windowed)
    if group.quest is not None:
        return _quest_attend(group, storage, layer, query, scaling, softcap)
    if _prefills_in_kernel(group, layout, window, softcap, head_dim):
        queries = query[0, :, group.first : group.last].transpose(0, 1)  # [T, heads, dim]
        start = group.keys_per_chunk - queries.shape[0]
        scale = scaling if scaling is not None else head_dim**-0.5
        return layout.prefill_kernel(queries, storage.keys[layer], storage.values[layer], group.blocks, start, scale)
    # index_select reads whole blocks; advanced indexing with a 2-D table is 4x slower on CPU
    shape = (group.chunks, -1, kv_heads, head_dim)
    if group.mixed is not None:
        keys, values = group.mixed.read(storage, layer)
        keys, values = keys.view(shape)[:, : group.keys_per_chunk], values.view(shape)[:, : group.keys_per_chunk]
    elif group.first_block is not None:  # no copy at all
        span = slice(group.first_block, group.first_block + len(group.blocks))
        keys = storage.keys[layer][span].view(shape)[:, : group.keys_per_chunk]
        values = storage.values[layer][span].view(shape)[:, : group.keys_per_chunk]
    else:
        keys = storage.keys[layer].index_select(0, group.blocks).view(shape)[:, : group.keys_per_chunk]
        values = storage.values[layer].index_select(0, group.blocks).view(shape)[:, : group.keys_per_chunk]
    queries = query[0, :, group.first : group.last].unflatten(1, (group.chunks, -1)).transpose(0, 1)
    mask, causal = group.mask, group.causal
    if group.region is not None:
        keys, values, mask = _with_region(group, storage, layer, keys, values, window, query.shape[1])
        causal = False
    elif window is not None and window < group.keys_per_chunk:
        mask, causal = group.window_mask(window), False
    output = _attend(
        queries,  # [C, heads, queries per chunk, dim]
        keys.transpose(1, 2),  # [C, kv_heads, keys, dim]
        values.transpose(1, 2),
        mask,
        causal,
        scaling,
        softcap,
    )
    return output.transpose(1, 2).flatten(0, 1)  # [tokens, heads, dim]


def _quest_attend(group: AttentionGroup, storage, layer: int, query, scaling, softcap):
    """One decode token of a Quest request: the policy picks each KV head's top pages by the
    query's upper bound on q.k (the newest page always), and the token attends to those and to
    itself. Returns [1, heads, dim]; the bytes read are added to the request's counters."""
    request = group.quest
    if group.mixed is not None:
        keys, values = group.mixed.read(storage, layer)
    else:
        keys, values = (
            storage.keys[layer].index_select(0, group.blocks),
            storage.values[layer].index_select(0, group.blocks),
        )
    end = group.keys_per_chunk
    keys = keys.flatten(0, 1)[:end].transpose(0, 1)[None]  # [1, kv_heads, end, dim]
    values = values.flatten(0, 1)[:end].transpose(0, 1)[None]
    valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
    step = PagesStep(keys, values, valid, end - 1)
    queries = query[:, :, group.first : group.last]  # [1, heads, 1, dim]
    selected_keys, selected_values, seen = request.kv.scorer.select_pages(step, queries, request.kv.ratio)
    seen = torch.cat([seen, valid[:, :, -1:]], dim=-1)  # and the token itself
    mask = seen.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)[:, :, None, :]  # [1, heads, 1, n]
    request.kv_bytes_read += selected_keys.nbytes + selected_values.nbytes
    request.kv_bytes_held_read += keys.nbytes + values.nbytes
    output = _attend(queries, selected_keys, selected_values, mask, False, scaling, softcap)
    return output.transpose(1, 2).flatten(0, 1)


@dataclass
class PagesStep:
    """What Quest's `select_pages` reads: keys, values [1, kv_heads, n, dim] (the cached tokens,
    then the new one), valid [1, kv_heads, n], and how many are cached."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    prefix_len: int


def _with_region(group: AttentionGroup, storage, layer: int, keys, values, window: int | None, num_heads: int):
    """One chunk's keys, values [1, K, kv_heads, dim] with its region's rows put first, and the
    mask [1, num_heads, queries, R + K] bool, by positions: each head sees its own region rows,
    then the block keys at or before each query (within `window` on a sliding-window layer)."""
    region = group.region
    region_keys, region_values = region.read(storage, layer)  # [kv_heads, R, dim]
    keys = torch.cat([region_keys.transpose(0, 1)[None], keys], dim=1)
    values = torch.cat([region_values.transpose(0, 1)[None], values], dim=1)
    queries, key_positions = group.region_query_positions[:, None], group.key_positions[None, :]
    seen_blocks = key_positions <= queries  # [queries, K]
    seen_region = region.valid[layer][:, None, :]  # [kv_heads, 1 or queries, R]
    if window:
        seen_blocks = seen_blocks & (key_positions > queries - window)
        seen_region = seen_region & (region.positions[layer][:, None, :] > queries[None] - window)
    heads_per_kv = num_heads // seen_region.shape[0]
    seen_region = seen_region.repeat_interleave(heads_per_kv, dim=0)  # [num_heads, queries or 1, R]
    shape = (num_heads, len(group.region_query_positions))
    mask = torch.cat([seen_region.expand(*shape, -1), seen_blocks.expand(*shape, -1)], dim=-1)
    return keys, values, mask[None]


@contextlib.contextmanager
def attached_step(modules: list, layout: StepLayout) -> Iterator[None]:
    """`layout` on each of `modules` for the duration of one forward, always removed."""
    for module in modules:
        setattr(module, STEP_ATTRIBUTE, layout)
    try:
        yield
    finally:
        for module in modules:
            delattr(module, STEP_ATTRIBUTE)


def _prefills_in_kernel(group: AttentionGroup, layout, window, softcap, head_dim: int) -> bool:
    """A plain prefill chunk (its KV all in pool blocks, no window that cuts it, no soft cap, a
    head of whole 16-float vectors) on a CPU whose kernels have the pool dtype's path: causal
    attention in `prefill_attention`."""
    return (
        layout.prefill_kernel is not None
        and head_dim % 16 == 0
        and group.chunks == 1
        and not group.decodes
        and group.mixed is None
        and group.region is None
        and not softcap
        and (window is None or window >= group.keys_per_chunk)
    )


def _attend(queries, keys, values, mask, causal: bool, scaling: float | None, softcap: float | None):
    """queries [C, heads, q, dim] over keys, values [C, kv_heads, k, dim] -> [C, heads, q, dim].

    SDPA unless the model caps its attention logits (Gemma 2: tanh(s / cap) * cap), which SDPA
    cannot express; then the scores are computed here, softmax in float32 as transformers does."""
    if not softcap:
        return F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=causal,
            scale=scaling,
            enable_gqa=queries.shape[1] != keys.shape[1],
        )
    repeats = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)
    scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
    scores = torch.tanh(queries @ keys.transpose(-1, -2) * scale / softcap) * softcap  # [C, heads, q, k]
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values


def _no_mask(*args, **kwargs):
    return None  # masks come from the block tables, not from transformers


def register_paged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class ModelRunner:
    def __init__(
        self,
        model,
        kv: RunnerView,
        cpu_kernel: bool = True,
    ):
        """kv: the manager's read-only view (`KVCacheManager.runner_view()`): the paged storage
        and the quantized pools."""
        register_paged_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        storage = kv.storage
        self.model, self.storage, self.block_size = model, storage, storage.block_size
        # the modules the attention function is called with (they know their layer_idx)
        self.attention_modules = [module for module in model.modules() if hasattr(module, "layer_idx")]
        self.quant_pools = kv.quant_pools
        # CUDA keeps SDPA (its fused kernels read the gathered keys fast); on CPU the kernel reads
        # blocks in place and measured 4x faster than gather + padded SDPA for a decode batch
        on_cpu = storage.keys[0].device.type == "cpu" and storage.keys[0].dtype == torch.float32
        self.decode_kernel = paged_decode_kernel() if on_cpu and cpu_kernel else None
        # sliding-window layers mask region rows by position, which the rows kernel does not do
        windowed = any(window is not None for window in kv_geometry(model).windows)
        self.rows_kernel = rows_decode_kernel() if on_cpu and cpu_kernel and not windowed else None
        # quantized blocks, and bfloat16 pools, go through the kernel that reads them block by block
        wide = storage.keys[0].device.type == "cpu" and storage.keys[0].dtype in (torch.float32, torch.bfloat16)
        self.quantized_kernel = quantized_decode_kernel() if wide and cpu_kernel else None
        # prefill chunks: torch's CPU flash attention reached half the float32 peak, and ran
        # bfloat16 at float32's rate
        pool_dtype = storage.keys[0].dtype
        self.prefill_kernel = prefill_attention_kernel(pool_dtype) if wide and cpu_kernel else None
        small = small_linear_kernel() if on_cpu and cpu_kernel else None
        large = onednn_linear() if on_cpu and cpu_kernel else None
        small_bf16 = small_linear_bf16_kernel() if wide and cpu_kernel else None
        self.cpu_linears = CpuLinears(model, small, large, small_bf16) if small or large or small_bf16 else None
        # RMSNorm, SiLU(gate) * up and rotary embedding in one pass each (vLLM's CPU backend fuses them too)
        elementwise = elementwise_kernels() if wide and cpu_kernel else None
        self.fused_layers = (FusedLayers(model, *elementwise) or None) if elementwise else None
        self.profile: StepProfile | None = None  # set while a bench profiles the engine (`EngineCore.profiling`)

    @torch.no_grad()
    def forward(self, chunks: list[Chunk], compactions: list | None = None) -> ForwardOutput:
        """Compute the chunks' tokens: the logits after each chunk's last token, and the compactions.

        compactions: what to score after each layer for some of the chunks (`Compaction` from
        `KVCacheManager.plan_compactions`, or a `ReconstructionPass`), each naming its `chunk`; the
        runner tells each where its chunk's queries are in the flat step.
        """
        device = self.model.device
        if attention_implementation(self.model) != ATTENTION_NAME:
            # a KVWiseCache (or anything else) made on the same model since switched it away: the
            # model's own attention would read nothing from the pool and score nothing
            self.model.set_attn_implementation(ATTENTION_NAME)
        decodes = [c for c in chunks if c.end - c.start == 1]
        plain = [c for c in decodes if not _own_group(c.request)]
        quantized = [c for c in decodes if self._reads_quantized(c.request)]
        # the kernel pads nothing, so all plain decodes form one group (with the requests of one
        # quantizer, whose blocks it reads in place); SDPA pads each group to its longest row, so
        # it gets buckets of similar lengths
        if self._decodes_in_kernel:
            kernel_groups = _by_quantizer(plain, quantized)
        else:
            kernel_groups = decode_buckets(plain, self.block_size)
        by_rows = [c for c in decodes if self._reads_rows(c.request)]
        alone = [
            [c]
            for c in decodes
            if _own_group(c.request) and not self._reads_rows(c.request) and not self._reads_quantized(c.request)
        ]
        buckets = kernel_groups + ([by_rows] if by_rows else []) + alone
        prefills = [c for c in chunks if c.end - c.start > 1]
        ordered = [chunk for bucket in buckets for chunk in bucket] + prefills  # the flat token order
        layout = self._layout(buckets, prefills, device)
        layout.decode_kernel, layout.rows_kernel = self.decode_kernel, self.rows_kernel
        layout.quantized_kernel, layout.profile = self.quantized_kernel, self.profile
        layout.prefill_kernel = self.prefill_kernel
        layout.compactions = _place(compactions or [], ordered)
        if layout.wants_attention_inputs:
            install_attention_input_hooks(self.model)
        ids = torch.tensor([[t for c in ordered for t in c.request.tokens[c.start : c.end]]], device=device)
        positions = torch.tensor([[p for c in ordered for p in range(c.start, c.end)]], device=device)
        # logits only after each chunk's last token (the LM head over every prompt token would
        # cost a fifth of a prefill for a small-vocabulary-heavy model like SmolLM2), and after
        # every token of the prompt chunks whose request scores its prompt
        keep, spans, first = [], {}, 0
        for chunk in ordered:
            size = chunk.end - chunk.start
            rows = range(first, first + size) if _scores_prompt(chunk) else range(first + size - 1, first + size)
            spans[id(chunk)] = (len(keep), len(rows))
            keep.extend(rows)
            first += size
        linears = self.cpu_linears.active() if self.cpu_linears else contextlib.nullcontext()
        timed = contextlib.nullcontext()
        if self.profile is not None:
            decode_tokens = sum(len(bucket) for bucket in buckets)
            timed = self.profile.forward(len(ids[0]) - decode_tokens, decode_tokens)
        fused = self.fused_layers.active() if self.fused_layers else contextlib.nullcontext()
        with attached_step(self.attention_modules, layout), linears, fused, timed:
            kept = torch.tensor(keep, device=device)
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=kept).logits[0]
        for chunk in chunks:
            if chunk.request.region is not None:
                chunk.request.region.forget_read()
        last = [spans[id(chunk)][0] + spans[id(chunk)][1] - 1 for chunk in chunks]
        prompt_logits = {
            id(chunk): logits[spans[id(chunk)][0] : sum(spans[id(chunk)])] for chunk in chunks if _scores_prompt(chunk)
        }
        return ForwardOutput(logits[last], layout.compactions, prompt_logits)

    def _reads_rows(self, request) -> bool:
        """Its decode goes to the rows kernel: a region in device pages, no quantized blocks."""
        region = request.region
        return (
            self.rows_kernel is not None
            and region is not None
            and region.quant is None
            and Place.QUANTIZED not in request.blocks.places
        )

    @property
    def _decodes_in_kernel(self) -> bool:
        """Plain decode tokens go to a CPU kernel (float32: paged_decode; bfloat16: quantized_decode)."""
        return self.decode_kernel is not None or self.quantized_kernel is not None

    def _reads_quantized(self, request) -> bool:
        """Its decode goes to the quantized kernel: quantized blocks of a codec the kernel reads,
        and nothing else of its own to read (no head region, no page selection)."""
        if self.quantized_kernel is None or request.kv is None or request.kv.quant is None:
            return False
        if request.region is not None or _selects_pages(request) or Place.QUANTIZED not in request.blocks.places:
            return False
        return self.quant_pools[request.kv.quant].kernel_roles is not None

    def _rows_group(self, chunks: list[Chunk], first: int, device) -> AttentionGroup:
        storage, block = self.storage, self.block_size
        heads = storage.keys[0].shape[2]
        ends = [_kv_span(c)[1] for c in chunks]
        slots = torch.zeros(len(chunks), max(ends), dtype=torch.long, device=device)
        for row, (chunk, end) in enumerate(zip(chunks, ends)):
            slots[row, :end] = chunk.request.blocks.slots(torch.arange(end, device=device), block)
        block_cells = slots[:, None, :] * heads + torch.arange(heads, device=device)[None, :, None]
        stacked = [chunk.request.region.stacked() for chunk in chunks]
        width = max(cells.shape[-1] for cells, _ in stacked)
        region_cells = torch.stack([F.pad(cells, (0, width - cells.shape[-1])) for cells, _ in stacked])
        rows = RowsDecode(
            block_cells,
            torch.tensor(ends, device=device),
            region_cells,
            torch.stack([counts for _, counts in stacked]),
            storage.keys[0].shape[0] * block * heads,
        )
        positions = torch.tensor([c.end - 1 for c in chunks], device=device)[:, None]
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return AttentionGroup(first, first + len(chunks), len(chunks), empty, 0, None, positions, rows=rows)

    def _slot(self, request, index: int) -> int:
        """The pool slot of KV index `index` of `request`."""
        return request.blocks.block_ids[index // self.block_size] * self.block_size + index % self.block_size

    def _layout(self, buckets: list[list[Chunk]], prefills: list[Chunk], device) -> StepLayout:
        ordered = [chunk for bucket in buckets for chunk in bucket] + prefills
        slots = [self._slot(c.request, i) for c in ordered for i in range(*_kv_span(c))]
        groups, first = [], 0
        for bucket in buckets:
            reads_rows = self._reads_rows(bucket[0].request)
            groups.append((self._rows_group if reads_rows else self._decode_group)(bucket, first, device))
            first += len(bucket)
        for chunk in prefills:
            groups.append(self._prefill_group(chunk, first, device))
            first += chunk.end - chunk.start
        return StepLayout(self.storage, torch.tensor(slots, device=device), groups)

    def _decode_group(self, chunks: list[Chunk], first: int, device) -> AttentionGroup:
        """One query per chunk; each sees its first `end` KV slots of its padded table."""
        block = self.block_size
        ends = [_kv_span(c)[1] for c in chunks]
        max_blocks = max(-(-end // block) for end in ends)
        quantized = [c for c in chunks if self._reads_quantized(c.request)]
        kernel = self._decodes_in_kernel and all(
            not _own_group(c.request) or self._reads_quantized(c.request) for c in chunks
        )

        def padded_table(request, end: int) -> list[int]:
            count = -(-end // block)
            ids = _kernel_table(request, count) if kernel else request.blocks.block_ids[:count]
            return ids + [0] * (max_blocks - count)

        table = [b for c, end in zip(chunks, ends) for b in padded_table(c.request, end)]
        ends = torch.tensor(ends, device=device)
        blocks, positions = torch.tensor(table, device=device), (ends - 1)[:, None]
        if kernel:
            pool = self.quant_pools[quantized[0].request.kv.quant] if quantized else None
            return AttentionGroup(
                first, first + len(chunks), len(chunks), blocks, 0, None, positions, lengths=ends, quantized=pool
            )
        mask = torch.arange(max_blocks * block, device=device)[None, :] < ends[:, None]  # [C, keys]
        if len(chunks) == 1:
            mixed = self._mixed(chunks[0].request, table, device)
            return AttentionGroup(
                first,
                first + 1,
                1,
                blocks,
                int(ends[0]),
                None,
                positions,
                first_block=_run_start(table),
                mixed=mixed,
                quest=chunks[0].request if _selects_pages(chunks[0].request) else None,
                **_region_fields(chunks[0], device),
            )
        return AttentionGroup(
            first, first + len(chunks), len(chunks), blocks, max_blocks * block, mask[:, None, None], positions
        )

    def _prefill_group(self, chunk: Chunk, first: int, device) -> AttentionGroup:
        """Queries start..end-1 over KV slots 0..end-1: causal from the top-left corner when the
        chunk starts the sequence, else shifted by `start` (a bool mask)."""
        start, end = _kv_span(chunk)
        table = chunk.request.blocks.block_ids[: -(-end // self.block_size)]
        blocks, run = torch.tensor(table, device=device), _run_start(table)
        last = first + end - start
        query_positions = torch.arange(start, end, device=device)
        mixed = self._mixed(chunk.request, table, device)
        region = _region_fields(chunk, device)
        if start == 0:
            return AttentionGroup(
                first,
                last,
                1,
                blocks,
                end,
                None,
                query_positions[None],
                causal=True,
                first_block=run,
                mixed=mixed,
                **region,
            )
        mask = torch.arange(end, device=device)[None, :] <= query_positions[:, None]  # [queries, keys]
        return AttentionGroup(
            first,
            last,
            1,
            blocks,
            end,
            mask[None, None],
            query_positions[None],
            first_block=run,
            mixed=mixed,
            **region,
        )

    def _mixed(self, request, table: list[int], device) -> MixedBlocks | None:
        """table: the request's first block ids (a prefix of its BlockTable)."""
        places = request.blocks.places[: len(table)]
        if Place.QUANTIZED not in places:
            return None
        device_slots = [index for index, place in enumerate(places) if place is Place.DEVICE]
        quantized_slots = [index for index, place in enumerate(places) if place is Place.QUANTIZED]
        return MixedBlocks(
            torch.tensor(device_slots, device=device, dtype=torch.long),
            torch.tensor([table[i] for i in device_slots], device=device, dtype=torch.long),
            torch.tensor(quantized_slots, device=device),
            torch.tensor([table[i] for i in quantized_slots], device=device),
            self.quant_pools[request.kv.quant],
            len(table),
        )


def _place(compactions: list, ordered: list[Chunk]) -> list:
    """Tell each compaction where its chunk's queries are in the flat step."""
    first, span = 0, {}
    for chunk in ordered:
        span[id(chunk)] = (first, first + chunk.end - chunk.start)
        first += chunk.end - chunk.start
    for compaction in compactions:
        compaction.first, compaction.last = span[id(compaction.chunk)]
    return compactions


def _region_fields(chunk: Chunk, device) -> dict:
    """AttentionGroup fields for a chunk whose request holds a region: the region, the positions
    of its block keys (a shared prefix's are its indices; the tail's are shifted by kv_offset) and
    of its queries. Empty otherwise."""
    request = chunk.request
    if request.region is None:
        return {}
    indices = torch.arange(_kv_span(chunk)[1], device=device)
    key_positions = torch.where(indices < request.reused, indices, indices + request.kv_offset)
    queries = torch.arange(chunk.start, chunk.end, device=device)
    return {"region": request.region, "key_positions": key_positions, "region_query_positions": queries}


def _scores_prompt(chunk) -> bool:
    """A chunk of prompt tokens whose request asked for their log-probabilities."""
    if getattr(chunk, "reconstruction", None) is not None:  # KVzip's pass re-reads, it is never scored
        return False
    request = chunk.request
    return getattr(request, "prompt_logprobs", None) is not None and chunk.start < len(request.prompt) - 1


def _own_group(request) -> bool:
    """Its decode attends alone: quantized blocks or a head region to read besides its table, or
    Quest's page selection."""
    quantized = request.kv is not None and request.kv.quant is not None and Place.QUANTIZED in request.blocks.places
    return quantized or request.region is not None or _selects_pages(request)


def _by_quantizer(plain: list[Chunk], quantized: list[Chunk]) -> list[list[Chunk]]:
    """Decode groups for the CPU kernels: one per quantizer (a kernel call reads one QuantPool),
    the plain requests in the first; one group of plain requests when none is quantized."""
    groups: dict[str, list[Chunk]] = {}
    for chunk in quantized:
        groups.setdefault(chunk.request.kv.quant, []).append(chunk)
    ordered = list(groups.values()) or ([[]] if plain else [])
    if plain:
        ordered[0] = plain + ordered[0]
    return ordered


def _kernel_table(request, count: int) -> list[int]:
    """The first `count` entries of `request`'s block table for the CPU kernel: a pool block's id,
    or -id - 1 for a block of its QuantPool."""
    ids, places = request.blocks.block_ids[:count], request.blocks.places[:count]
    return [-block - 1 if place is Place.QUANTIZED else block for block, place in zip(ids, places)]


def _selects_pages(request) -> bool:
    return request.kv is not None and request.kv.selects_pages and request.region is None


def _kv_span(chunk: Chunk) -> tuple[int, int]:
    """The chunk's tokens as KV slot indices (positions less the tokens its request evicted)."""
    return chunk.start - chunk.request.kv_offset, chunk.end - chunk.request.kv_offset


# One SDPA call costs about as much as reading this many padding blocks (measured on CPU).
GROUP_OVERHEAD_BLOCKS = 16


def decode_buckets(chunks: list[Chunk], block_size: int) -> list[list[Chunk]]:
    """Split one-token chunks into groups by length so little is padded: every row of a group is
    padded to its longest, so one group for lengths 300..1100 reads 1.5x the keys it needs.

    Sorted longest first, the split minimising padded blocks + GROUP_OVERHEAD_BLOCKS per group is
    a contiguous partition; an O(n^2) dynamic programme finds it (n <= the running requests).
    """
    if not chunks:
        return []
    ordered = sorted(chunks, key=lambda c: -c.end)
    blocks = [-(-c.end // block_size) for c in ordered]
    best = [0.0] + [float("inf")] * len(ordered)  # best[j]: cost of the first j rows
    cut = [0] * (len(ordered) + 1)
    for end in range(1, len(ordered) + 1):
        for start in range(end):
            cost = best[start] + (end - start) * blocks[start] + GROUP_OVERHEAD_BLOCKS
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(ordered)
    while end > 0:
        groups.append(ordered[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def _run_start(table: list[int]) -> int | None:
    """table[0] when the blocks are consecutive ids (one slice of the pool), else None."""
    return (
        table[0]
        if table and table[-1] - table[0] == len(table) - 1 and table == list(range(table[0], table[0] + len(table)))
        else None
    )
