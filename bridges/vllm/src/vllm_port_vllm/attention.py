"""An attention backend for vLLM on the bound ``reshape_and_cache``, ``paged_attention`` and ``prefill_attention``.

vLLM's per-layer KV cache is a logical ``[num_blocks, kv_heads, block_size, 2 * head_size]``
tensor (keys then values in each cell, RFC #42082), whose memory order the backend chooses among
vLLM's layouts. The contract's caches are ``[num_blocks, block_size, kv_heads, head_size]``, so the
backend asks for ``LBNHC`` (token-major blocks: ``[B, N, H, C]`` in memory) and views
``kv_cache.transpose(1, 2)[..., :head_size]`` as the key cache and the rest as the value cache:
no copy, and the strides the contract's kernels read (any strides; unit along the head).

The batch is reordered decodes first (``reorder_batch_threshold = 1``): the decode rows go to
``paged_attention``, the rest (prefills, chunked prefills, prefix hits) to ``prefill_attention``
with their own ``cu_seqlens_q``. The cache write is vLLM's separate ``do_kv_cache_update`` step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout

from .errors import BridgeError
from .runtime import kernels as _kernels
from .runtime import prepare as _prepare

__all__ = ["VllmPortAttentionBackend", "VllmPortAttentionImpl", "VllmPortMetadata", "VllmPortMetadataBuilder"]


class VllmPortAttentionBackend(AttentionBackend):
    """Decoder self-attention of the Llama family on the bound plugin's kernels."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [16, 32, 64, 128]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 1

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM's name for a third-party backend; the bridge registers itself under it too

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[VllmPortAttentionImpl]:
        return VllmPortAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[VllmPortMetadataBuilder]:
        return VllmPortMetadataBuilder


@dataclass
class VllmPortMetadata:
    """One step's batch, split into its decode rows (first) and the rest."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    prefill_cu_seqlens_q: torch.Tensor | None


class VllmPortMetadataBuilder(AttentionMetadataBuilder[VllmPortMetadata]):
    """Builds :class:`VllmPortMetadata` from vLLM's common metadata; decodes are ordered first."""

    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> VllmPortMetadata:
        m = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        loc = m.query_start_loc
        prefill_loc = (loc[num_decodes:] - loc[num_decodes]) if num_prefills else None
        return VllmPortMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            max_query_len=m.max_query_len,
            query_start_loc=loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            prefill_cu_seqlens_q=prefill_loc,
        )


def _caches(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's key and value caches, ``[num_blocks, block_size, kv_heads, head_size]``, as views."""
    cells = kv_cache.transpose(1, 2)  # [blocks, block_size, kv_heads, 2 * head_size]
    return cells[..., :head_size], cells[..., head_size:]


class VllmPortAttentionImpl(AttentionImpl[VllmPortMetadata]):
    """Runs the bound kernels of the plugin for one attention layer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        refused = {
            "alibi_slopes": alibi_slopes is not None,
            f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto",
            f"attn_type={attn_type!r}": attn_type != AttentionType.DECODER,
            "attention sinks": sinks is not None,
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
        }
        if any(refused.values()):
            raise BridgeError(
                "vllm-port bridge: the attention contract has no "
                f"{', '.join(k for k, v in refused.items() if v)}; run this model without the bridge "
                "(pip uninstall vllm-port-vllm)"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = int(sliding_window or 0)
        self.soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        _prepare(torch.get_default_dtype())

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's keys and values into their slots (``reshape_and_cache``)."""
        key_cache, value_cache = _caches(kv_cache, self.head_size)
        tokens = slot_mapping.shape[0]
        _kernels(key.dtype).reshape_and_cache(key[:tokens], value[:tokens], key_cache, value_cache, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: VllmPortMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend every query row of the step; write into ``output`` (``[tokens, heads * head_size]``)."""
        if output_scale is not None or output_block_scale is not None:
            raise BridgeError("vllm-port bridge: fused output quantization has no contract op")
        if attn_metadata is None:  # vLLM's warm-up and profiling runs
            return output
        m = attn_metadata
        kernels = _kernels(query.dtype)
        key_cache, value_cache = _caches(kv_cache, self.head_size)
        out = output.view(-1, self.num_heads, self.head_size)
        q = query.view(-1, self.num_heads, self.head_size)
        d, dt = m.num_decodes, m.num_decode_tokens
        if d:
            out[:dt] = kernels.paged_attention(
                q[:dt], key_cache, value_cache, m.block_table[:d], m.seq_lens[:d], self.scale,
                self.sliding_window, self.soft_cap,
            )  # fmt: skip
        if m.num_prefills:
            end = m.num_actual_tokens
            out[dt:end] = kernels.prefill_attention(
                q[dt:end], key_cache, value_cache, m.block_table[d:], m.prefill_cu_seqlens_q, m.seq_lens[d:],
                m.max_query_len, self.scale, self.sliding_window, self.soft_cap,
            )  # fmt: skip
        return output


def register_attention() -> list[str]:
    """Make vLLM's standard decoder backends resolve to :class:`VllmPortAttentionBackend`; return their names."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = f"{__name__}.VllmPortAttentionBackend"
    replaced = []
    for name in ("CUSTOM", "CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN", "FLASHINFER"):
        member = getattr(AttentionBackendEnum, name, None)
        if member is not None:
            register_backend(member, path)
            replaced.append(name)
    return replaced
