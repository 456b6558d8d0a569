"""Llama 2/3/3.1, Qwen2/Qwen3, Mistral and the MoE families (Qwen3-MoE, Mixtral) as one flat model.

A loop over layers calls the bound contract ops.

There is no module tree. ``forward`` reads top to bottom as the decoder computes: embedding, then per
layer RMSNorm, fused q/k/v projection, rotary embedding, cache write, paged attention, output
projection, residual add, RMSNorm, gated MLP, residual add. It is written in the plain form on
purpose: ``residual = x + residual`` followed by ``rms_norm`` and ``silu(gate) * up`` are left for
the compile backend's fusion passes to find, rather than pre-fused by hand. The families differ only
in data: Qwen2's q/k/v biases go through ``linear``'s bias, tied embeddings reuse the embedding as
the LM head, Mistral's sliding window is an argument of the attention ops, Qwen3's per-head q/k
norm is one ``rms_norm`` call on each of q and k viewed as ``[tokens, heads, head_size]`` (no new op),
and a mixture-of-experts layer's MLP is its router (a ``linear``) and one ``fused_moe`` call. No
device is named here: tensors live wherever the weights were loaded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError
from ..ops import BoundOps
from .config import ModelConfig, load_config
from .loader import check_dtype, expected_weights, expert_weight_names, fp8_weights, load_weights

__all__ = [
    "AttentionMetadata",
    "DecodeRowsFirst",
    "LlamaModel",
    "ModelPart",
    "decode_rows_first",
    "load_model",
    "paged_attention_step",
    "rope_cos_sin_cache",
    "rope_inverse_frequencies",
]


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and which cached tokens each sequence attends to.

    Attributes:
        slot_mapping: int64 ``[num_tokens]``: the cache slot of each token; -1 marks a padding token (not written).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``: each sequence's cache blocks in order.
        seq_lens: int32 ``[num_seqs]``: tokens in the cache including this step's; 0 marks a padding sequence.
        cu_seqlens_q: int32 ``[num_seqs + 1]``: offsets of each sequence's query tokens in the packed batch.
        max_query_len: the most query tokens any sequence has in this step.
        is_decode: every sequence has exactly one query token: ``paged_attention`` serves the step,
            else ``prefill_attention`` (which also takes a cached prefix: chunked prefill, prefix hits).
        num_decodes: in a step that is not a decode step, how many of the first sequences have one query
            token each (decode rows ahead of prefill chunks, where the scheduler puts them). ``paged_attention``
            serves those and ``prefill_attention`` the rest: the prefill kernels give every sequence whole tiles
            of queries, so a decode row among them costs several times what the decode kernel takes for it.
            0: ``prefill_attention`` serves every sequence.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    is_decode: bool
    num_decodes: int = 0


@dataclass(frozen=True)
class DecodeRowsFirst:
    """A step's leading decode rows, served apart from its prefill chunks (see ``AttentionMetadata.num_decodes``).

    Attributes:
        count: the decode rows (the first ``count`` sequences and tokens).
        prefill_cu_seqlens_q: the offsets of the other sequences' query tokens among themselves.
    """

    count: int | torch.SymInt
    prefill_cu_seqlens_q: torch.Tensor


def decode_rows_first(meta: AttentionMetadata) -> DecodeRowsFirst | None:
    """The split of a step's attention into its leading decode rows and the rest, or ``None`` where there is none.

    Computed once a step: the offsets are one subtraction on the device. A traced step (``num_decodes`` symbolic)
    always splits, so one graph serves steps with and without decode rows.
    """
    count = getattr(meta, "num_decodes", 0)
    if meta.is_decode or (isinstance(count, int) and count == 0):
        return None
    return DecodeRowsFirst(count, meta.cu_seqlens_q[count:] - count)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE's ``head_size / 2`` inverse frequencies in float64, with Llama 3.1's scaling when the config asks.

    Llama 3.1 leaves frequencies whose wavelength fits ``high_freq_factor`` times into the original
    context alone, divides those fitting fewer than ``low_freq_factor`` times by ``factor``, and
    blends linearly (in periods per original context) between the two.
    """
    dim = config.head_size
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    periods = scaling["original_max_position_embeddings"] * inv_freq / (2 * math.pi)  # context / wavelength
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    keep = ((periods - low) / (high - low)).clamp(0.0, 1.0)  # 1: high frequency, kept; 0: low, scaled down
    return keep * inv_freq + (1.0 - keep) * inv_freq / scaling["factor"]


def rope_cos_sin_cache(config: ModelConfig, device: torch.device, max_positions: int | None = None) -> torch.Tensor:
    """The ``rotary_embedding`` table: float32 ``[positions, head_size]``, cosines then sines.

    ``positions`` is ``max_positions`` (the engine's ``max_model_len``: what its requests can reach),
    else the config's ``max_position_embeddings``, and never more than that.
    """
    positions = config.max_position_embeddings if max_positions is None else max_positions
    if isinstance(positions, bool) or not isinstance(positions, int) or not 1 <= positions:
        raise ValueError(f"max_positions is {max_positions!r}; it must be an int >= 1 (rotary table rows)")
    positions = min(positions, config.max_position_embeddings)
    inv_freq = rope_inverse_frequencies(config)
    half = inv_freq.shape[0]
    table = torch.empty(positions, 2 * half, dtype=torch.float32)
    for start in range(0, positions, _ROPE_CHUNK):  # float64 angles a chunk at a time: the peak is the table
        angles = torch.arange(start, min(start + _ROPE_CHUNK, positions), dtype=torch.float64)[:, None] * inv_freq
        table[start : start + angles.shape[0], :half] = angles.cos()
        table[start : start + angles.shape[0], half:] = angles.sin()
    return table.to(device=device)


#: Positions whose float64 angles :func:`rope_cos_sin_cache` computes at once.
_ROPE_CHUNK = 1 << 14


def paged_attention_step(
    ops: BoundOps,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    split: DecodeRowsFirst | None = None,
) -> torch.Tensor:
    """One layer's attention over the paged cache: the step's keys and values written, then decode or prefill.

    ``q`` is ``[tokens, heads, head_size]``, ``k``/``v`` ``[tokens, kv_heads, head_size]``; returns ``q``'s shape.
    ``split`` (:func:`decode_rows_first`): the step's leading decode rows go to ``paged_attention``, the rest to
    ``prefill_attention``.
    """
    key_cache, value_cache = kv_cache
    if key_cache.dtype == torch.float8_e4m3fn:  # the *_fp8 cache ops, with the cache's scales after the float ops'
        ops.reshape_and_cache_fp8(k, v, key_cache, value_cache, meta.slot_mapping, KV_SCALE, KV_SCALE)
        decode, prefill, scales = ops.paged_attention_fp8, ops.prefill_attention_fp8, (KV_SCALE, KV_SCALE)
    else:
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        decode, prefill, scales = ops.paged_attention, ops.prefill_attention, ()
    tail = (scale, sliding_window, soft_cap, *scales)

    def rows(q, block_tables, seq_lens):
        return decode(q, key_cache, value_cache, block_tables, seq_lens, *tail)

    def chunks(q, block_tables, cu_seqlens_q, seq_lens):
        return prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, meta.max_query_len, *tail)

    if meta.is_decode:
        return rows(q, meta.block_tables, meta.seq_lens)
    if split is None:
        return chunks(q, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens)
    n = split.count
    return torch.cat(
        (
            rows(q[:n], meta.block_tables[:n], meta.seq_lens[:n]),
            chunks(q[n:], meta.block_tables[n:], split.prefill_cu_seqlens_q, meta.seq_lens[n:]),
        )
    )


#: The FP8 KV cache's scales: 1.0, vLLM's default for ``kv_cache_dtype="fp8"`` without calibrated scales (keys and
#: values of Llama-family models stay well inside e4m3's +-448).
KV_SCALE = 1.0


@dataclass
class _Layer:
    """One decoder layer's tensors; q/k/v and gate/up fused so each is one ``linear``."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_norm: torch.Tensor
    gate_up_weight: torch.Tensor | None  # None in a MoE layer
    down_weight: torch.Tensor | None
    # the norm after this layer's MLP: the next layer's input norm, or the final norm; None for the last layer of a
    # pipeline stage before the last (the next stage normalises the residual it receives with its first input norm)
    next_norm: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # Qwen3's per-head norms, [head_size]
    k_norm: torch.Tensor | None = None
    router_weight: torch.Tensor | None = None  # a MoE layer's router, [num_experts, hidden]
    w13: torch.Tensor | None = None  # its experts' gate and up rows, [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor | None = None  # its experts' down projections, [num_experts, hidden, intermediate]
    # an FP8 checkpoint's float32 scales of the four (fused) projections, as fp8_linear takes them; None for float
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class ModelPart:
    """Which ends of the model a :class:`LlamaModel` holds besides its layers: all of it, or a pipeline stage's part.

    A stage's ``config.num_layers`` is its own layers' count, their weights named from ``model.layers.0``.

    Attributes:
        embedding: the token embedding: the first stage, whose :meth:`LlamaModel.forward` takes token ids.
        head: the final norm and the LM head (the embedding itself where they are tied): the last stage,
            whose hidden states become logits.
    """

    embedding: bool = True
    head: bool = True


class LlamaModel:
    """Llama 2/3/3.1, Qwen2, Qwen3, Mistral, Qwen3-MoE and Mixtral from one flat definition.

    :param weights: tensors by Hugging Face name (see :func:`~vllm_port.models.loader.expected_weights`),
        all of one dtype on one device; the model runs where they are.
    :param consume: remove each tensor from ``weights`` (a dict) once the model holds it, so that
        the unfused q/k/v and gate/up parts are freed layer by layer while fusing: peak memory
        stays one model plus one layer. :func:`load_model` does this.
    :param max_positions: positions the rotary table covers (:attr:`max_positions`); default the
        config's ``max_position_embeddings``. Positions past it must never reach :meth:`forward`.
    :param part: the ends it holds (:class:`ModelPart`): a pipeline stage's leave out the embedding or the
        head, and ``weights`` need not hold them.
    :raises ModelLoadError: for a missing tensor, a shape that disagrees with ``config``, or mixed
        dtypes or devices.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        consume: bool = False,
        max_positions: int | None = None,
        part: ModelPart = ModelPart(),
    ) -> None:
        self.config = config
        self.part = part
        _check_weights(config, weights, part)
        take = weights.pop if consume and isinstance(weights, MutableMapping) else weights.__getitem__
        embedding = part.embedding or (part.head and config.tie_word_embeddings)
        #: the token embedding (None in a pipeline stage after the first, unless it is the tied LM head)
        self.embed_tokens = take("model.embed_tokens.weight") if embedding else None
        #: the final norm and the LM head (None in a pipeline stage before the last)
        self.final_norm = take("model.norm.weight") if part.head else None
        self.lm_head = None
        if part.head:
            self.lm_head = self.embed_tokens if config.tie_word_embeddings else take("lm_head.weight")
        norms = [take(f"model.layers.{i}.input_layernorm.weight") for i in range(config.num_layers)]
        next_norms = [*norms[1:], self.final_norm]
        self.layers = [self._layer(take, i, norms[i], next_norms[i]) for i in range(config.num_layers)]
        self.cos_sin_cache = rope_cos_sin_cache(config, norms[0].device, max_positions)
        self.scale = config.head_size**-0.5

    def _layer(
        self, take: Callable[[str], torch.Tensor], i: int, input_norm: torch.Tensor, next_norm: torch.Tensor
    ) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."

        def fuse(*names: str) -> torch.Tensor:
            return torch.cat([take(name) for name in names])

        def scale(*names: str) -> torch.Tensor | None:  # FP8: the weights' scales, fused as the weights are
            return fuse(*(name + "_scale" for name in names)) if self.config.quantization is not None else None

        qkv = [attn + f"{x}_proj." for x in "qkv"]
        c = self.config
        layer = _Layer(
            input_norm=input_norm,
            qkv_weight=fuse(*(n + "weight" for n in qkv)),
            qkv_bias=fuse(*(n + "bias" for n in qkv)) if c.attention_bias else None,
            o_weight=take(attn + "o_proj.weight"),
            o_bias=take(attn + "o_proj.bias") if c.o_proj_bias else None,
            post_attention_norm=take(p + "post_attention_layernorm.weight"),
            gate_up_weight=None,
            down_weight=None,
            next_norm=next_norm,
            q_norm=take(attn + "q_norm.weight") if c.qk_norm else None,
            k_norm=take(attn + "k_norm.weight") if c.qk_norm else None,
            qkv_scale=scale(*(n + "weight" for n in qkv)),
            o_scale=scale(attn + "o_proj.weight"),
        )
        if c.moe is not None and c.moe.sparse_layers[i]:
            router, experts = expert_weight_names(c, i)
            layer.router_weight = take(router)
            # one expert at a time, so the per-expert tensors are freed while the stacked ones fill
            layer.w13 = torch.stack([torch.cat([take(gate), take(up)]) for gate, up, _ in experts])
            layer.w2 = torch.stack([take(down) for _, _, down in experts])
        else:
            gate_up = (mlp + "gate_proj.weight", mlp + "up_proj.weight")
            layer.gate_up_weight = fuse(*gate_up)
            layer.down_weight = take(mlp + "down_proj.weight")
            layer.gate_up_scale = scale(*gate_up)
            layer.down_scale = scale(mlp + "down_proj.weight")
        return layer

    @property
    def max_positions(self) -> int:
        """Positions the rotary table covers: a token's position must be below it."""
        return int(self.cos_sin_cache.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model runs in (its weights')."""
        return self.layers[0].input_norm.dtype

    @property
    def device(self) -> torch.device:
        """The device the weights are on."""
        return self.layers[0].input_norm.device

    def forward(
        self,
        ops: BoundOps,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden_size]``, for a packed batch of tokens.

        :param ops: ops bound for the model's dtype on the platform holding it.
        :param input_ids: int ``[num_tokens]``, the tokens of every sequence one after the other.
        :param positions: int ``[num_tokens]``, each token's position in its sequence.
        :param kv_caches: per layer ``(key_cache, value_cache)``, each
            ``[num_blocks, block_size, num_kv_heads, head_size]``; this step's keys and values are written in.
        """
        residual = ops.embedding(input_ids, self.embed_tokens)
        return self.forward_layers(ops, residual, positions, kv_caches, meta)[0]

    def forward_layers(
        self,
        ops: BoundOps,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the residual stream ``[num_tokens, hidden_size]`` (the embedding, or what the
        stage before sent): ``(hidden, residual)`` after the last layer.

        ``hidden`` is the residual after the final norm where the model holds its head; a pipeline stage
        before the last passes ``residual`` on, which the next stage normalises with its first input norm
        (the same computation, so a split model computes what the whole one does).
        """
        eps = self.config.rms_norm_eps
        split = decode_rows_first(meta)
        hidden = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            residual = self._attention(ops, layer, hidden, positions, kv_cache, meta, split) + residual
            hidden = ops.rms_norm(residual, layer.post_attention_norm, eps)
            residual = self._mlp(ops, layer, hidden) + residual
            if layer.next_norm is not None:
                hidden = ops.rms_norm(residual, layer.next_norm, eps)
        return hidden, residual

    def _attention(
        self,
        ops: BoundOps,
        layer: _Layer,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        split: DecodeRowsFirst | None = None,
    ) -> torch.Tensor:
        c = self.config
        qkv = _project(ops, hidden, layer.qkv_weight, layer.qkv_scale, layer.qkv_bias)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        if layer.q_norm is not None:  # Qwen3: each head RMS-normalised over its head_size features
            q = ops.rms_norm(q.unflatten(-1, (c.num_heads, c.head_size)), layer.q_norm, c.rms_norm_eps).flatten(-2)
            k = ops.rms_norm(k.unflatten(-1, (c.num_kv_heads, c.head_size)), layer.k_norm, c.rms_norm_eps).flatten(-2)
        ops.rotary_embedding(positions, q, k, c.head_size, self.cos_sin_cache, True)  # HF rotates halves: NeoX
        q = q.unflatten(-1, (c.num_heads, c.head_size))  # views: [tokens, heads, head_size]
        k = k.unflatten(-1, (c.num_kv_heads, c.head_size))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_size))
        out = paged_attention_step(ops, q, k, v, kv_cache, meta, self.scale, c.sliding_window, split=split)
        return _project(ops, out.flatten(-2), layer.o_weight, layer.o_scale, layer.o_bias)

    def _mlp(self, ops: BoundOps, layer: _Layer, hidden: torch.Tensor) -> torch.Tensor:
        if layer.w13 is not None:  # a mixture-of-experts layer: the router, then the experts in one op
            moe = self.config.moe
            router_logits = ops.linear(hidden, layer.router_weight)
            return ops.fused_moe(hidden, router_logits, layer.w13, layer.w2, moe.top_k, "softmax", moe.renormalize)
        gate, up = _project(ops, hidden, layer.gate_up_weight, layer.gate_up_scale).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        return _project(ops, act, layer.down_weight, layer.down_scale)

    def compute_logits(self, ops: BoundOps, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` of hidden states ``[n, hidden_size]`` (the LM head, or the tied embedding)."""
        return ops.linear(hidden, self.lm_head)


def _project(
    ops: BoundOps, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear``, or ``fp8_linear`` for an FP8 checkpoint's projection (one with a scale)."""
    if scale is None:
        return ops.linear(x, weight, bias)
    return ops.fp8_linear(x, weight, scale, bias)


def _check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], part: ModelPart) -> None:
    specs = expected_weights(config)
    if not (part.embedding or (part.head and config.tie_word_embeddings)):
        del specs["model.embed_tokens.weight"]
    if not part.head:
        specs = {k: v for k, v in specs.items() if k not in ("model.norm.weight", "lm_head.weight")}
    first_name = next(iter(specs))  # the embedding, or a pipeline stage's first norm: the dtype all share
    first = weights.get(first_name)
    fp8 = fp8_weights(config)
    for name in fp8:
        if not isinstance(weights.get(name + "_scale"), torch.Tensor):
            raise ModelLoadError(f"weights: tensor {name + '_scale'!r} is missing; the FP8 weight {name!r} needs it")
    for name, spec in specs.items():
        tensor = weights.get(name)
        if not isinstance(tensor, torch.Tensor):
            raise ModelLoadError(f"weights: tensor {name!r} is missing; {config.architecture} needs it ({spec.why})")
        if tuple(tensor.shape) != spec.shape:
            raise ModelLoadError(
                f"weights: tensor {name!r} has shape {list(tensor.shape)}; the config implies {list(spec.shape)} ({spec.why})"
            )
        if name in fp8 and tensor.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(
                f"weights: tensor {name!r} is {tensor.dtype}; an FP8 checkpoint's projection is float8_e4m3fn"
            )
        if first is not None and name not in fp8 and (tensor.dtype != first.dtype or tensor.device != first.device):
            raise ModelLoadError(
                f"weights: tensor {name!r} is {tensor.dtype} on {tensor.device} but {first_name!r} is {first.dtype} "
                f"on {first.device}; load every weight in one dtype on one device"
            )
    check_dtype(first.dtype)


def load_model(
    model_dir: str | os.PathLike[str], device: torch.device | str, dtype: torch.dtype, max_positions: int | None = None
) -> LlamaModel:
    """Read ``config.json``, stream the safetensors weights to ``device`` in ``dtype``, and build the model.

    ``max_positions``: the rotary table's rows (default the config's ``max_position_embeddings``).

    :raises ModelLoadError: for anything in the directory the model cannot run (see
        :func:`~vllm_port.models.config.load_config` and :func:`~vllm_port.models.loader.load_weights`).
    """
    config = load_config(model_dir)
    weights = load_weights(model_dir, config, device, dtype)
    return LlamaModel(config, weights, consume=True, max_positions=max_positions)
