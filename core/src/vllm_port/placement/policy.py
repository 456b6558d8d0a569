"""A placement policy: rules that say which platform runs which node of a flat graph, first match wins.

A policy is written as a Python mapping or a small TOML or JSON file::

    default = "cuda"                 # optional: the platform of every node no rule matches

    [[rules]]                        # the MLPs of layers 16..31 on the host
    platform = "cpu"
    part = "mlp"
    layers = "16-31"

    [[rules]]
    label = "head on the host"       # optional: errors name the rule by it
    platform = "cpu"
    part = "lm_head"

A rule holds ``platform`` (a loaded platform's name) and any of these selectors, all of which must
match (a rule without selectors matches every node):

- ``op``: a contract op (``"linear"``) or a torch op (``"aten.add.Tensor"``), or a list of them;
- ``part``: the node's role in a decoder: ``embedding``, ``attention``, ``mlp``, ``norm``,
  ``lm_head`` or ``other`` (see :mod:`vllm_port.placement.parts`), or a list of them;
- ``layers``: decoder layers, inclusive: ``"0-15"``, ``[0, 15]`` or one layer ``7``;
- ``node``: a glob over node names as ``vllm-port inspect`` prints them (``"linear_*"``);
- ``weight``: a glob over the names of the weights a node reads (``"layers.*.gate_up_weight"``).

A platform may carry a device index, ``"cuda:1"``: that is how a pipeline split over the GPUs of
one process is written (layer ranges to device indices); ``"cuda"`` is ``"cuda:0"``.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import VllmPortError
from ..ops import ALL_OPS

__all__ = ["PARTS", "PlacementError", "PlacementPolicy", "PlacementRule", "load_policy"]

#: The roles a node can play in a decoder (``part`` selectors).
PARTS = ("embedding", "attention", "mlp", "norm", "lm_head", "other")
_CONTRACT_OPS = frozenset(op.name for op in ALL_OPS)
_SELECTORS = ("op", "part", "layers", "node", "weight")
_RULE_KEYS = ("platform", "label", *_SELECTORS)
_POLICY_KEYS = ("default", "rules")


class PlacementError(VllmPortError, ValueError):
    """A placement policy or a placement cannot be used; the message names the rule or node, the value and the fix."""


@dataclass(frozen=True)
class PlacementRule:
    """One rule of a policy: ``platform`` for the nodes every given selector matches (see the module docstring).

    Attributes:
        platform: the platform's name, optionally with a device index (``"cuda:1"``).
        index: the rule's position in its policy (0-based), for messages.
        label: an optional name for messages.
        ops, parts: the op names and parts it matches (empty: any).
        layers: the inclusive layer range it matches, or ``None`` for any node.
        nodes, weights: glob patterns over node names and weight names (empty: any).
        source: where the rule was written (a file), for messages.
    """

    platform: str
    index: int = 0
    label: str = ""
    ops: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None
    nodes: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    source: str = ""

    @property
    def who(self) -> str:
        """``placement rule 2 ('head on the host') of placement.toml``: how messages name the rule."""
        text = f"placement rule {self.index}"
        if self.label:
            text += f" ({self.label!r})"
        return text + (f" of {self.source}" if self.source else "")

    @property
    def platform_name(self) -> str:
        """The platform without its device index."""
        return self.platform.partition(":")[0]

    @property
    def target(self) -> str:
        """Where the rule places nodes: the platform, with its device index unless it is 0 (``"cuda:1"``)."""
        name, _, index = self.platform.partition(":")
        return name if not index or int(index) == 0 else f"{name}:{int(index)}"

    def matches(self, op: str, part: str | None, layer: int | None, node: str, weights: Iterable[str]) -> bool:
        """Whether the node described by the arguments is one this rule places."""
        if self.ops and op not in self.ops:
            return False
        if self.parts and part not in self.parts:
            return False
        if self.layers is not None and (layer is None or not self.layers[0] <= layer <= self.layers[1]):
            return False
        if self.nodes and not any(fnmatch.fnmatchcase(node, p) for p in self.nodes):
            return False
        if self.weights:
            read = list(weights)
            if not any(fnmatch.fnmatchcase(w, p) for w in read for p in self.weights):
                return False
        return True

    def to_json(self) -> dict[str, Any]:
        """The rule as it would be written in a JSON policy."""
        out: dict[str, Any] = {"platform": self.platform}
        if self.label:
            out["label"] = self.label
        for key, value in (("op", self.ops), ("part", self.parts), ("node", self.nodes), ("weight", self.weights)):
            if value:
                out[key] = list(value)
        if self.layers is not None:
            out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class PlacementPolicy:
    """Rules, first match wins, and the default platform of every node no rule matches.

    :param default: the default platform's name; ``None``: the first loaded platform.
    """

    rules: tuple[PlacementRule, ...] = ()
    default: str | None = None
    source: str = ""

    @classmethod
    def parse(
        cls, spec: PlacementPolicy | Mapping[str, Any] | Sequence[Any] | None, source: str = ""
    ) -> PlacementPolicy:
        """A policy from a mapping (``{"default": ..., "rules": [...]}``), a list of rules, or ``None`` (no rule).

        :raises PlacementError: for unknown keys, selectors or parts, bad layer ranges, or a rule with no platform.
        """
        if spec is None:
            return cls(source=source)
        if isinstance(spec, PlacementPolicy):
            return spec
        where = f" in {source}" if source else ""
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - set(_POLICY_KEYS))
            if unknown:
                raise PlacementError(
                    f"placement policy{where}: unknown key(s) {unknown}; a policy holds {', '.join(_POLICY_KEYS)} "
                    "(write each rule under [[rules]])"
                )
            default, rules = spec.get("default"), spec.get("rules", [])
        elif isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)):
            default, rules = None, spec
        else:
            raise PlacementError(
                f"placement policy{where}: {spec!r:.80} is not a policy; give a mapping "
                "{'default': ..., 'rules': [...]}, a list of rules, or a .toml/.json file"
            )
        if default is not None and (not isinstance(default, str) or not default):
            raise PlacementError(f"placement policy{where}: default is {default!r}; give a platform name, e.g. 'cuda'")
        if not isinstance(rules, Sequence) or isinstance(rules, (str, bytes)):
            raise PlacementError(f"placement policy{where}: rules is {rules!r:.80}; give a list of rule tables")
        return cls(tuple(_rule(r, i, source) for i, r in enumerate(rules)), default, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PlacementPolicy:
        """Read a policy from a ``.toml`` or ``.json`` file (any other suffix is read as TOML).

        :raises PlacementError: when the file is missing or malformed, naming the file and what is wrong.
        """
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlacementError(f"placement policy {path}: cannot be read ({exc}); give an existing file") from exc
        if path.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PlacementError(
                    f"placement policy {path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
                    "fix the file (an object with 'default' and 'rules')"
                ) from exc
        else:
            toml = _tomllib(path)
            try:
                data = toml.loads(text)
            except toml.TOMLDecodeError as exc:
                raise PlacementError(
                    f"placement policy {path}: not valid TOML: {exc}; fix the file (rules as [[rules]] tables)"
                ) from exc
        return cls.parse(data, source=str(path))

    def platforms(self) -> list[str]:
        """Every platform name the policy names (the default first, device indices dropped), in order, once."""
        names = [self.default.partition(":")[0]] if self.default else []
        for rule in self.rules:
            if rule.platform_name not in names:
                names.append(rule.platform_name)
        return names

    def to_json(self) -> dict[str, Any]:
        """The policy as a JSON object (what :meth:`parse` reads back)."""
        return {"default": self.default, "rules": [r.to_json() for r in self.rules]}


def load_policy(
    spec: PlacementPolicy | Mapping[str, Any] | Sequence[Any] | str | os.PathLike[str] | None,
) -> PlacementPolicy:
    """A policy from a policy, a mapping, a list of rules, a file path (``.toml``/``.json``), or ``None``."""
    if isinstance(spec, (str, os.PathLike)):
        return PlacementPolicy.from_file(spec)
    return PlacementPolicy.parse(spec)


def _tomllib(path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError as exc:
            raise PlacementError(
                f"placement policy {path}: reading TOML needs Python 3.11 or the tomli package; "
                "pip install tomli, or write the policy as .json"
            ) from exc
    return tomllib


def _rule(spec: Any, index: int, source: str) -> PlacementRule:
    who = f"placement rule {index}" + (f" of {source}" if source else "")
    if not isinstance(spec, Mapping):
        raise PlacementError(f"{who}: {spec!r:.80} is not a table; write platform = '...' and selectors")
    label = spec.get("label", "")
    if not isinstance(label, str):
        raise PlacementError(f"{who}: label is {label!r}; give a string")
    if label:
        who += f" ({label!r})"
    unknown = sorted(set(spec) - set(_RULE_KEYS))
    if unknown:
        raise PlacementError(f"{who}: unknown key(s) {unknown}; a rule holds {', '.join(_RULE_KEYS)}")
    platform = spec.get("platform")
    if not isinstance(platform, str) or not platform:
        raise PlacementError(f"{who}: platform is {platform!r}; every rule names a platform, e.g. platform = 'cpu'")
    name, sep, index_text = platform.partition(":")
    if sep and not (index_text.isdigit() and name):
        raise PlacementError(f"{who}: platform {platform!r} is not NAME or NAME:INDEX (e.g. 'cuda:1')")
    ops = _strings(spec.get("op"), "op", who)
    for op in ops:
        if op not in _CONTRACT_OPS and not _is_torch_op(op):
            raise PlacementError(
                f"{who}: op {op!r} is neither a contract op ({', '.join(sorted(_CONTRACT_OPS))}) nor a torch op "
                "as inspect prints it (e.g. 'aten.add.Tensor'); fix the name"
            )
    parts = _strings(spec.get("part"), "part", who)
    for part in parts:
        if part not in PARTS:
            raise PlacementError(f"{who}: part {part!r} is not one of {', '.join(PARTS)}")
    return PlacementRule(
        platform=platform,
        index=index,
        label=label,
        ops=ops,
        parts=parts,
        layers=_layers(spec.get("layers"), who),
        nodes=_strings(spec.get("node"), "node", who),
        weights=_strings(spec.get("weight"), "weight", who),
        source=source,
    )


def _strings(value: Any, key: str, who: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or not value or not all(isinstance(v, str) and v for v in value):
        raise PlacementError(f"{who}: {key} is {value!r}; give a non-empty string or a list of them")
    return tuple(value)


def _layers(value: Any, who: str) -> tuple[int, int] | None:
    if value is None:
        return None
    bad = (
        f"{who}: layers {value!r} is not a layer range; write 'FIRST-LAST' (inclusive, e.g. '0-15'), "
        "[FIRST, LAST] or one layer number, with 0 <= FIRST <= LAST"
    )
    if isinstance(value, bool):
        raise PlacementError(bad)
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str):
        text = value.strip()
        head, sep, tail = text.partition("-")
        try:
            first = int(head)
            last = int(tail) if sep else first
        except ValueError:
            raise PlacementError(bad) from None
    elif (
        isinstance(value, Sequence)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        first, last = value
    else:
        raise PlacementError(bad)
    if first < 0 or last < first:
        raise PlacementError(bad)
    return first, last


def _is_torch_op(name: str) -> bool:
    """``aten.add.Tensor`` / ``aten.view.default`` / ``operator.getitem``: a name inspect prints for a torch op."""
    namespace, _, rest = name.partition(".")
    if not rest:
        return False
    if namespace == "operator":
        import operator

        return hasattr(operator, rest)
    if namespace in ("aten", "prims"):
        import torch

        packet, _, overload = rest.partition(".")
        try:
            found = getattr(getattr(torch.ops, namespace), packet)
        except (AttributeError, RuntimeError):
            return False
        return not overload or overload in found.overloads()
    return False
