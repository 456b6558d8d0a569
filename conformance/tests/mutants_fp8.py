"""Mutants of ``fp8_linear``: providers with one realistic FP8 bug each, in one platform plugin (its own batch).

Each quantises activations per token as a Hopper kernel does, except for its one bug, and is refused by
``fp8_linear``'s check (values within the per-token e4m3 quantisation's error of the float64 oracle) on
the hand sample that varies what the bug gets wrong.
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

SOURCE = """
import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from vllm_port.ops import kv_fp8
from vllm_port.ops.attention import decode_attend, prefill_attend
from vllm_port.ops.fp8 import FP8_GROUP, FP8_MAX, check_fp8_linear, dequantize_fp8_weight


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="mutant-fp8", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))


def _fp8_linear(x, weight, weight_scale, bias, bug):
    check_fp8_linear(x, weight, weight_scale, bias)
    rows = x.reshape(-1, x.shape[-1]).float()
    amax = rows.abs().amax() if bug == "one scale for the batch" else rows.abs().amax(dim=-1, keepdim=True)
    act, top = (torch.float8_e5m2, 57344.0) if bug == "e5m2 activations" else (torch.float8_e4m3fn, FP8_MAX)
    scale = amax.clamp(min=1e-12) / top
    q = (rows / scale).clamp(-top, top).to(act).float() * scale
    if bug == "weight scale ignored":
        w = weight.float()
    elif bug == "first channel's scale for all" and weight_scale.dim() == 1:
        w = weight.float() * weight_scale.reshape(-1)[0]
    elif bug == "one row: first channel's scale for all" and weight_scale.dim() == 1 and rows.shape[0] == 1:
        w = weight.float() * weight_scale.reshape(-1)[0]
    elif bug == "groups of 64" and weight_scale.dim() == 2:
        group = (torch.arange(weight.shape[1]) // (FP8_GROUP // 2)).clamp(max=weight_scale.shape[1] - 1)
        w = weight.float() * weight_scale[:, group]
    else:
        w = dequantize_fp8_weight(weight, weight_scale, torch.float32)
    y = q @ w.T
    if bias is not None:
        y = y + (bias.float() * (weight_scale.reshape(-1)[0] if bug == "bias scaled" else 1.0))
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _mutant(name, bug):
    def fn(x, weight, weight_scale, bias=None):
        return _fp8_linear(x, weight, weight_scale, bias, bug)
    return Provider("fp8_linear", name, fn, dtypes=frozenset({torch.bfloat16}))


def _truncated(x, scale):
    # rounds toward zero on e4m3's grid (a conversion without round-to-nearest)
    v = (x.float() / scale).clamp(-448.0, 448.0)
    step = torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))).clamp(min=-6.0) - 3.0)
    return (torch.trunc(v / step) * step).to(torch.float8_e4m3fn)


def _write(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0, bug=""):
    kv_fp8.check_reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    quantize = _truncated if bug == "truncates" else kv_fp8.quantize_kv
    k_scale = 1.0 if bug == "k_scale ignored" else k_scale
    key_cache[slots // block_size, slots % block_size] = quantize(key[keep], k_scale)
    value_cache[slots // block_size, slots % block_size] = quantize(value[keep], v_scale)


def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0,
            k_scale=1.0, v_scale=1.0, bug=""):
    kv_fp8.check_paged_attention_fp8(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                     soft_cap, k_scale, v_scale)
    if bug == "v_scale ignored":
        v_scale = 1.0
    k = kv_fp8.dequantize_kv(key_cache, k_scale, torch.float32)
    v = kv_fp8.dequantize_kv(value_cache, v_scale, torch.float32)
    if bug == "query in e4m3":  # the query converted to the cache's dtype for the score dot (q.to(k.dtype))
        query = query.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(query.dtype)
    return decode_attend(query, k, v, block_tables, seq_lens, scale, sliding_window, soft_cap)


def _prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
             sliding_window=0, soft_cap=0.0, k_scale=1.0, v_scale=1.0, bug=""):
    kv_fp8.check_prefill_attention_fp8(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                       max_query_len, scale, sliding_window, soft_cap, k_scale, v_scale)
    k = kv_fp8.dequantize_kv(key_cache, 1.0 if bug == "k_scale ignored" else k_scale, torch.float32)
    v = kv_fp8.dequantize_kv(value_cache, v_scale, torch.float32)
    return prefill_attend(query, k, v, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, soft_cap)


def _cache_mutant(op, name, bug):
    if op == "reshape_and_cache_fp8":
        def fn(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
            return _write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, bug)
    elif op == "paged_attention_fp8":
        def fn(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0,
               k_scale=1.0, v_scale=1.0):
            return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap,
                           k_scale, v_scale, bug)
    else:
        def fn(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
               sliding_window=0, soft_cap=0.0, k_scale=1.0, v_scale=1.0):
            return _prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
                            sliding_window, soft_cap, k_scale, v_scale, bug)
    return Provider(op, name, fn, dtypes=frozenset({torch.bfloat16}))


CACHE_BUGS = {
    "k_scale_ignored_reshape_and_cache_fp8": ("reshape_and_cache_fp8", "k_scale ignored"),
    "truncating_reshape_and_cache_fp8": ("reshape_and_cache_fp8", "truncates"),
    "v_scale_ignored_paged_attention_fp8": ("paged_attention_fp8", "v_scale ignored"),
    "e4m3_query_paged_attention_fp8": ("paged_attention_fp8", "query in e4m3"),
    "k_scale_ignored_prefill_attention_fp8": ("prefill_attention_fp8", "k_scale ignored"),
}


BUGS = {
    "scale_ignored_fp8_linear": "weight scale ignored",
    "first_channel_scale_fp8_linear": "first channel's scale for all",
    "one_row_first_channel_scale_fp8_linear": "one row: first channel's scale for all",
    "groups_of_64_fp8_linear": "groups of 64",
    "batch_amax_fp8_linear": "one scale for the batch",
    "e5m2_activations_fp8_linear": "e5m2 activations",
    "bias_scaled_fp8_linear": "bias scaled",
}


@hookimpl
def vllm_port_providers():
    return [_mutant(name, bug) for name, bug in BUGS.items()] + [
        _cache_mutant(op, name, bug) for name, (op, bug) in CACHE_BUGS.items()
    ]
"""


def _refused(name: str, bug_class: str, bug: str, case: str, *says: str, op: str = "fp8_linear") -> Mutant:
    """A mutant refused by its op's check against the float64 oracle, on ``case``."""
    check = f"test_ops::test_provider_matches_reference[{op}-{name}-bfloat16]"
    return Mutant(name, bug, bug_class, check, (f"case {case!r}", *says))


GROUPS = [
    MutantGroup(
        "mutant-fp8",
        SOURCE,
        (
            _refused("scale_ignored_fp8_linear", "fp8: scales", "multiplies by the e4m3 weight without its scale",
                     "small, per tensor", "elements off"),
            _refused("first_channel_scale_fp8_linear", "fp8: scales",
                     "treats a per-channel scale as per-tensor (the first channel's scale for every channel)",
                     "per-channel scales across 6 decades", "elements off"),
            _refused("one_row_first_channel_scale_fp8_linear", "fp8: scales",
                     "on one row only (a decode kernel's own path), the first channel's scale for every channel",
                     "one row, per-channel scales across 6 decades", "elements off"),
            _refused("groups_of_64_fp8_linear", "fp8: scales",
                     "reads the per-group scales as groups of 64 input features, not 128",
                     "groups of 128, in_features 320 (a partial group)", "elements off"),
            _refused("batch_amax_fp8_linear", "fp8: activation quantisation",
                     "quantises activations with one scale for the whole batch, not one per token",
                     "tokens across 6 decades of magnitude", "for per-token e4m3 quantisation"),
            _refused("e5m2_activations_fp8_linear", "fp8: activation quantisation",
                     "quantises activations to e5m2 (2 fraction bits), not e4m3",
                     "64 rows, 512 -> 256 (error statistics)", "elements off"),
            _refused("bias_scaled_fp8_linear", "fp8: scales", "multiplies the bias by the weight scale too",
                     "small, per channel, bias", "elements off"),
            _refused("k_scale_ignored_reshape_and_cache_fp8", "fp8: KV cache", "writes e4m3(key), not e4m3(key / k_scale)",
                     "small", "key_cache:", op="reshape_and_cache_fp8"),
            _refused("truncating_reshape_and_cache_fp8", "fp8: KV cache",
                     "rounds keys and values toward zero on e4m3's grid, not to nearest even", "small", "elements off",
                     op="reshape_and_cache_fp8"),
            _refused("v_scale_ignored_paged_attention_fp8", "fp8: KV cache", "decode reads values without v_scale",
                     "block boundaries, gqa 1", "elements off", op="paged_attention_fp8"),
            _refused("e4m3_query_paged_attention_fp8", "fp8: KV cache",
                     "decode converts the query to the cache's e4m3 for the score product (q.to(k.dtype), not k.to(q.dtype))",
                     "llama3-8b decode", "output:", op="paged_attention_fp8"),
            _refused("k_scale_ignored_prefill_attention_fp8", "fp8: KV cache", "prefill scores keys without k_scale",
                     "block boundaries, gqa 1", "elements off", op="prefill_attention_fp8"),
        ),
    )
]  # fmt: skip
