"""Draft checkpoint tensor names -> the draft module's parameter names. Published drafts differ
in prefixes (``model.``), old aliases (``encoder.fc``) and extra tensors (rotary caches, a
confidence head blockspec does not build), so the loader maps names before loading strictly."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from blockspec.configs.draft import DraftConfig, DraftConfigError


_ALIASES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_ALWAYS_IGNORED = ("lm_head.", "rotary_emb.")


def _normalize_one(name: str, cfg: DraftConfig, keep_confidence_head: bool,
                   keep_lm_head: bool) -> str | None:
    n = name[len("model."):] if name.startswith("model.") else name
    for old, new in _ALIASES:
        if n.startswith(old):
            n = new + n[len(old):]
            break
    if n.startswith("lm_head.") and keep_lm_head:
        return n
    if n.startswith(_ALWAYS_IGNORED) or ".rotary_emb." in n:
        return None
    if n.startswith("embed_tokens.") and not cfg.is_nemotron_35:
        return None
    if n.startswith("confidence_head.") and not keep_confidence_head:
        return None
    if n.startswith("markov_head.") and cfg.algorithm != "dspark":
        return None
    return n


def normalize_draft_tensor_names(names_or_dict: Mapping[str, Any] | Iterable[str],
                                 cfg: DraftConfig, *, keep_confidence_head: bool = False,
                                 keep_lm_head: bool = False) -> dict[str, Any]:
    """Map checkpoint tensor names onto the draft module's parameter names.

    Strips a leading ``model.``, aliases ``encoder.fc.*`` → ``fc.*`` and
    ``encoder.output_norm_enc.*`` → ``hidden_norm.*``, drops ``lm_head.*`` unless asked (the
    loader asks: a draft's own head is used when it has one) and ``rotary_emb``
    caches, drops ``embed_tokens.*`` unless the draft is Nemotron 3.5, drops the DSpark
    ``confidence_head.*`` (not built) unless asked, and ``markov_head.*`` for DFlash drafts.

    Given a dict ``{name: tensor}`` it returns ``{param_name: tensor}``; given an iterable of
    names it returns ``{param_name: checkpoint_name}``.  Two checkpoint names landing on one
    parameter is an error.
    """
    is_dict = isinstance(names_or_dict, Mapping)
    items = names_or_dict.items() if is_dict else ((n, n) for n in names_or_dict)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, value in items:
        new = _normalize_one(name, cfg, keep_confidence_head, keep_lm_head)
        if new is None:
            continue
        if new in out:
            raise DraftConfigError(f"draft checkpoint: tensors {origin[new]!r} and {name!r} both "
                                   f"map to {new!r}")
        out[new] = value
        origin[new] = name
    return out
