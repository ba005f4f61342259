"""Build a Nemotron-H target from a model folder (dense or ModelOpt-quantized), and the
once-after-loading preparation of quantized layers that targets and drafts share."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from blockspec.checkpoint import TensorSource, load_state, read_config
from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.layers.moe import MoE
from blockspec.models.nemotron_h import NemotronHForCausalLM
from blockspec.models.tp_layout import local_name, shard_for
from blockspec.parallel import SINGLE, TPGroup
from blockspec.quant import config as quant_config
from blockspec.quant.linear import prepare_fp8, prepare_w4a16

log = logging.getLogger("blockspec")


def load_quant_plan(path: Path, raw: dict, names: list[str]):
    """The checkpoint's quantization plan, or None for a dense checkpoint."""
    has_quant = (path / "hf_quant_config.json").is_file() or "quantization_config" in raw
    if not has_quant:
        return None
    plan = quant_config.load_quant_plan(path, raw, names)
    for notice in getattr(plan, "notices", []) if plan is not None else []:
        log.warning("%s", notice)
    return plan


def _head_notice(tie_word_embeddings: bool, tied: bool) -> str:
    """One line saying which output head scores tokens. The rule (sglang's and vLLM's for real
    tied folders): a folder's own ``lm_head.weight`` is used; tie only when there is none."""
    if tied:
        return "output head tied to backbone.embeddings.weight (no lm_head.weight in the folder)"
    if tie_word_embeddings:
        return ("output head is the folder's own lm_head.weight (config.json says "
                "tie_word_embeddings=true, but transformers-saved folders carry an untied head)")
    return "output head is the folder's lm_head.weight"


def load_target(path: str | Path, dtype: torch.dtype, device: torch.device,
                tp: TPGroup = SINGLE) -> tuple[NemotronHForCausalLM, NemotronHConfig]:
    """The target and its whole config; under tensor parallelism (``tp``) this rank's shard,
    read slice by slice (``models/tp_layout.py``); its caches size by ``model.rank_cfg``."""
    folder = Path(path)
    raw = read_config(folder)
    cfg = NemotronHConfig.from_dict(raw)
    with TensorSource(folder) as src:
        names = src.names()
        quant = load_quant_plan(folder, raw, names)
        tie = cfg.tie_word_embeddings and "lm_head.weight" not in names
        log.info("target %s: %s", folder.name, _head_notice(cfg.tie_word_embeddings, tie))
        with torch.device(device):
            model = NemotronHForCausalLM(cfg, quant=quant, dtype=dtype, tie_head=tie, tp=tp)
        if any(n.startswith("mtp.") for n in names) or cfg.num_nextn_predict_layers:
            log.warning("checkpoint carries MTP layers (mtp.*); they are not used by blockspec")

        kv_scales = getattr(quant, "kv_scale_names", frozenset())

        def rename(name: str) -> str | None:
            if name.startswith("mtp.") or name in kv_scales:   # FP8-KV scales: cache stays bf16
                return None
            return local_name(name, cfg, tp)        # None: another rank's experts (EP)

        load_state(model, src, rename=rename, what=f"target checkpoint {folder.name}",
                   shard=lambda name: shard_for(name, cfg, tp))
    prepare_quantized(model)
    model.eval()
    return model, cfg


def prepare_quantized(model: nn.Module) -> None:
    """Everything a loaded model's quantized layers decide or rearrange once, on their final
    device and before any CUDA graph is captured: the MoE's stacked experts, the FP8
    activation-scale modes and the W4A16 kernel layout. It lives beside the loader because it
    reaches into both layers/ (the MoE) and quant/ (the quantized linears)."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.prepare_grouped()
    prepare_fp8(model)
    prepare_w4a16(model)
