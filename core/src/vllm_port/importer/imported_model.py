"""``import_model``: a ``transformers`` causal LM as a flat model over the paged KV cache.

The skeleton (what runs between the pieces) is the decoder-only one of Llama, Qwen2, Mistral,
Phi-3, Gemma-2 and the many models shaped like them: token embedding, rotary cos/sin from the
positions, decoder layers, final norm, LM head (traced as the causal LM's forward after its base
model, so a final soft cap comes with it). The pieces are found through transformers' own accessors
(``get_input_embeddings``, ``get_output_embeddings``, the base model's ``layers``, ``norm`` and
``rotary_emb``); what each piece computes is read from its traced graph (``_rewrite``). Because the
skeleton is an assumption about the model's top-level ``forward``, every import ends with the
import check (``_verify``): each layer's sliding window against the config, then the imported model
and ``transformers`` on the same short prompt (prefill, then one decode step), refusing the model
when their logits or greedy tokens disagree.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._contract import split_once
from ._piece import Mapped, PieceReport
from ._rewrite import rewrite_piece
from ._trace import EXAMPLE_TOKENS, ImporterError, attention_seam, trace_piece
from ._verify import check_windows, verify_import

__all__ = ["ImportedConfig", "ImportedModel", "import_model"]


@dataclass(frozen=True)
class ImportedConfig:
    """What the engine reads of an imported model (the fields of ``vllm_port.models.ModelConfig`` it uses).

    Sizes of attention (heads, KV heads, head size, window) come from the traced graph, the rest
    from the ``transformers`` config.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int
    sliding_window: int
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool


@dataclass
class ImportReport:
    """What the import recognised and what stays native, per piece; ``verify_error``: the import check's error.

    ``notes`` are about the whole model (e.g. fewer positions served than the config names).
    """

    architecture: str
    pieces: list[PieceReport] = field(default_factory=list)
    verify_error: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def mapped(self) -> list[Mapped]:
        return [m for p in self.pieces for m in p.mapped]

    @property
    def native(self) -> list[dict[str, str]]:
        return [n for p in self.pieces for n in p.native]

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "mapped": [m.to_json() for m in self.mapped],
            "native": self.native,
            "views": sum(p.views for p in self.pieces),
            "notes": [*self.notes, *(f"{p.piece}: {n}" for p in self.pieces for n in p.notes)],
            "verify_error": self.verify_error,
        }


class ImportedModel:
    """A ``transformers`` causal LM rewritten into contract ops: the interface of ``vllm_port.models.LlamaModel``.

    ``forward(ops, input_ids, positions, kv_caches, meta)`` and ``compute_logits(ops, hidden)``
    take the bound ops like the core model does, so everything that runs a core model runs this
    one: ``ModelRunner`` (eager step), ``vllm_port.flat.trace``/``FlatModel`` (flat graphs, fusion
    passes, compilation, decode capture) and ``vllm-port inspect``.

    Attributes:
        layers: each decoder layer's rewritten ``torch.fx.GraphModule``; called as
            ``layer(ops, positions, key_cache, value_cache, meta, hidden, cos, sin)``, with ``hidden``
            (and its result) rows ``[tokens, hidden_size]`` and ``meta`` the step's attention metadata, or
            it with its decode rows' split taken once for all layers (``_contract.split_once``).
        embed, norm, lm_head: the other pieces, rewritten the same way (``embed`` gives rows, ``norm``
            takes and gives rows; ``lm_head`` takes ``[1, n, hidden_size]``).
        report: the :class:`ImportReport`.
    """

    def __init__(
        self,
        layers: list[torch.fx.GraphModule],
        embed: torch.fx.GraphModule,
        norm: torch.fx.GraphModule,
        lm_head: torch.fx.GraphModule,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        config: ImportedConfig,
        report: ImportReport,
    ) -> None:
        self.layers = layers
        self.embed = embed
        self.norm = norm
        self.lm_head = lm_head
        self.config = config
        self.report = report
        #: the model's own cos/sin tables ``[max_position, rotary_dim]``, kept only when a rotary stayed native
        self._cos_sin = cos_sin
        self._dtype = config.dtype

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model runs in."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """The device of the weights."""
        return next(iter(self.lm_head.buffers())).device

    def forward(
        self,
        ops: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden_size]`` (as ``LlamaModel.forward``)."""
        # the embedding, the layers and the final norm pass hidden states as rows [tokens, hidden] (``_rows``)
        hidden = self.embed(ops, positions, None, None, meta, input_ids)
        cos = sin = None
        if self._cos_sin is not None:  # a rotary embedding stayed native: it reads the model's cos/sin
            cos, sin = (t[positions].unsqueeze(0) for t in self._cos_sin)
        step = split_once(meta)  # the decode rows' split, taken once for every layer's attention
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = layer(ops, positions, key_cache, value_cache, step, hidden, cos, sin)
        return self.norm(ops, positions, None, None, meta, hidden)

    def compute_logits(self, ops: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` of hidden states ``[n, hidden_size]``."""
        return self.lm_head(ops, None, None, None, None, hidden[None])[0]


# --- import ----------------------------------------------------------------------------------------


def _who(model: Any) -> str:
    return type(model).__name__


def _skeleton(model: torch.nn.Module) -> dict[str, Any]:
    """The pieces of a decoder-only causal LM, found through transformers' accessors."""
    who = _who(model)
    hint = (
        "the importer runs decoder-only causal LMs built as token embedding -> decoder layers (with rotary "
        "position embeddings) -> final norm -> LM head, as Llama, Qwen2, Mistral, Phi-3 and Gemma-2 are"
    )
    if not isinstance(model, torch.nn.Module):
        raise ImporterError(f"import_model: got a {who}, not a torch.nn.Module; pass a transformers causal LM ({hint})")
    base = getattr(model, "base_model", None) or getattr(model, "model", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = {
        "input embedding (get_input_embeddings(): an nn.Embedding)": isinstance(embed, torch.nn.Embedding),
        "LM head (get_output_embeddings(): an nn.Linear)": isinstance(head, torch.nn.Linear),
        "decoder layers (base_model.layers: an nn.ModuleList)": isinstance(
            getattr(base, "layers", None), torch.nn.ModuleList
        ),
        "final norm (base_model.norm)": isinstance(getattr(base, "norm", None), torch.nn.Module),
        "rotary embedding (base_model.rotary_emb)": isinstance(getattr(base, "rotary_emb", None), torch.nn.Module),
    }
    missing = [what for what, ok in found.items() if not ok]
    if missing:
        raise ImporterError(f"{who} cannot be imported: it has no {'; no '.join(missing)}. {hint}")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ImporterError(f"{who} is an encoder-decoder model; {hint}")
    _refuse_experts(who, getattr(model, "config", None))
    _refuse_rotary_per_layer_type(who, base.rotary_emb, getattr(model, "config", None))
    return {"base": base, "embed": embed, "layers": list(base.layers), "norm": base.norm, "head": head}


#: Config fields that count a mixture-of-experts model's routed experts (Mixtral and Qwen3-MoE in transformers 5,
#: Qwen-MoE and Qwen3-MoE in transformers 4, DeepSeek).
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _refuse_experts(who: str, config: Any) -> None:
    """Refuse a mixture-of-experts model before tracing (its experts' routing is data-dependent: no piece traces it)."""
    for name in _EXPERT_FIELDS:
        count = getattr(config, name, None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            raise ImporterError(
                f"{who}: mixture-of-experts (config.{name}={count}) is not supported by the importer; load it with "
                "the core path (LLM(DIR) or vllm-port generate --model DIR without importer='hf'), which runs "
                "Qwen3-MoE and Mixtral with the fused_moe op; other MoE families run with transformers itself"
            )


def _refuse_rotary_per_layer_type(who: str, rotary: torch.nn.Module, config: Any) -> None:
    """Refuse a model with a rotary embedding per layer type (Gemma-3: local and global RoPE), before calling it."""
    params = inspect.signature(rotary.forward).parameters
    if "layer_type" not in params:
        return
    types = sorted(set(getattr(config, "layer_types", None) or ()))
    raise ImporterError(
        f"{who}: its rotary embedding ({type(rotary).__name__}) takes a layer_type: one rotary table per layer type "
        f"(config.layer_types: {', '.join(types) or 'unset'}, each with its own rope parameters), and the importer "
        "maps one table for every layer; run this model with transformers itself"
    )


#: Positions at which the rotary table of a short sequence is compared with the one of the longest.
_ROPE_PROBE = 16


def _rotary_tables(
    base: torch.nn.Module, max_positions: int, dtype: torch.dtype, device: torch.device, who: str
) -> Any:
    """``(cos, sin)`` ``[positions, rotary_dim]`` from the model's own rotary module, the NeoX table or None, and
    the number of positions served.

    The paged engine rotates each key once, when it is written, so one table must serve a sequence
    at every length. The module is evaluated over all positions and over a short sequence; when the
    two disagree on the short one's positions, its frequencies depend on the sequence length (Phi-3's
    longrope switches from its short to its long factors past ``original_max_position_embeddings``).
    Such a model is served up to that length, where the short sequence's table holds, or refused.
    """
    rotary = base.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")

    def evaluate(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(n, device=device)[None]
        with torch.no_grad():
            cos, sin = rotary(torch.zeros((), dtype=torch.float32, device=device), positions)
        return cos[0].float(), sin[0].float()

    def holds(n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        cos, sin = evaluate(n)  # the longest first: a stateful module ends in its short-sequence state
        probe = min(n, _ROPE_PROBE)
        short_cos, short_sin = evaluate(probe)
        same = torch.equal(short_cos, cos[:probe]) and torch.equal(short_sin, sin[:probe])
        return (cos, sin) if same else None

    served, tables = max_positions, holds(max_positions)
    config = getattr(rotary, "config", None)
    rope_parameters = getattr(config, "rope_parameters", None)
    original = (rope_parameters if isinstance(rope_parameters, dict) else {}).get("original_max_position_embeddings")
    original = original or getattr(config, "original_max_position_embeddings", None)
    if tables is None and isinstance(original, int) and 2 <= original < max_positions:
        served, tables = original, holds(original)
    if tables is None:
        raise ImporterError(
            f"{who}: its rotary embedding ({type(rotary).__name__}, rope type {rope_type!r}) gives the first "
            f"{_ROPE_PROBE} positions other angles in a sequence of {max_positions} tokens than in a short one: its "
            "frequencies depend on the sequence length, and the paged engine rotates every key once, when it is "
            "cached, so one table must serve every length (default, linear, llama3, yarn; longrope up to its "
            "original_max_position_embeddings). Run this model with transformers itself"
        )
    cos, sin = tables
    half = cos.shape[-1] // 2
    neox = torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    table = torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous() if neox else None
    return (cos.to(dtype), sin.to(dtype)), table, served


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        names.setdefault(id(tensor), name)
    return names


def import_model(
    hf_model: torch.nn.Module,
    runtime: Any,
    dtype: torch.dtype | None = None,
    *,
    verify: bool = True,
) -> ImportedModel:
    """Import a ``transformers`` causal LM: trace its pieces, rewrite what is recognised into contract ops.

    The module is moved to ``runtime.device`` and cast to ``dtype`` in place (``module.to``), and
    the imported model shares its weights, apart from the projections it fuses (q/k/v, gate/up),
    which it holds concatenated.

    :param runtime: the platform the model will run on (its device; its bound ops for the check).
    :param dtype: the dtype to run in (default: the module's).
    :param verify: run the import check (imported model against ``transformers`` on a short prompt);
        the sliding windows are checked against the config either way.
    :raises ImporterError: for a module that is not a decoder-only causal LM of the supported
        shape, a piece that cannot be traced, an attention the paged cache cannot serve, or a
        failed import check; the message names the model, the piece and what to do.
    """
    parts = _skeleton(hf_model)
    device = torch.device(runtime.device)
    dtype = dtype or next(hf_model.parameters()).dtype
    hf_model.to(device=device, dtype=dtype).eval()
    config = hf_model.config
    who = _who(hf_model)
    max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_positions < 2:
        raise ImporterError(f"{who}: config.max_position_embeddings is {max_positions!r}; the importer needs it >= 2")
    (cos, sin), table, served = _rotary_tables(parts["base"], max_positions, dtype, device, who)
    hidden_size = parts["embed"].weight.shape[1]
    report = ImportReport(who)
    if served < max_positions:
        report.notes.append(
            f"rotary: its table changes with the sequence length past {served} positions "
            f"(rope type {getattr(parts['base'].rotary_emb, 'rope_type', 'default')!r}); served up to {served} of "
            f"the config's max_position_embeddings {max_positions}"
        )
        max_positions = served

    def hidden() -> torch.Tensor:
        return torch.empty((1, EXAMPLE_TOKENS, hidden_size), dtype=dtype, device=device)

    ids = torch.zeros(EXAMPLE_TOKENS, dtype=torch.long, device=device)
    embed = _import_piece(
        lambda x: parts["embed"](x), [("input_ids", ids, (True,))], parts["embed"], "embed", who, report
    )
    layers, facts = [], []
    # cos and sin must be distinct tensors: the tracer maps one example tensor to one graph input
    rope = [torch.empty((1, EXAMPLE_TOKENS, cos.shape[-1]), dtype=dtype, device=device) for _ in "cs"]
    with attention_seam(hf_model):
        for i, module in enumerate(parts["layers"]):
            run_layer = _layer_call(module)
            inputs = [("hidden", hidden(), (False, True, False)), ("cos", rope[0], (False, True, False))]
            inputs.append(("sin", rope[1], (False, True, False)))
            gm, layer_facts = _import_layer(run_layer, inputs, module, f"layers.{i}", who, report, table)
            layers.append(gm)
            facts.append(layer_facts)
    norm = _import_piece(
        lambda x: parts["norm"](x),
        [("hidden", hidden(), (False, True, False))],
        parts["norm"],
        "norm",
        who,
        report,
        rows=True,
    )
    lm_head = _import_head(hf_model, parts, hidden(), who, report)
    geometry = {(f["num_kv_heads"], f["head_size"]) for f in facts}
    if len(geometry) != 1:
        raise ImporterError(
            f"{who}: layers differ in KV heads or head size ({sorted(geometry)}); the paged KV cache has one layout "
            "for every layer"
        )
    windows = [f["sliding_window"] for f in facts]
    check_windows(who, config, windows)
    layer_reports = [p for p in report.pieces if p.piece.startswith("layers.")]
    rotary_native = not all(any(m.pattern == "rotary_embedding" for m in p.mapped) for p in layer_reports)
    eos = getattr(config, "eos_token_id", None)
    generation = getattr(hf_model, "generation_config", None)
    eos_ids = [*(eos if isinstance(eos, list) else [] if eos is None else [eos])]
    more = getattr(generation, "eos_token_id", None)
    eos_ids += [t for t in (more if isinstance(more, list) else [] if more is None else [more]) if t not in eos_ids]
    imported_config = ImportedConfig(
        architecture=who,
        vocab_size=int(parts["head"].weight.shape[0]),
        hidden_size=int(hidden_size),
        num_layers=len(layers),
        num_heads=facts[0]["num_heads"],
        num_kv_heads=facts[0]["num_kv_heads"],
        head_size=facts[0]["head_size"],
        max_position_embeddings=max_positions,
        sliding_window=max(windows),
        dtype=dtype,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=tuple(int(t) for t in eos_ids),
        tie_word_embeddings=parts["head"].weight is parts["embed"].weight,
    )
    model = ImportedModel(layers, embed, norm, lm_head, (cos, sin) if rotary_native else None, imported_config, report)
    if verify:
        report.verify_error = verify_import(model, hf_model, runtime)
    return model


class _HiddenStatesIn(torch.nn.Module):
    """Stands in for the base model while the causal LM's forward is traced: returns ``inputs_embeds`` as its output."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


def _import_head(hf_model, parts, example, who, report) -> torch.fx.GraphModule:
    """The LM head as the causal LM's own ``forward`` runs it after its base model.

    The top-level forward may do more than the head's linear (Gemma-2 soft-caps its logits); it
    is traced with the base model replaced by ``_HiddenStatesIn``, so whatever it does to the
    hidden states it gets is in the graph (native where no pattern maps it). A forward that cannot be
    traced so falls back to the head module alone, with a note; the import check then decides.
    """
    base = parts["base"]
    attribute = next((name for name, child in hf_model.named_children() if child is base), None)
    names = _param_names(hf_model)

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:
        out = hf_model(inputs_embeds=hidden, use_cache=False)
        return out.logits if hasattr(out, "logits") else out[0]

    inputs = [("hidden", example, (False, True, False))]
    gm, why = None, "its base model is none of its attributes"
    if attribute is not None:
        setattr(hf_model, attribute, _HiddenStatesIn())
        try:
            gm = trace_piece(logits_of, inputs, f"{who} lm_head")
        except ImporterError as exc:
            why = str(exc)
        finally:
            setattr(hf_model, attribute, base)
    traced_forward = gm is not None
    if gm is None:
        gm = trace_piece(lambda x: parts["head"](x), inputs, f"{who} lm_head")
    gm, piece_report, _ = rewrite_piece(gm, "lm_head", names, who=who)
    if not traced_forward:
        piece_report.notes.append(
            f"the causal LM's forward after its base model could not be traced ({why}); the LM head module alone "
            "is imported, and the import check compares the logits with transformers'"
        )
    report.pieces.append(piece_report)
    return gm


def _layer_call(module: torch.nn.Module) -> Any:
    """``layer(hidden, cos, sin)``: one decoder layer without mask or cache (the engine brings its own)."""

    def run_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = module(hidden, attention_mask=None, position_embeddings=(cos, sin), cache=None, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    return run_layer


def _import_piece(fn, inputs, module, piece, who, report, rows=False) -> torch.fx.GraphModule:
    """Trace and rewrite one piece; ``rows``: its one input and its output are hidden states passed as rows."""
    gm = trace_piece(fn, inputs, f"{who} {piece}")
    hidden = next(n for n in gm.graph.nodes if n.op == "placeholder") if rows else None
    gm, piece_report, _ = rewrite_piece(gm, piece, _param_names(module), who=who, rows=hidden)
    report.pieces.append(piece_report)
    return gm


def _import_layer(fn, inputs, module, piece, who, report, table) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    gm = trace_piece(fn, inputs, f"{who} {piece}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    hidden, cos, sin = placeholders[:3]
    gm, piece_report, facts = rewrite_piece(
        gm, piece, _param_names(module), rotary_table=table, cos=cos, sin=sin, who=who, rows=hidden
    )
    report.pieces.append(piece_report)
    if facts is None:
        raise ImporterError(
            f"{who} {piece} ({type(module).__name__}) computes no attention through transformers' attention "
            "interface (config._attn_implementation); a layer that attends by hand would need its own KV cache, "
            "which the paged engine replaces, so it cannot be imported"
        )
    return gm, facts
