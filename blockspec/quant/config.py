"""ModelOpt quantization configs -> one format per module (``QuantPlan``).

Sources, both optional: ``hf_quant_config.json`` (legacy, ``{"quantization": {...}}``) and
``config.json["quantization_config"]`` with ``quant_method: "modelopt"``.  Supported
``quant_algo``: NVFP4 (W4A4, run as W4A16), W4A16_NVFP4, FP8 (static per-tensor), and
MIXED_PRECISION (``quantized_layers`` per module; a parent such as ``...mixer.experts`` covers
every expert below it; anything absent is unquantized).

The tensors decide, the config is checked: a module whose tensors carry ``weight_scale_2`` is
NVFP4-family (``nvfp4`` with ``input_scale``, else ``w4a16_nvfp4``); one with only
``weight_scale`` is FP8.  The config's expectation for the module must agree, and a real
disagreement raises ``QuantConfigError`` naming the module.  This is what makes ModelOpt
0.47.0's corrupted names (``"lm_head.\\x00backbone.pt_name_sentinel"``) harmless: the junk is
stripped, reported in one notice, and the tensors would catch anything it hid.
"""
from __future__ import annotations

import fnmatch
import json
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

NVFP4 = "nvfp4"
W4A16_NVFP4 = "w4a16_nvfp4"
FP8 = "fp8"
FORMATS = (NVFP4, W4A16_NVFP4, FP8)

GROUP_SIZE = 16
_ALGO_TO_FORMAT = {"NVFP4": NVFP4, "W4A16_NVFP4": W4A16_NVFP4, "FP8": FP8}
SUPPORTED_ALGOS = ("FP8", "MIXED_PRECISION", "NVFP4", "W4A16_NVFP4")
_NVFP4_FAMILY = (NVFP4, W4A16_NVFP4)
_ROUTER_NAMES = ("gate", "router", "shared_expert_gate")

# ModelOpt 0.47.0 appends its internal name sentinel (".\x00modelopt_name_sentinel") to module
# names and then fails to strip it because an unanchored rename rule rewrote it.  Whatever the
# rename made of it, it starts with ".\x00" and is made of identifier characters.
_SENTINEL_RE = re.compile(r"\.\x00[A-Za-z0-9_.]*")


class QuantConfigError(ValueError):
    """A quantization config or checkpoint that cannot be loaded as stated."""


def strip_name_sentinel(name: str) -> str:
    """``"lm_head.\\x00backbone.pt_name_sentinel"`` -> ``"lm_head"``; a trailing ``*`` stays."""
    return _SENTINEL_RE.sub("", name)


def _format_of_algo(algo: Any, where: str) -> str:
    if not isinstance(algo, str) or algo.upper() not in _ALGO_TO_FORMAT:
        raise QuantConfigError(
            f"unsupported quant_algo {algo!r} in {where}; supported: "
            + ", ".join(SUPPORTED_ALGOS))
    return _ALGO_TO_FORMAT[algo.upper()]


def _check_group_size(group_size: Any, where: str) -> None:
    if group_size is not None and group_size != GROUP_SIZE:
        raise QuantConfigError(
            f"group_size {group_size} in {where} is not supported: ModelOpt NVFP4 uses blocks "
            f"of {GROUP_SIZE} (one float8_e4m3fn scale per {GROUP_SIZE} weights)")


def _matches(name: str, pattern: str) -> bool:
    """Module ``name`` is ``pattern``, lies below it, or matches it as an fnmatch wildcard."""
    if name == pattern or name.startswith(pattern + "."):
        return True
    return any(ch in pattern for ch in "*?[") and fnmatch.fnmatchcase(name, pattern)


@dataclass
class QuantPlan:
    """Per-module formats of one checkpoint, in checkpoint names (``backbone.layers.…``).

    ``format_for(prefix)`` is what model builders ask; ``modules`` holds what the tensors
    showed.  ``notices`` are one-line messages for the user (W4A4 run as W4A16, FP8 KV cache kept
    in bf16, exclude-list corruption tolerated).
    """

    quant_algo: str
    group_size: int | None
    modules: dict[str, str]
    exclude: tuple[str, ...] = ()
    quantized_layers: dict[str, str] = field(default_factory=dict)
    kv_cache_algo: str | None = None
    kv_scale_names: frozenset[str] = frozenset()
    producer: dict[str, Any] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    _tensor_names: frozenset[str] = frozenset()

    @property
    def kv_cache_fp8(self) -> bool:
        """The checkpoint declares an FP8 KV cache (blockspec keeps a bf16 cache; see notices)."""
        return self.kv_cache_algo == "FP8"

    def expected_format(self, prefix: str) -> str | None:
        """What the config alone says about ``prefix``."""
        if self.quant_algo == "MIXED_PRECISION":
            best: tuple[int, str] | None = None
            for key, fmt in self.quantized_layers.items():
                if _matches(prefix, key):
                    rank = len(key) if not any(c in key for c in "*?[") else -1
                    if best is None or rank > best[0]:
                        best = (rank, fmt)
            return best[1] if best else None
        if any(_matches(prefix, pat) for pat in self.exclude):
            return None
        return _ALGO_TO_FORMAT[self.quant_algo]

    def format_for(self, prefix: str) -> str | None:
        """Format of the Linear at ``prefix``, or ``None`` for dense.

        Raises ``QuantConfigError`` when the config says quantized but the checkpoint holds the
        module's ``weight`` without any scale (listing the missing tensor names).  MoE routers
        are the exception: older ModelOpt versions left them out of exclude lists although
        they are never quantized, so a dense router loads dense with a notice.
        """
        if prefix in self.modules:
            return self.modules[prefix]
        expected = self.expected_format(prefix)
        if expected is None:
            return None
        weight = prefix + ".weight"
        if weight in self._tensor_names:
            if prefix.rsplit(".", 1)[-1] in _ROUTER_NAMES:
                note = (f"{prefix}: router not in the exclude list but stored dense; loading "
                        f"it unquantized")
                if note not in self.notices:
                    self.notices.append(note)
                return None
            missing = [prefix + s for s in _required_scales(expected)]
            raise QuantConfigError(
                f"{prefix}: config ({self.quant_algo}) says {expected} but the checkpoint has "
                f"{weight} without its scales; missing: {', '.join(missing)}")
        return expected

    def quantized_prefixes(self, fmt: str | None = None) -> list[str]:
        """Module prefixes quantized in the checkpoint (optionally only those of ``fmt``)."""
        return sorted(p for p, f in self.modules.items() if fmt is None or f == fmt)


def _required_scales(fmt: str) -> tuple[str, ...]:
    if fmt in _NVFP4_FAMILY:
        return (".weight_scale", ".weight_scale_2")
    return (".weight_scale",)


def _read_json(path: pathlib.Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _section_from_hf_quant(hf: dict) -> dict:
    q = hf.get("quantization")
    if not isinstance(q, dict):
        raise QuantConfigError("hf_quant_config.json has no 'quantization' object")
    return {
        "quant_algo": q.get("quant_algo"),
        "group_size": q.get("group_size"),
        "exclude": list(q.get("exclude_modules") or []),
        "quantized_layers": dict(q.get("quantized_layers") or {}),
        "kv_cache_algo": q.get("kv_cache_quant_algo"),
        "producer": dict(hf.get("producer") or {}),
        "source": "hf_quant_config.json",
    }


def _section_from_config(qc: dict) -> dict:
    method = qc.get("quant_method")
    if method != "modelopt":
        raise QuantConfigError(
            f"config.json quantization_config has quant_method {method!r}; only ModelOpt "
            f"checkpoints (quant_method 'modelopt') are supported")
    group_size = None
    for group in (qc.get("config_groups") or {}).values():
        gs = (group.get("weights") or {}).get("group_size")
        if gs is not None and group_size is None:
            group_size = gs
        if gs is not None and (group.get("weights") or {}).get("num_bits") == 4:
            _check_group_size(gs, "config.json quantization_config.config_groups")
    kv = qc.get("kv_cache_scheme")
    if isinstance(kv, dict):
        kv_algo = "FP8" if kv.get("num_bits") == 8 and kv.get("type") == "float" else str(kv)
    else:
        kv_algo = kv
    return {
        "quant_algo": qc.get("quant_algo"),
        "group_size": qc.get("group_size", group_size),
        "exclude": list(qc.get("ignore") or qc.get("exclude_modules") or []),
        "quantized_layers": dict(qc.get("quantized_layers") or {}),
        "kv_cache_algo": kv_algo,
        "producer": dict(qc.get("producer") or {}),
        "source": "config.json quantization_config",
    }


def load_quant_plan(model_dir: pathlib.Path, config: Mapping[str, Any],
                    tensor_names: Iterable[str]) -> QuantPlan | None:
    """Read the quantization config of ``model_dir`` and check it against ``tensor_names``.

    Returns ``None`` for an unquantized checkpoint.  ``config`` is the parsed ``config.json``.
    """
    names = frozenset(tensor_names)
    model_dir = pathlib.Path(model_dir)
    sections = []
    qc = config.get("quantization_config")
    if isinstance(qc, dict):
        sections.append(_section_from_config(qc))
    hf = _read_json(model_dir / "hf_quant_config.json")
    if hf is not None:
        sections.append(_section_from_hf_quant(hf))
    if not sections:
        scaled = sorted(n for n in names if n.endswith((".weight_scale", ".weight_scale_2")))
        if scaled:
            raise QuantConfigError(
                f"checkpoint has quantization scales (e.g. {scaled[0]}) but neither "
                f"hf_quant_config.json nor config.json quantization_config")
        return None
    sec = sections[0]
    algos = {str(s["quant_algo"]).upper() for s in sections}
    if len(algos) > 1:
        raise QuantConfigError(
            "config.json quantization_config and hf_quant_config.json disagree on quant_algo: "
            + " vs ".join(f"{s['quant_algo']!r} ({s['source']})" for s in sections))
    for s in sections[1:]:
        for key in ("group_size", "kv_cache_algo"):
            if sec[key] is None and s[key] is not None:
                sec[key] = s[key]
        if not sec["exclude"] and s["exclude"]:
            sec["exclude"] = s["exclude"]
        if not sec["quantized_layers"] and s["quantized_layers"]:
            sec["quantized_layers"] = s["quantized_layers"]

    algo = sec["quant_algo"]
    where = sec["source"]
    if not isinstance(algo, str) or algo.upper() not in SUPPORTED_ALGOS:
        raise QuantConfigError(
            f"unsupported quant_algo {algo!r} in {where}; supported: " + ", ".join(SUPPORTED_ALGOS))
    algo = algo.upper()
    notices: list[str] = []

    corrupted = 0
    exclude: list[str] = []
    for raw in sec["exclude"]:
        clean = strip_name_sentinel(raw)
        corrupted += clean != raw
        exclude.append(clean)
    layers: dict[str, str] = {}
    for raw, entry in sec["quantized_layers"].items():
        clean = strip_name_sentinel(raw)
        corrupted += clean != raw
        if not isinstance(entry, dict):
            raise QuantConfigError(f"quantized_layers[{clean!r}] is not an object: {entry!r}")
        fmt = _format_of_algo(entry.get("quant_algo"), f"quantized_layers[{clean!r}]")
        if fmt in _NVFP4_FAMILY:
            _check_group_size(entry.get("group_size"), f"quantized_layers[{clean!r}]")
        layers[clean] = fmt
    if corrupted:
        notices.append(
            f"quant config: stripped ModelOpt 0.47 name-sentinel junk ('.\\x00…name_sentinel') "
            f"from {corrupted} module names; formats are checked against the tensors")

    if algo == "MIXED_PRECISION":
        if not layers:
            raise QuantConfigError(f"quant_algo MIXED_PRECISION in {where} has no quantized_layers")
        group_size = sec["group_size"]
        if group_size is not None:
            _check_group_size(group_size, where)
    else:
        group_size = sec["group_size"]
        if _ALGO_TO_FORMAT[algo] in _NVFP4_FAMILY:
            if group_size is None:
                group_size = GROUP_SIZE
            _check_group_size(group_size, where)

    kv_algo = sec["kv_cache_algo"]
    kv_names = frozenset(n for n in names if n.endswith((".k_scale", ".v_scale")))
    if kv_algo:
        notices.append(
            f"checkpoint declares a {kv_algo} KV cache; blockspec keeps the KV cache in bf16 "
            f"({len(kv_names)} k_scale/v_scale tensors loaded as unused)")

    plan = QuantPlan(quant_algo=algo, group_size=group_size, modules={}, exclude=tuple(exclude),
                     quantized_layers=layers, kv_cache_algo=kv_algo, kv_scale_names=kv_names,
                     producer=sec["producer"], notices=notices, _tensor_names=names)
    plan.modules = _formats_from_tensors(plan, names)
    w4a4 = plan.quantized_prefixes(NVFP4)
    if w4a4:
        notices.append(
            f"NVFP4 W4A4 checkpoint: {len(w4a4)} modules have input_scale; running them as "
            f"W4A16 (bf16 activations, input_scale loaded and unused)")
    return plan


def _formats_from_tensors(plan: QuantPlan, names: frozenset[str]) -> dict[str, str]:
    """Format per quantized module as the tensors show it, checked against the config."""
    suffixes = (".weight_scale_2", ".weight_scale", ".input_scale")
    prefixes = sorted({n[: -len(s)] for n in names for s in suffixes if n.endswith(s)})
    errors: list[str] = []
    formats: dict[str, str] = {}
    for prefix in prefixes:
        has = {s: (prefix + s) in names for s in (".weight", ".weight_scale", ".weight_scale_2",
                                                   ".input_scale")}
        expected = plan.expected_format(prefix)
        if has[".weight_scale_2"]:
            found = NVFP4 if has[".input_scale"] else W4A16_NVFP4
        elif has[".weight_scale"]:
            found = FP8
        else:
            found = None  # input_scale alone
        if found == FP8 and expected in _NVFP4_FAMILY:
            errors.append(f"{prefix}: config says {expected} but {prefix}.weight_scale_2 is "
                          f"missing")
            continue
        if found is None:
            need = _required_scales(expected or W4A16_NVFP4)
            missing = [prefix + s for s in need if not has[s]]
            errors.append(f"{prefix}: has input_scale but no weight scales; missing: "
                          + ", ".join(missing))
            continue
        missing = [prefix + s for s in (".weight", ".weight_scale") if not has[s]]
        if missing:
            errors.append(f"{prefix}: {found} tensors incomplete; missing: " + ", ".join(missing))
            continue
        if expected is None:
            errors.append(f"{prefix}: tensors are {found} but the config ({plan.quant_algo}) "
                          f"leaves this module unquantized")
            continue
        if (expected in _NVFP4_FAMILY) != (found in _NVFP4_FAMILY):
            errors.append(f"{prefix}: config says {expected} but tensors are {found}")
            continue
        formats[prefix] = found
    if errors:
        head = errors[:8]
        more = f" (+{len(errors) - 8} more)" if len(errors) > 8 else ""
        raise QuantConfigError("quantized checkpoint does not match its config:\n  "
                               + "\n  ".join(head) + more)
    return formats
