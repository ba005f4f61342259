"""NVFP4/FP8 primitives: E2M1 rounding, nibble order, exact dequant, quantizer properties."""
import pytest
import torch

from blockspec.quant.fp8 import dequantize_fp8, quantize_fp8
from blockspec.quant.nvfp4 import (E2M1_VALUES, dequantize_nvfp4, dequantize_nvfp4_rows,
                                   e2m1_codes, e2m1_table, pack_nibbles, quantize_nvfp4,
                                   unpack_nibbles)


def _decode(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_table()[codes.long()]


@pytest.mark.parametrize("x, expected", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (0.2499, 0.0), (0.2501, 0.5), (0.7499, 0.5), (1.2501, 1.5), (2.4999, 2.0), (2.5001, 3.0),
    (3.4999, 3.0), (4.9999, 4.0), (5.0001, 6.0), (6.0, 6.0), (100.0, 6.0),
    (-0.75, -1.0), (-2.5, -2.0), (-5.0, -4.0), (-7.0, -6.0),
])
def test_e2m1_rounding_ties_to_even(x, expected):
    code = e2m1_codes(torch.tensor([x], dtype=torch.float32))
    assert _decode(code).item() == expected


def test_negative_values_rounding_to_zero_keep_the_sign_bit():
    # ModelOpt writes code 8 ("-0") for small negatives; byte equality depends on it.
    codes = e2m1_codes(torch.tensor([-0.1, -0.25, 0.1, -0.0]))
    assert codes.tolist() == [8, 8, 0, 0]
    assert _decode(codes).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert not torch.signbit(_decode(codes)).any(), "code 8 decodes to +0.0 as in ModelOpt"


def test_every_representable_value_maps_to_its_code():
    vals = torch.tensor(E2M1_VALUES)
    codes = e2m1_codes(vals)
    assert torch.equal(_decode(codes), vals.abs() * torch.where(vals < 0, -1.0, 1.0))
    assert codes.tolist()[:8] == list(range(8)) and codes.tolist()[9:] == list(range(9, 16))


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_pack_unpack_round_trip_random():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 3, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    with pytest.raises(ValueError, match="odd"):
        pack_nibbles(codes[..., :3])


def test_dequant_rule_hand_example():
    # one row of 16: byte0 = codes (2 -> 1.0, 13 -> -3.0), rest zero; block scale 2, global 0.25
    packed = torch.zeros(1, 8, dtype=torch.uint8)
    packed[0, 0] = 0xD2
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = dequantize_nvfp4(packed, scale, torch.tensor(0.25))
    assert out.shape == (1, 16)
    assert out[0, :2].tolist() == [0.5, -1.5]
    assert out[0, 2:].abs().sum() == 0


def test_dequant_multiplies_scales_first_then_values():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (5, 16), generator=g, dtype=torch.uint8)
    scale = (torch.rand(5, 2, generator=g) * 300 + 0.01).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(3.3e-5)
    vals = e2m1_table()[unpack_nibbles(packed).long()]
    block = (scale.float() * ws2).repeat_interleave(16, dim=1)
    assert torch.equal(dequantize_nvfp4(packed, scale, ws2), vals * block)
    assert torch.equal(dequantize_nvfp4(packed, scale, ws2, dtype=torch.bfloat16),
                       (vals * block).bfloat16())
    rows = torch.tensor([3, 0, 3])
    assert torch.equal(dequantize_nvfp4_rows(packed, scale, ws2, rows),
                       (vals * block)[rows])


def test_quantizer_scales_and_idempotence():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(24, 64, generator=g) * 0.05).bfloat16()
    w[3, 16:32] = 0  # all-zero block -> scale 1.0
    packed, scale, ws2 = quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 32)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (24, 4)
    assert ws2.shape == () and ws2.item() == pytest.approx(w.float().abs().max().item() / 2688)
    assert scale[3, 1].float().item() == 1.0
    deq = dequantize_nvfp4(packed, scale, ws2)
    # Error per element is at most half a step of the coarsest E2M1 spacing (2) times the scale.
    step = (scale.float() * ws2).repeat_interleave(16, dim=1)
    assert ((deq - w.float()).abs() <= step + 1e-12).all()
    # Re-quantizing the dequantized weight with the same global scale is a fixed point (up to
    # code 8 "-0" becoming code 0, which decodes to the same +0.0).
    p2, s2, _ = quantize_nvfp4(deq, ws2)
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(p2, s2, ws2), deq)
    codes, codes2 = unpack_nibbles(packed), unpack_nibbles(p2)
    assert torch.equal(torch.where(codes == 8, 0, codes), codes2)


def test_quantizer_clamps_tiny_block_scale():
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0          # sets the global amax
    w[0, 16] = 1e-9        # a block whose scale would underflow E4M3
    _, scale, _ = quantize_nvfp4(w)
    assert scale[0, 1].float().item() == 2.0 ** -9


def test_quantizer_rejects_k_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of the NVFP4 group size 16"):
        quantize_nvfp4(torch.randn(4, 24))


def test_fp8_round_trip_and_scale():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(8, 32, generator=g) * 0.1).bfloat16()
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    assert s.item() == pytest.approx(w.float().abs().max().item() / 448)
    assert q.float().abs().max().item() == 448.0
    deq = dequantize_fp8(q, s)
    assert torch.equal(deq, q.float() * s)
    assert ((deq - w.float()).abs() / w.float().abs().clamp_min(1e-3)).max() < 0.07
