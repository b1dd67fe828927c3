import pytest
import torch

from gptoss_serve.kernels.mxfp4 import E2M1_VALUES, dequantize_mxfp4

# E2M1 (OCP MX v1.0): sign bit 3, then {0, .5, 1, 1.5, 2, 3, 4, 6}.
CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_code_table() -> None:
    assert list(E2M1_VALUES[:8]) == CODE_VALUES
    assert list(E2M1_VALUES[8:]) == [-v for v in CODE_VALUES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exponent", [-20, -7, -1, 0, 1, 5, 30])
def test_all_16_codes_exact(exponent: int, dtype: torch.dtype) -> None:
    # Byte k holds code k in its low nibble (even element) and 15-k in its high nibble.
    codes_low = torch.arange(16, dtype=torch.uint8)
    blocks = (codes_low | ((15 - codes_low) << 4)).view(1, 16)  # one 32-element block
    scales = torch.tensor([127 + exponent], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, dtype)
    assert out.shape == (32,) and out.dtype == dtype
    signed = CODE_VALUES + [-v for v in CODE_VALUES]
    expected_even = [signed[k] * 2.0**exponent for k in range(16)]
    expected_odd = [signed[15 - k] * 2.0**exponent for k in range(16)]
    assert out[0::2].double().tolist() == expected_even
    assert out[1::2].double().tolist() == expected_odd
    # Negative zero keeps its sign bit (code 8).
    assert torch.signbit(out[16]) and out[16] == 0


def test_layout_groups_and_leading_dims() -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 135, (3, 5, 4), dtype=torch.uint8, generator=generator)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (3, 5, 128)
    # Element j of row r: group j // 32, byte (j % 32) // 2, nibble j % 2.
    for e, r, j in [(0, 0, 0), (1, 2, 33), (2, 4, 127), (2, 3, 64)]:
        byte = int(blocks[e, r, j // 32, (j % 32) // 2])
        code = (byte & 0xF) if j % 2 == 0 else (byte >> 4)
        value = E2M1_VALUES[code] * 2.0 ** (int(scales[e, r, j // 32]) - 127)
        assert out[e, r, j].item() == value


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(TypeError):
        dequantize_mxfp4(torch.zeros(1, 16), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
