"""The import check: what no piece's graph shows, checked against ``transformers`` itself.

The skeleton (embedding, rotary cos/sin from the positions, layers, final norm, LM head) is an
assumption about the model's top-level ``forward``, and the attention mask, which the importer
never traces, may carry a sliding window the attention call does not. So every import
cross-checks each layer's window with the config, then runs the imported model (a prefill and one
decode step on a small paged cache) and ``transformers`` on the same prompt, and refuses the model
when their logits or their greedy tokens disagree.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..models import AttentionMetadata
from ._trace import ImporterError

__all__ = ["TIE_MARGIN", "TRUTH_FACTOR", "VERIFY_TOKENS", "VERIFY_TOLERANCE", "check_windows", "verify_import"]

#: Relative logit error (max |ours - transformers| over max(1, max |transformers|)) the import check allows
#: without a second opinion. In 16-bit dtypes it is not a bound on a correct import: two correct bfloat16
#: runs differ by the sum of their own rounding errors, which grow with the model (depth, widths, the
#: magnitude of the residual stream), so a correct import can land past any fixed number (a Llama with
#: head_dim 48 did: 0.109). Past it, a 16-bit check asks the float32 truth (:data:`TRUTH_FACTOR`).
VERIFY_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.1, torch.float16: 5e-2}
#: The second opinion of a 16-bit check past :data:`VERIFY_TOLERANCE`: ``transformers`` runs in float32
#: (a copy of the model), and the import passes when its logits are at most this many times as far from
#: that float32 truth as ``transformers``' own 16-bit logits are (plus :data:`TRUTH_FLOOR`). The tolerance so
#: scales with the model's own 16-bit error, whatever makes it large: a correct import rounds as often as
#: transformers does, in another order (measured on the test families and random Llamas of 2-32 layers in
#: bfloat16: 0.6-1.3x); an import that drops or doubles a term is off by the term, not by a rounding.
TRUTH_FACTOR = 2.0
#: Added to the second opinion's allowance (relative to the logits' scale): where transformers' own 16-bit
#: error happens to be tiny, one rounding of the logits themselves (2^-8 in bfloat16) must still pass.
TRUTH_FLOOR = 1e-2
#: Below this margin (same scale) between transformers' two best logits a position is a tie at the
#: dtype's precision, where either greedy token is right. Set at about three times the error of a
#: correct import: correct bfloat16 imports of the test families and of a random 8-layer Llama
#: differ from transformers by about 0.01 of the scale (greedy flips seen at margins up to 0.02),
#: float32 ones by under 1e-4. Above it the greedy tokens must agree, a stricter test than the
#: logit tolerance.
TIE_MARGIN = {torch.float32: 3e-4, torch.float64: 1e-8, torch.bfloat16: 4e-2, torch.float16: 1e-2}
#: Tokens of the import check's prompt: longer than a typical test sliding window, short for a big model.
VERIFY_TOKENS = 12
#: The layer types of ``config.layer_types`` the importer knows, and whether each uses the window.
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


class ModelUnderCheck(Protocol):
    """What the import check runs: :class:`vllm_port.importer.ImportedModel`'s interface, as the engine calls it.

    Named here by what it does, so the check never imports the module that calls it.
    """

    @property
    def config(self) -> Any: ...  # an ImportedConfig: sizes, vocabulary, architecture

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def forward(
        self, ops: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, ops: Any, hidden: torch.Tensor) -> torch.Tensor: ...


def check_windows(who: str, config: Any, windows: Sequence[int]) -> None:
    """Refuse a layer whose attention call's sliding window is not the one its config asks for.

    The window the paged ops apply is the one each layer passes to its attention function. A
    model that applies its window through the attention mask alone (built in the top-level
    ``forward``, which the importer does not trace) would run full attention here, silently on any
    prompt shorter than the window; the config says which window transformers applies.

    :param windows: each layer's window as its traced attention call passes it (0: none).
    :raises ImporterError: naming the layer, both windows and the fix.
    """
    window = int(getattr(config, "sliding_window", None) or 0)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 before layer_types
        window = 0
    types = getattr(config, "layer_types", None)
    if types is None:
        expected = [window] * len(windows)
    else:
        unknown = sorted({str(t) for t in types} - set(_LAYER_TYPES))
        if unknown or len(types) != len(windows):
            raise ImporterError(
                f"{who}: config.layer_types is {list(types)!r}; the importer knows {', '.join(_LAYER_TYPES)} for each "
                f"of the {len(windows)} layers, so this model's attention cannot be imported; run it with "
                "transformers itself"
            )
        expected = [window if _LAYER_TYPES[t] else 0 for t in types]
    for i, (got, want) in enumerate(zip(windows, expected, strict=True)):
        if got != want:
            layer_type = f", config.layer_types[{i}]={types[i]!r}" if types is not None else ""
            raise ImporterError(
                f"{who} layers.{i} calls its attention with sliding window {got or 'none'}, but its config asks for "
                f"{want or 'none'} (config.sliding_window={getattr(config, 'sliding_window', None)!r}{layer_type}). "
                "The importer applies the window the attention call passes; a model that applies its window through "
                "the attention mask alone would run the wrong attention here. Pass the window to the attention "
                "function (sliding_window=..., as transformers' Mistral and Qwen2 do) or correct the config; "
                "otherwise run this model with transformers itself"
            )


def verify_import(model: ModelUnderCheck, hf_model: torch.nn.Module, runtime: Any) -> float:
    """Prefill ``VERIFY_TOKENS - 1`` tokens and decode one with ``model``; compare with ``hf_model`` on the same ids.

    :returns: the larger relative logit error of the two phases.
    :raises ImporterError: when either phase's logits differ by more than ``VERIFY_TOLERANCE`` or a
        greedy token differs (ties at the dtype's precision apart), with both errors and how to
        tell the model's fault from the importer's or a kernel's.
    """
    c = model.config
    n = min(VERIFY_TOKENS, c.max_position_embeddings)
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.no_grad():
        want = hf_model(input_ids=ids[None], use_cache=False).logits[0].float()
    got = _run_imported(model, runtime, ids)
    scale = max(1.0, float(want.abs().max()))
    phases = {"prefill": slice(0, n - 1), "decode": slice(n - 1, n)}
    errors = {phase: float((got[s] - want[s]).abs().max()) / scale for phase, s in phases.items()}
    tolerance = VERIFY_TOLERANCE.get(model.dtype, 0.1)
    best = want.topk(min(2, want.shape[-1]), dim=-1).values
    decisive = best[:, 0] - best[:, -1] > TIE_MARGIN.get(model.dtype, 4e-2) * scale
    flipped = ((got.argmax(-1) != want.argmax(-1)) & decisive).nonzero().flatten().tolist()
    if flipped or not all(math.isfinite(e) and e <= tolerance for e in errors.values()):
        opinion = None if flipped else _against_float32(hf_model, ids, got, want, phases, scale)
        if opinion is not None and opinion[0]:
            return max(errors.values())
        raise ImporterError(_refusal(model, runtime, n, errors, tolerance, flipped) + (opinion[1] if opinion else ""))
    return max(errors.values())


def _against_float32(
    hf_model: torch.nn.Module, ids: torch.Tensor, got: torch.Tensor, want: torch.Tensor, phases: dict, scale: float
) -> tuple[bool, str] | None:
    """Whether ``got`` is as close to float32 ``transformers`` as its 16-bit run ``want`` (:data:`TRUTH_FACTOR`).

    Returns ``(passed, what was measured)``, or None for a float32 or float64 model (its error is its own
    arithmetic's, no second opinion) or when the float32 copy does not fit.
    """
    if next(hf_model.parameters()).dtype not in (torch.bfloat16, torch.float16):
        return None
    try:  # a float32 copy for one forward, freed with the expression
        with torch.no_grad():
            truth = copy.deepcopy(hf_model).float()(input_ids=ids[None], use_cache=False).logits[0].float()
    except torch.OutOfMemoryError:
        return None
    ours = {p: float((got[s] - truth[s]).abs().max()) / scale for p, s in phases.items()}
    theirs = {p: float((want[s] - truth[s]).abs().max()) / scale for p, s in phases.items()}
    passed = all(math.isfinite(ours[p]) and ours[p] <= TRUTH_FACTOR * theirs[p] + TRUTH_FLOOR for p in phases)
    measured = "; ".join(f"{p}: {ours[p]:.3g} against transformers' {theirs[p]:.3g}" for p in phases)
    return passed, (
        f". Against transformers in float32 the imported logits are off by ({measured}); allowed {TRUTH_FACTOR:g}x "
        f"transformers' own error + {TRUTH_FLOOR:g}"
    )


def _run_imported(model: ModelUnderCheck, runtime: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` from the imported model: all but the last in one prefill, the last in a decode step."""
    c, device, n = model.config, model.device, ids.shape[0]
    ops = runtime.bind(model.dtype)
    block = runtime.platform.kv_block_size  # the block size the engine will run the model with
    blocks = -(-n // block)
    caches = [
        tuple(torch.zeros(blocks, block, c.num_kv_heads, c.head_size, dtype=model.dtype, device=device) for _ in "kv")
        for _ in range(c.num_layers)
    ]
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    i32 = dict(dtype=torch.int32, device=device)
    positions = torch.arange(n, device=device)  # also the slots: the table holds blocks 0, 1, ... in order
    prefill = AttentionMetadata(
        positions[: n - 1], table, torch.tensor([n - 1], **i32), torch.tensor([0, n - 1], **i32), n - 1, is_decode=False
    )
    decode = AttentionMetadata(
        positions[n - 1 :], table, torch.tensor([n], **i32), torch.tensor([0, 1], **i32), 1, is_decode=True
    )
    with torch.no_grad():
        first = model.forward(ops, ids[: n - 1], positions[: n - 1], caches, prefill)
        last = model.forward(ops, ids[n - 1 :], positions[n - 1 :], caches, decode)
        return model.compute_logits(ops, torch.cat([first, last])).float()


def _refusal(
    model: ModelUnderCheck, runtime: Any, n: int, errors: dict[str, float], tolerance: float, flipped: list[int]
) -> str:
    dtype = str(model.dtype).removeprefix("torch.")
    platform = runtime.platform.name
    tokens = f"; greedy tokens differ at positions {flipped} of {n}" if flipped else "; greedy tokens agree"
    return (
        f"{model.config.architecture}: the import check against transformers failed on platform {platform!r}: "
        f"prefill logits ({n - 1} tokens) differ by {errors['prefill']:.3g} and decode logits (1 step) by "
        f"{errors['decode']:.3g}, relative to the logits' scale (allowed {tolerance:g} in {dtype}){tokens}. "
        "Either the model's top-level forward does work outside the pieces the importer traces (the embedding "
        "module -> layers -> norm -> the causal LM's forward after its base model), such as scaling the hidden "
        "states between layers, and this model is not supported; or the importer or one of the platform's "
        "kernels is at fault. To tell which, import it on "
        "another platform (`--device cpu`, `vllm_port.load(device='cpu')`) or with reference kernels "
        "(VLLM_PORT_OP_PROVIDERS=<op>=reference): if the check passes there, a kernel is at fault (`vllm-port "
        "doctor`); if only decode differs, suspect the paged cache path (reshape_and_cache, paged_attention). "
        "import_model(..., verify=False) skips the check (only to debug the importer)"
    )
