"""A model placed on several platforms, and what the engine needs to run it.

:class:`PlacedModel` traces a flat model's decode and prefill steps, runs core's fusion passes
(platform-neutral substitutions; a plugin's passes make kernels for its own platform, so they are
left out when nodes may move), and places both graphs with one policy, one :class:`WeightStore`
(every weight moves once) and one :class:`TransferStats`. The LM head, which a runner calls after
the graph on the rows that sample, is a node of its own (``lm_head``: op ``linear``, part
``lm_head``), placed by the same rules. Placed models run eagerly: a captured device graph could
hold neither host work nor the transfers.

:class:`EnginePlacement` is what ``LLM(model, placement=..., devices=[...])`` hands the runner: it
loads the checkpoint into host memory, places it (weights move to their platforms from there, so a
model larger than a device runs with the rest of it elsewhere), allocates each layer's KV cache on
the platform of its attention (:class:`PlacedKVCache`, one block pool for all), and gives the step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import MemoryContractError
from ..flat.passes import apply_passes
from ..flat.trace import PHASES, graph_inputs, trace, weight_paths
from ..kv_pool import blocks_for_budget
from ..memory import KVCache, KVLayout
from ..runtime import Runtime
from ._assign import choose_target
from .plan import PlacedGraph, place
from .platforms import Platforms, device_context, load_many
from .policy import PlacementError, PlacementPolicy, load_policy
from .transfers import Transfer, TransferStats
from .weights import WeightStore

__all__ = ["EnginePlacement", "PlacedKVCache", "PlacedModel"]

#: The LM head's node name.
LM_HEAD = "lm_head"
#: How an error names a platform that a placement policy's rule names (``platform = "..."`` in its file).
POLICY_PLATFORM = "the placement policy's platform"


class _HeadNode:
    """What the rules read of the LM head node (the fields of a :class:`~vllm_port.flat.FlatNode`)."""

    def __init__(self, weight: str) -> None:
        self.name, self.op, self.kind, self.layer = LM_HEAD, "linear", "contract", None
        self.inputs = ("%hidden", f"${weight}")


class PlacedModel:
    """``model`` with every node on a platform of ``platforms`` by ``policy``; see the module docstring.

    :param model: a flat model (``vllm_port.models.LlamaModel``), anywhere (host memory is the usual place).
    :param policy: a policy, a mapping or list of rules, a ``.toml``/``.json`` file, or ``None``.
    :param platforms: the loaded platforms (:func:`~vllm_port.placement.load_many`), or one runtime.
    :param passes: run core's fusion passes before placing.
    :param budgets: platform -> the most bytes of weights it may hold; moving more is refused
        before it happens.
    :param cache_dtype: the KV cache's dtype when it is not the model's (a float8 cache: the ``*_fp8`` cache ops).
    :raises PlacementError: see :func:`~vllm_port.placement.place`, and for a weight budget exceeded.
    """

    def __init__(
        self,
        model: Any,
        policy: PlacementPolicy | Mapping[str, Any] | Sequence[Any] | str | os.PathLike[str] | None,
        platforms: Platforms | Runtime,
        dtype: torch.dtype | None = None,
        *,
        block_size: int = 16,
        passes: bool = True,
        budgets: Mapping[str, int] | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.policy = load_policy(policy)
        self.platforms = Platforms.of(platforms)
        self.dtype = dtype or getattr(model, "dtype", torch.float32)
        self.block_size = block_size
        self.weights = WeightStore(budgets)
        self.stats = TransferStats()
        kernels = self.platforms.default.bind(self.dtype)
        self.graphs: dict[str, PlacedGraph] = {}
        caches: dict[str, str] | None = None
        for phase in PHASES:
            graph = trace(model, kernels, phase=phase, block_size=block_size, cache_dtype=cache_dtype)
            graph = apply_passes(graph) if passes else graph  # core's passes only: see the module docstring
            placed = place(
                graph, self.policy, self.platforms, weights=self.weights, stats=self.stats, cache_platforms=caches
            )
            caches = placed.cache_platforms
            self.graphs[phase] = placed
        self.default = self.graphs[PHASES[0]].default
        num_layers = int(model.config.num_layers)
        #: each decoder layer's platform for its KV cache (the platform of its attention nodes)
        self.layer_platforms = [caches[f"k_cache_{i}"] for i in range(num_layers)] if caches else []
        head_weight = weight_paths(model).get(id(model.lm_head), LM_HEAD)
        self.head_platform, self.head_rule = choose_target(
            self.policy.rules, _HeadNode(head_weight), LM_HEAD, self.default
        )
        self._head_weight = self.weights.get(
            model.lm_head, self.head_platform, self.platforms.device(self.head_platform), head_weight
        )
        self._head_kernels = self.platforms.runtime(self.head_platform).bind(self.dtype)
        self._runtime_device = self.platforms.default.device
        self._devices = {name: self.platforms.device(name) for name in self.platforms}
        for graph in self.graphs.values():  # and each other device of a platform a rule names (cuda:1)
            self._devices.update(graph.devices)
        self._devices[self.head_platform] = self.platforms.device(self.head_platform)
        self._head_device = self._devices[self.head_platform]
        self.head_weight_name = head_weight

    # --- running ---

    def _move(self, x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
        if src == dst:
            return x
        self.stats.record(src, dst, x.nelement() * x.element_size())
        return x.to(self._devices[dst], copy=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any], meta: Any
    ) -> torch.Tensor:
        """Hidden states after the final norm, on :meth:`output_platform` (``meta.is_decode`` picks the graph)."""
        phase = PHASES[0] if meta.is_decode else PHASES[1]
        with torch.no_grad():
            return self.graphs[phase](*graph_inputs(input_ids, positions, kv_caches, meta))

    def output_platform(self, phase: str = "decode") -> str:
        """Where a phase's graph leaves the hidden states."""
        return self.graphs[phase].output_platform

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor, phase: str = "decode") -> torch.Tensor:
        """The LM head over ``hidden[rows]``, on the platform of the engine's batch (the first loaded)."""
        here = self.output_platform(phase)
        rows = self._move(rows, self.platforms.default.platform.name, here)
        picked = self._move(hidden.index_select(0, rows), here, self.head_platform)
        with device_context(self._head_device):
            logits = self._head_kernels.linear(picked, self._head_weight)
        return self._move(logits, self.head_platform, self.platforms.default.platform.name)

    def compute_logits(self, hidden: torch.Tensor, phase: str = "decode") -> torch.Tensor:
        """Logits of every row of ``hidden`` (as ``FlatModel.compute_logits``), on the engine's platform."""
        here = self.output_platform(phase)
        with device_context(self._head_device):
            logits = self._head_kernels.linear(self._move(hidden, here, self.head_platform), self._head_weight)
        return self._move(logits, self.head_platform, self.platforms.default.platform.name)

    def step(self) -> Callable[..., torch.Tensor]:
        """The engine's step function (:data:`~vllm_port.engine.runner.StepFunction`) of this model."""

        def step(input_ids, positions, kv_caches, meta, logits_rows):
            hidden = self.forward(input_ids, positions, kv_caches, meta)
            return self.logits(hidden, logits_rows, PHASES[0] if meta.is_decode else PHASES[1])

        return step

    # --- facts ---

    def head_transfers(self, phase: str = "decode") -> list[Transfer]:
        """The transfers around the LM head each step, as :class:`Transfer` records (sizes per sampled row)."""
        here, engine = self.output_platform(phase), self.platforms.default.platform.name
        config, item = self.model.config, torch.empty((), dtype=self.dtype).element_size()
        found = []
        if here != engine:
            found.append(
                Transfer(
                    "rows", "transfer", "logits_rows", "runner", (), engine, here, "[num_rows] i64", "8·num_rows", None
                )
            )
        if here != self.head_platform:
            size = config.hidden_size * item
            found.append(
                Transfer(
                    "lm_head.input",
                    "transfer",
                    "%hidden[rows]",
                    self.graphs[phase].flat.nodes[-1].name,
                    (LM_HEAD,),
                    here,
                    self.head_platform,
                    f"[num_rows, {config.hidden_size}]",
                    f"{size}·num_rows",
                    size,
                )
            )
        if self.head_platform != engine:
            size = config.vocab_size * item
            found.append(
                Transfer(
                    "lm_head.output",
                    "transfer",
                    "%logits",
                    LM_HEAD,
                    ("sample",),
                    self.head_platform,
                    engine,
                    f"[num_rows, {config.vocab_size}]",
                    f"{size}·num_rows",
                    size,
                )
            )
        return found

    def transfers_per_step(self, phase: str = "decode") -> dict[tuple[str, str], int]:
        """Transfers one step of ``phase`` runs, by direction: the graph's cut edges and the LM head's."""
        found = dict(self.graphs[phase].cut_edges())
        for t in self.head_transfers(phase):
            found[(t.src, t.dst)] = found.get((t.src, t.dst), 0) + 1
        return found


class PlacedKVCache:
    """Each layer's KV cache on its platform, every platform holding the same blocks; one block pool.

    Duck-types :class:`~vllm_port.memory.KVCache` for the runner: ``pool``, ``num_blocks``,
    ``key_caches``, ``value_caches``, ``close()``; ``blocks`` (what swapping moves) only when every
    layer is on one platform, else ``None``.

    :param budget: as ``KVCache``'s: a fraction of the default platform's free memory, or bytes;
        it sizes the blocks over all layers, and each platform holds its layers' share.
    """

    def __init__(
        self, platforms: Platforms, layer_platforms: Sequence[str], layout: KVLayout, budget: float | int
    ) -> None:
        default = platforms.default
        if isinstance(budget, float) and not isinstance(budget, bool) and 0.0 < budget <= 1.0:
            budget = int(default.allocator().mem_info()[0] * budget)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise MemoryContractError(
                f"KV-cache budget must be a fraction in (0, 1] or a positive int of bytes, got {budget!r}"
            )
        self.num_blocks = blocks_for_budget(budget, layout.block_bytes)
        if self.num_blocks == 0:
            raise MemoryContractError(
                f"a KV-cache budget of {budget:,} bytes holds no block of {layout.block_bytes:,} bytes; raise the budget"
            )
        self.layout = layout
        by_platform: dict[str, list[int]] = {}
        for layer, platform in enumerate(layer_platforms):
            by_platform.setdefault(platform, []).append(layer)
        self.caches: dict[str, KVCache] = {}
        self.key_caches: list[torch.Tensor] = [torch.empty(0)] * layout.num_layers
        self.value_caches: list[torch.Tensor] = [torch.empty(0)] * layout.num_layers
        try:
            for platform, layers in by_platform.items():
                runtime, device = platforms.runtime(platform), platforms.device(platform)
                allocator = platforms.allocator(platform)
                part = KVLayout(len(layers), layout.num_kv_heads, layout.head_size, layout.block_size, layout.dtype)
                cache = KVCache(allocator, part, self.num_blocks * part.block_bytes, runtime.block_pool_factory())
                self.caches[platform] = cache
                if cache.buffer.device != device and device.type != "cpu":
                    raise MemoryContractError(
                        f"{platform!r}: the allocator {allocator.name!r} of platform {runtime.platform.name!r} put "
                        f"the KV cache of layers {layers} on {cache.buffer.device}, not {device}; a pipeline over "
                        "devices needs an allocator that allocates on its .device (plugin_kit.DeviceAllocator does)"
                    )
                if cache.num_blocks != self.num_blocks:
                    raise MemoryContractError(
                        f"platform {platform!r}'s block pool made {cache.num_blocks} blocks of a budget of "
                        f"{self.num_blocks} blocks; placed KV caches need pools that make as many blocks as fit"
                    )
                for j, layer in enumerate(layers):
                    self.key_caches[layer], self.value_caches[layer] = cache.key_caches[j], cache.value_caches[j]
        except BaseException:
            self.close()
            raise
        owner = default.platform.name if default.platform.name in self.caches else next(iter(self.caches))
        self.pool = self.caches[owner].pool
        self.allocator = self.caches[owner].allocator
        self.budget_bytes = self.num_blocks * layout.block_bytes
        #: every layer's blocks, for swapping: only where one platform holds every layer
        self.blocks = self.caches[owner].blocks if len(self.caches) == 1 else None

    @property
    def platforms_by_layer(self) -> list[str]:
        """Each layer's platform."""
        where = {}
        for platform, cache in self.caches.items():
            for tensor in cache.key_caches:
                where[id(tensor)] = platform
        return [where[id(t)] for t in self.key_caches]

    def close(self) -> None:
        """Give every platform's buffer back."""
        for cache in self.caches.values():
            cache.close()
        self.key_caches, self.value_caches = [], []
        self.blocks = None  # the one platform's view of its whole buffer (above), which would keep it


class EnginePlacement:
    """A policy and its platforms, as the engine's runner uses them (see the module docstring).

    ``LLM(model, placement=POLICY, devices=[...])`` makes one; a runner calls :meth:`prepare`,
    :meth:`kv_cache` and :meth:`make_step` in that order.

    :param budgets: platform -> the most bytes of weights it may hold.
    """

    def __init__(
        self,
        policy: PlacementPolicy | Mapping[str, Any] | Sequence[Any] | str | os.PathLike[str] | None,
        platforms: Platforms,
        *,
        budgets: Mapping[str, int] | None = None,
    ) -> None:
        self.policy = load_policy(policy)
        self.platforms = platforms
        self.budgets = dict(budgets or {})
        self.model: PlacedModel | None = None

    @classmethod
    def create(
        cls,
        placement: Any,
        devices: Sequence[str] | None = None,
        device: str | Runtime = "auto",
        plugins: str | None = None,
        budgets: Mapping[str, int] | None = None,
    ) -> EnginePlacement:
        """Load the platforms: ``devices`` when given (the first is the engine's), else ``device`` and every
        platform the policy names."""
        policy = load_policy(placement)
        # who named each platform, as an error about it says: the devices given, else the policy (and device)
        sources = dict.fromkeys(devices or policy.platforms(), "devices" if devices else POLICY_PLATFORM)
        if isinstance(device, Runtime):
            others = [p for p in (devices or policy.platforms()) if p != device.platform.name]
            loaded = [device, *(load_many(others, plugins, sources=sources).values() if others else [])]
            return cls(policy, Platforms(loaded), budgets=budgets)
        names = list(devices) if devices else [device or "auto", *policy.platforms()]
        unique = [n for i, n in enumerate(names) if n not in names[:i]]
        if not devices:
            sources.pop(device or "auto", None)  # named by device too: the error says --device, as ever
        return cls(policy, load_many(unique, plugins, sources=sources), budgets=budgets)

    def prepare(
        self,
        model: Any,
        dtype: torch.dtype,
        block_size: int,
        max_positions: int | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> Any:
        """The model (loaded from a directory into host memory when it is one, its rotary table for
        ``max_positions`` positions), placed; ``cache_dtype``: the KV cache's, when not the model's (float8)."""
        from ..models import load_model

        if isinstance(model, (str, os.PathLike)):
            # host memory: each weight then moves once to the platform of its nodes
            model = load_model(model, torch.device("cpu"), dtype, max_positions=max_positions)
        self.model = PlacedModel(
            model,
            self.policy,
            self.platforms,
            model.dtype,
            block_size=block_size,
            budgets=self.budgets,
            cache_dtype=cache_dtype,
        )
        return model

    def kv_cache(self, layout: KVLayout, budget: float | int, swap_space: int = 0) -> PlacedKVCache:
        """Each layer's KV cache on the platform of its attention."""
        placed = self._placed()
        split = sorted(set(placed.layer_platforms))
        if swap_space and (len(split) > 1 or split != [self.platforms.default.platform.name]):
            raise PlacementError(
                f"swap_space={swap_space:,}: swapping moves every layer's KV blocks between the engine's platform "
                f"{self.platforms.default.platform.name!r} and host memory, and this placement keeps KV caches on "
                f"{', '.join(split)}; set swap_space=0 (preemption then recomputes)"
            )
        return PlacedKVCache(self.platforms, placed.layer_platforms, layout, budget)

    def make_step(self, runner: Any) -> Callable[..., torch.Tensor]:
        """The runner's step function: the placed model's."""
        return self._placed().step()

    def _placed(self) -> PlacedModel:
        if self.model is None:
            raise PlacementError("EnginePlacement: call prepare(model, dtype, block_size) first (the runner does)")
        return self.model
