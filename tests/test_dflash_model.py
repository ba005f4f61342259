"""DFlash draft backbone against a naive full-sequence reference and transformers' Qwen3."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from blockspec.layers.rotary import apply_rotary
from blockspec.checkpoint import logical_linear_weight_shape
from blockspec.models.dflash import DFlashDraftModel, select_draft_hidden_without_anchor
from blockspec.models.draft import build_draft_model
from blockspec.configs.draft import DraftConfigError, parse_draft_config
from blockspec.speculative.draft_names import normalize_draft_tensor_names

H, NH, NKV, D, I, V = 32, 4, 2, 8, 48, 64
TARGET_IDS = [0, 2, 3]
K = len(TARGET_IDS)


def make_cfg(**over):
    d = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": D, "intermediate_size": I, "vocab_size": V,
        "rms_norm_eps": 1e-6, "rope_theta": 500.0, "block_size": 4,
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": TARGET_IDS},
    }
    dfc = over.pop("dflash_config", None)
    d.update(over)
    if dfc:
        d["dflash_config"].update(dfc)
    return parse_draft_config(d)


def make_model(cfg, seed=0, **kw):
    torch.manual_seed(seed)
    m = build_draft_model(cfg, dtype=torch.float32, **kw)
    m.init_random_(std=0.3, generator=torch.Generator().manual_seed(seed))
    # non-trivial norm weights so a missing/misplaced norm shows up
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5)
        if name.endswith("attention_sink_bias"):
            p.data.copy_(torch.linspace(-1.0, 2.0, p.numel()))
    return m


# ---- an independent naive reference (explicit loops, its own RMSNorm and RoPE) -------------

def ref_rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    """x [T, heads, d]; rotates pair (i, i + d/2) by pos * theta^(-2i/d)."""
    out = x.clone()
    d = x.shape[-1]
    for t in range(x.shape[0]):
        for i in range(d // 2):
            ang = float(pos[t]) * theta ** (-2.0 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[t, :, i], x[t, :, i + d // 2]
            out[t, :, i] = a * c - b * s
            out[t, :, i + d // 2] = b * c + a * s
    return out


def ref_forward(sd, cfg, feat, ctx_pos, x, q_pos):
    """One request: feat [Lc, K*H] at ctx_pos, embedded block x [Q, H] at q_pos."""
    def W(n):
        return sd[n].double()

    feat, x = feat.double(), x.double()
    c = ref_rms(feat @ W("fc.weight").T, W("hidden_norm.weight"))
    all_pos = list(ctx_pos.tolist()) + list(q_pos.tolist())
    lc, q = feat.shape[0], x.shape[0]
    h = x
    for li in range(cfg.num_hidden_layers):
        p = f"layers.{li}."
        theta = cfg.rope_thetas[li]
        hn = ref_rms(h, W(p + "input_layernorm.weight"))
        qh = ref_rope(ref_rms((hn @ W(p + "self_attn.q_proj.weight").T).view(q, NH, D),
                              W(p + "self_attn.q_norm.weight")), q_pos, theta)

        def kv(src, pos):
            n = src.shape[0]
            k = ref_rms((src @ W(p + "self_attn.k_proj.weight").T).view(n, NKV, D),
                        W(p + "self_attn.k_norm.weight"))
            return ref_rope(k, pos, theta), (src @ W(p + "self_attn.v_proj.weight").T).view(n, NKV, D)

        kc, vc = kv(c, ctx_pos)
        kb, vb = kv(hn, q_pos)
        keys, vals = torch.cat([kc, kb]), torch.cat([vc, vb])
        causal = cfg.layer_is_causal(li)
        window = cfg.layer_window(li)
        mask = torch.zeros(q, lc + q, dtype=torch.bool)
        for a in range(q):
            for j in range(lc + q):
                ok = True
                if causal and all_pos[j] > all_pos[lc + a]:
                    ok = False
                if window is not None and all_pos[lc + a] - all_pos[j] >= window:
                    ok = False
                mask[a, j] = ok
        out = torch.zeros(q, NH, D, dtype=torch.float64)
        sink = sd.get(p + "self_attn.attention_sink_bias")
        for hh in range(NH):
            kvh = hh // (NH // NKV)
            for a in range(q):
                logits = [float(qh[a, hh] @ keys[j, kvh]) / math.sqrt(D)
                          for j in range(lc + q) if mask[a, j]]
                idx = [j for j in range(lc + q) if mask[a, j]]
                if sink is not None:
                    logits.append(float(sink[hh]))
                mx = max(logits)
                ex = [math.exp(v - mx) for v in logits]
                z = sum(ex)
                for e, j in zip(ex, idx):
                    out[a, hh] += (e / z) * vals[j, kvh]
        h = h + out.reshape(q, NH * D) @ W(p + "self_attn.o_proj.weight").T
        hn2 = ref_rms(h, W(p + "post_attention_layernorm.weight"))
        g = hn2 @ W(p + "mlp.gate_proj.weight").T
        u = hn2 @ W(p + "mlp.up_proj.weight").T
        h = h + (torch.nn.functional.silu(g) * u) @ W(p + "mlp.down_proj.weight").T
    return ref_rms(h, W("norm.weight")).float()


def run_batch(model, feats, xs, starts):
    """Project each request's context, pad to one [B, Lc] batch, run forward_block."""
    b = len(feats)
    lc = max(f.shape[0] for f in feats)
    ks = [torch.zeros(b, lc, NKV, D) for _ in model.layers]
    vs = [torch.zeros(b, lc, NKV, D) for _ in model.layers]
    valid = torch.zeros(b, lc, dtype=torch.bool)
    for r, f in enumerate(feats):
        n = f.shape[0]
        for li, (k, v) in enumerate(model.project_context(f, torch.arange(n))):
            ks[li][r, :n], vs[li][r, :n] = k, v
        valid[r, :n] = True
        # garbage in padded rows must be ignored
        for li in range(len(model.layers)):
            ks[li][r, n:] = 100.0
            vs[li][r, n:] = -100.0
    pos = torch.stack([s + torch.arange(xs.shape[1]) for s in starts])
    return model.forward_block(xs, pos, ks, vs, valid)


@pytest.mark.parametrize("variant", ["noncausal", "causal", "sliding", "sliding_noncausal",
                                     "sink", "sink_sliding"])
def test_forward_block_matches_naive_reference(variant):
    over = {}
    if variant == "causal":
        over = {"is_causal": True}
    elif variant == "sliding":
        over = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3}
    elif variant == "sliding_noncausal":
        over = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 6,
                "is_causal": False}
    elif variant == "sink":
        over = {"dflash_config": {"attention_sink_bias": True}}
    elif variant == "sink_sliding":
        over = {"dflash_config": {"attention_sink_bias": True, "swa_window_size": 2,
                                  "causal": True, "use_swa": True}}
    cfg = make_cfg(**over)
    model = make_model(cfg)
    g = torch.Generator().manual_seed(1)
    lens = [5, 2]                      # two requests with different committed lengths
    feats = [torch.randn(n, K * H, generator=g) for n in lens]
    xs = torch.randn(2, 4, H, generator=g)
    out = run_batch(model, feats, xs, lens)
    sd = model.state_dict()
    for r, n in enumerate(lens):
        ref = ref_forward(sd, cfg, feats[r], torch.arange(n), xs[r], n + torch.arange(4))
        torch.testing.assert_close(out[r], ref, rtol=1e-4, atol=1e-4)


def test_variants_really_differ():
    """Guard against a mask/sink that is silently ignored: each switch changes the output."""
    g = torch.Generator().manual_seed(2)
    feats = [torch.randn(6, K * H, generator=g)]
    xs = torch.randn(1, 4, H, generator=g)
    base = run_batch(make_model(make_cfg()), feats, xs, [6])
    for over in ({"is_causal": True},
                 {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2, "is_causal": False},
                 {"dflash_config": {"attention_sink_bias": True}}):
        other = run_batch(make_model(make_cfg(**over)), feats, xs, [6])
        assert (other - base).abs().max() > 1e-3, over


def test_sdpa_matches_eager():
    cfg = make_cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=3)
    eager = make_model(cfg)
    sdpa = make_model(cfg, attn_impl="sdpa")
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(5, K * H, generator=g), torch.randn(3, K * H, generator=g)]
    xs = torch.randn(2, 4, H, generator=g)
    torch.testing.assert_close(run_batch(sdpa, feats, xs, [5, 3]),
                               run_batch(eager, feats, xs, [5, 3]), rtol=1e-5, atol=1e-5)


def test_project_context_matches_reference_and_is_chunkable():
    cfg = make_cfg()
    model = make_model(cfg)
    sd = {k: v.double() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(4)
    feat = torch.randn(7, K * H, generator=g)
    pos = torch.arange(10, 17)
    kvs = model.project_context(feat, pos)
    assert len(kvs) == cfg.num_hidden_layers
    c = ref_rms(feat.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    for li, (k, v) in enumerate(kvs):
        p = f"layers.{li}.self_attn."
        assert k.shape == (7, NKV, D) and v.shape == (7, NKV, D)
        k_ref = ref_rope(ref_rms((c @ sd[p + "k_proj.weight"].T).view(7, NKV, D),
                                 sd[p + "k_norm.weight"]), pos, cfg.rope_thetas[li])
        torch.testing.assert_close(k, k_ref.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, (c @ sd[p + "v_proj.weight"].T).view(7, NKV, D).float(),
                                   rtol=1e-5, atol=1e-5)
    # projecting in chunks (prefill, then per-step commits) gives the same cache
    a = model.project_context(feat[:3], pos[:3])
    b = model.project_context(feat[3:], pos[3:])
    for (k, v), (ka, va), (kb, vb) in zip(kvs, a, b):
        torch.testing.assert_close(torch.cat([ka, kb]), k)
        torch.testing.assert_close(torch.cat([va, vb]), v)
    with pytest.raises(ValueError, match="K\\*H"):
        model.project_context(torch.randn(2, H), torch.arange(2))


def test_rope_matches_transformers():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, Qwen3RotaryEmbedding
    from transformers import Qwen3Config

    hf_cfg = Qwen3Config(hidden_size=H, num_attention_heads=NH, head_dim=D, rope_theta=500.0)
    rot = Qwen3RotaryEmbedding(hf_cfg)
    x = torch.randn(2, 5, NH, D)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = rot(x, pos)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(apply_rotary(x, pos, theta=500.0), q_hf.transpose(1, 2))


@pytest.mark.parametrize("sliding", [False, True])
def test_causal_block_without_context_matches_transformers_qwen3(sliding):
    """External oracle: a causal draft with no context is a plain Qwen3 decoder stack."""
    from transformers import Qwen3Config, Qwen3Model

    over = {"is_causal": True}
    hf_kw = {}
    if sliding:
        # is_causal makes the full layer causal too (it is bidirectional by default)
        over = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2,
                "is_causal": True}
        hf_kw = {"use_sliding_window": True, "sliding_window": 2,
                 "layer_types": ["sliding_attention", "full_attention"]}
    cfg = make_cfg(**over)
    model = make_model(cfg)
    hf = Qwen3Model(Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=NH, num_key_value_heads=NKV, head_dim=D, rope_theta=500.0,
        rms_norm_eps=1e-6, attn_implementation="eager", **hf_kw)).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert set(missing) == {"embed_tokens.weight"}
    assert set(unexpected) == {"fc.weight", "hidden_norm.weight"}
    x = torch.randn(1, 5, H, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(3, 8)[None]
    with torch.no_grad():
        ref = hf(inputs_embeds=x, position_ids=pos).last_hidden_state
    out = model.forward_block(x, pos, None, None, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_block_layout_and_select_hidden():
    cfg = make_cfg()
    model = make_model(cfg)
    ids, pos = model.block_inputs(torch.tensor([5, 9]), torch.tensor([3, 10]))
    assert ids.tolist() == [[5, V - 1, V - 1, V - 1], [9, V - 1, V - 1, V - 1]]
    assert pos.tolist() == [[3, 4, 5, 6], [10, 11, 12, 13]]
    h = torch.randn(2, 4, H)
    assert torch.equal(model.select_draft_hidden(h), h[:, 1:])
    assert torch.equal(select_draft_hidden_without_anchor(h, 3), h[:, 1:])
    with pytest.raises(ValueError, match="4 query rows, expected 5"):
        select_draft_hidden_without_anchor(h, 4)
    with pytest.raises(ValueError, match="expected 3"):
        select_draft_hidden_without_anchor(h, 2)
    with pytest.raises(ValueError, match="\\[B, Q, H\\]"):
        select_draft_hidden_without_anchor(h[0], 3)


def nemotron_dict():
    return {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "head_dim": D, "intermediate_size": I, "vocab_size": V,
        "has_embed_tokens": True, "has_lm_head": False,
        "quantization_config": {"quant_algo": "W4A16_NVFP4"},
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in TARGET_IDS],
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": TARGET_IDS,
                          "sample_from_anchor": False},
    }


def test_embed_block_resolution():
    g = torch.Generator().manual_seed(6)
    target_table = torch.randn(V, H, generator=g)
    target_embed = nn.Embedding.from_pretrained(target_table)
    ids = torch.tensor([[3, V - 1, V - 1, V - 1]])
    generic = make_model(make_cfg())
    assert generic.embed_tokens is None
    assert "embed_tokens.weight" not in generic.state_dict()
    torch.testing.assert_close(generic.embed_block(ids, target_embed), target_table[ids])
    torch.testing.assert_close(generic.embed_block(ids, target_table, scale=2.0), 2 * target_table[ids])
    with pytest.raises(DraftConfigError, match="target"):
        generic.embed_block(ids)
    scaled = make_model(make_cfg(dflash_config={"input_embedding_scale": 0.5}))
    torch.testing.assert_close(scaled.embed_block(ids, target_embed), 0.5 * target_table[ids])
    nem = make_model(parse_draft_config(nemotron_dict()))
    assert nem.is_nemotron_35 and nem.embed_tokens is not None
    out = nem.embed_block(ids, target_embed)           # target passed but must NOT be used
    torch.testing.assert_close(out, nem.embed_tokens.weight[ids])
    assert not torch.allclose(out, target_table[ids])


class FakePackedLinear(nn.Module):
    """Stands in for a packed W4A16_NVFP4 linear: uint8 storage [out, in/2]."""

    def __init__(self, in_f, out_f):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_f, in_f // 2, dtype=torch.uint8),
                                   requires_grad=False)


def test_fc_shape_checks():
    generic = make_model(make_cfg())
    assert generic.fc_in_features_from_weight(torch.zeros(H, K * H)) == K * H
    with pytest.raises(DraftConfigError, match="K mismatch"):
        generic.fc_in_features_from_weight(torch.zeros(H, 2 * H))
    # generic drafts compare raw shapes: a packed-looking tensor is a mismatch
    with pytest.raises(DraftConfigError, match="K mismatch"):
        generic.fc_in_features_from_weight(torch.zeros(H, K * H // 2, dtype=torch.uint8))
    nem = make_model(parse_draft_config(nemotron_dict()))
    nem.fc = FakePackedLinear(K * H, H)
    packed = torch.zeros(H, K * H // 2, dtype=torch.uint8)
    assert logical_linear_weight_shape(nem.fc, packed, H) == (H, K * H)
    assert nem.fc_in_features_from_weight(packed) == K * H
    with pytest.raises(DraftConfigError, match="K mismatch"):
        nem.fc_in_features_from_weight(torch.zeros(H, H // 2, dtype=torch.uint8))
    # an unpacked module keeps the raw shape
    assert logical_linear_weight_shape(generic.fc, torch.zeros(H, 7), H) == (H, 7)


def test_checkpoint_names_load_name_for_name():
    cfg = make_cfg(dflash_config={"attention_sink_bias": True})
    src = make_model(cfg, seed=1)
    ckpt = {("model." + k): v.clone() for k, v in src.state_dict().items()}
    ckpt["encoder.fc.weight"] = ckpt.pop("model.fc.weight")
    ckpt["lm_head.weight"] = torch.zeros(V, H)
    ckpt["embed_tokens.weight"] = torch.zeros(V, H)
    ckpt["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(D // 2)
    dst = DFlashDraftModel(cfg)
    dst.load_state_dict(normalize_draft_tensor_names(ckpt, cfg), strict=True)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert dst.layers[0].self_attn.attention_sink_bias.dtype == torch.float32


def test_fused_projections_match_separate_ones():
    """Serving fuses q/k/v and gate/up into one GEMM each over shared weight storage: the same
    K/V, the same MLP output, and the per-projection modules still see the same bytes."""
    import copy

    cfg = make_cfg()
    plain = make_model(cfg)
    fused = copy.deepcopy(plain)
    fused.fuse()
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[NH * D:].data_ptr()
    g = torch.Generator().manual_seed(5)
    feat = torch.randn(6, K * H, generator=g)
    pos = torch.arange(3, 9)
    for (k, v), (kf, vf) in zip(plain.project_context(feat, pos), fused.project_context(feat, pos)):
        torch.testing.assert_close(kf, k, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(vf, v, rtol=1e-6, atol=1e-6)
    x = torch.randn(4, H, generator=g)
    torch.testing.assert_close(mlp(x), plain.layers[0].mlp(x), rtol=1e-6, atol=1e-6)
