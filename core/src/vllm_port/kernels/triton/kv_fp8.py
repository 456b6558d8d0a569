"""The FP8 KV cache's Triton providers: the shared cache and attention kernels, launched on e4m3 caches.

``reshape_and_cache_fp8`` is the cache copy with its quantising epilogue (the division by the scale in float32,
then e4m3, :func:`.fp8_linear.to_e4m3`). The attention ops run the float kernels of :mod:`.attention` unchanged
but for two folds: ``k_scale`` multiplies the softmax scale (scores are ``q . k * scale``, and ``k`` is the code
times ``k_scale``), ``v_scale`` the output (``out_scale``); the kernels widen e4m3 keys and values to the query's
dtype as they load them (exact), so the probabilities are rounded to the query's dtype, not to e4m3. Half the
bytes of a bfloat16 cache cross the bus; the tiles are the float ones (TMA loads stay off for FP8 caches until
measured on a GPU).
"""

from __future__ import annotations

import torch

from ...ops.kv_fp8 import check_paged_attention_fp8, check_prefill_attention_fp8, check_reshape_and_cache_fp8
from ..triton_target import TritonTarget
from .attention import AttentionKernels
from .cache import CacheKernels

__all__ = ["Fp8CacheKernels"]


class Fp8CacheKernels:
    """Triton providers of ``reshape_and_cache_fp8``, ``paged_attention_fp8`` and ``prefill_attention_fp8``."""

    OPS = ("reshape_and_cache_fp8", "paged_attention_fp8", "prefill_attention_fp8")

    def __init__(self, target: TritonTarget) -> None:
        self.target = target
        self._cache = CacheKernels(target)
        self._attention = AttentionKernels(target)

    def reshape_and_cache_fp8(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """See :func:`vllm_port.ops.kv_fp8.reshape_and_cache_fp8_reference`."""
        check_reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        round_first = key.device.type == "cpu" or not self.target.fp8_dot  # no exact hardware conversion
        self._cache._write(
            key, value, key_cache, value_cache, slot_mapping, (float(k_scale), float(v_scale)), round_first
        )

    def paged_attention_fp8(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """See :func:`vllm_port.ops.kv_fp8.paged_attention_fp8_reference`."""
        check_paged_attention_fp8(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                  soft_cap, k_scale, v_scale)  # fmt: skip
        return self._attention._decode(query, key_cache, value_cache, block_tables, seq_lens, scale * k_scale,
                                       sliding_window, soft_cap, out_scale=v_scale)  # fmt: skip

    def prefill_attention_fp8(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        max_query_len: int,
        scale: float,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """See :func:`vllm_port.ops.kv_fp8.prefill_attention_fp8_reference`."""
        check_prefill_attention_fp8(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                    max_query_len, scale, sliding_window, soft_cap, k_scale, v_scale)  # fmt: skip
        return self._attention._prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                        max_query_len, scale * k_scale, sliding_window, soft_cap, out_scale=v_scale)  # fmt: skip
