"""The W4A16 kernel's packed-weight layout: a bit permutation inside each 16-bit word that the
kernel's decode undoes exactly, converted once per module and invisible to everything else."""
import pytest
import torch

from blockspec.kernels import w4a16_layout as lay
from blockspec.quant.nvfp4 import quantize_nvfp4


def _words(packed: torch.Tensor) -> torch.Tensor:
    b = packed.to(torch.int32)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def test_round_trip_and_the_permutation_is_a_bijection():
    g = torch.Generator().manual_seed(0)
    p = torch.randint(0, 256, (3, 5, 12), generator=g, dtype=torch.uint8)
    k = lay.to_kernel_layout(p)
    assert k.shape == p.shape and k.dtype == torch.uint8 and not torch.equal(k, p)
    assert torch.equal(lay.from_kernel_layout(k), p)
    assert sorted(b for bits in lay.STREAM_BITS for b in bits) == list(range(16))


def test_the_kernels_bit_ops_give_each_streams_bf16_bits_for_every_word():
    """The four formulas of the kernel's decode (its PTX and its Triton fallback), on all 65536
    words: stream r of the kernel word must give ``s << 15 | (e1 e0 m) << 6`` of nibble r of
    the checkpoint word."""
    words = torch.arange(1 << 16, dtype=torch.int32)
    ckpt = torch.stack((words & 0xFF, words >> 8), -1).reshape(-1).to(torch.uint8)
    q = _words(lay.to_kernel_layout(ckpt))
    sw = ((q >> 8) | (q << 8)) & 0xFFFF
    got = [(q << 2) & 0x81C0, (q << 6) & 0x81C0, (sw << 4) & 0x81C0,
           (q & 0x8180) | (sw & 0x0040)]
    for r in range(4):
        nib = (words >> (4 * r)) & 0xF
        assert torch.equal(got[r], ((nib & 8) << 12) | ((nib & 7) << 6)), f"stream {r}"


def test_slices_of_a_converted_tensor_are_converted_slices():
    """Rows and 16-column groups (the shared expert's down slices) commute with the layout."""
    p, _, _ = quantize_nvfp4(torch.randn(8, 64).bfloat16())
    k = lay.to_kernel_layout(p)
    assert torch.equal(k[2:5], lay.to_kernel_layout(p[2:5]))
    assert torch.equal(k[:, 8:24], lay.to_kernel_layout(p[:, 8:24]))


def test_in_place_conversion_in_chunks():
    p = torch.randint(0, 256, (2, 37, 8), dtype=torch.uint8)
    want = lay.to_kernel_layout(p)
    assert lay.to_kernel_layout_(p, rows=5) is p and torch.equal(p, want)


def test_bad_input_names_the_function():
    with pytest.raises(TypeError, match="to_kernel_layout: .*uint8"):
        lay.to_kernel_layout(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="from_kernel_layout: .*even"):
        lay.from_kernel_layout(torch.zeros(2, 3, dtype=torch.uint8))


def test_module_keeps_checkpoint_semantics_after_conversion():
    """An NVFP4Linear whose weight the kernel converted still dequantizes, saves and reloads
    the checkpoint's bytes; the MoE stack marks its experts the same way."""
    from blockspec.quant.linear import NVFP4Linear, stack_nvfp4_experts

    mods = []
    for seed in range(3):
        p, s, s2 = quantize_nvfp4(torch.randn(16, 32, generator=torch.Generator()
                                              .manual_seed(seed)).bfloat16())
        m = NVFP4Linear(32, 16, prefix=f"e{seed}")
        m.weight.copy_(p), m.weight_scale.copy_(s), m.weight_scale_2.copy_(s2)
        mods.append(m)
    before = [m.dense_weight() for m in mods]
    saved = [m.state_dict()["weight"].clone() for m in mods]
    assert mods[0].kernel_weight() is mods[0].weight and mods[0].kernel_layout
    w, _, _ = stack_nvfp4_experts(mods)
    for m, dense, ckpt in zip(mods, before, saved):
        assert m.kernel_layout and torch.equal(m.dense_weight(), dense)
        assert torch.equal(m.state_dict()["weight"], ckpt)
    assert torch.equal(w, lay.to_kernel_layout(torch.stack(saved)))
    fresh = NVFP4Linear(32, 16)
    fresh.load_state_dict(mods[1].state_dict())
    assert torch.equal(fresh.dense_weight(), before[1])
    mods[2].load_state_dict(mods[1].state_dict())     # into a converted (stacked) buffer
    assert torch.equal(mods[2].dense_weight(), before[1]) and torch.equal(w[2], w[1])
