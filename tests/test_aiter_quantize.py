"""aiter_fused.quantize (Triton MX quantization of Q/K/V) bit for bit against fa4_rowmax.reference.mx.quantize_mx, on
Triton's CPU interpreter (or the GPU when there is one): scale bytes equal and element bytes equal (e4m3
container, so the sign of zero and NaN count too)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

pytest.importorskip("triton")

from aiter_fused.quantize import quantize_head_dim, quantize_keys  # noqa: E402
from fa4_rowmax.reference.mx import quantize_mx  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

FORMATS = ["e4m3", "e2m3", "e2m1"]


def _hard_blocks(tokens, heads, head_dim, gen):
    """BF16 blocks of 32 along head_dim at magnitudes from BF16's subnormals to near its maximum, with
    whole zero blocks, signed zeros, single spikes, subnormal-only blocks, NaN and +-Inf."""
    x = torch.randn(tokens, heads, head_dim // 32, 32, generator=gen, dtype=torch.float64)
    exponent = torch.randint(-135, 126, (tokens, heads, head_dim // 32, 1), generator=gen).double()
    x = (x * 2.0**exponent).reshape(tokens, heads, head_dim).bfloat16()
    x[0, 0, :32] = 0.0
    x[1, 0, :32] = -0.0
    x[2, 0, :32] = torch.tensor(2.0**-133).bfloat16() * torch.randint(-3, 4, (32,), generator=gen)  # subnormals
    x[3, 0, :32] = torch.tensor(3.3e38).bfloat16()  # BF16's largest binade
    x[3, 0, 1] = -1.0  # rounds to -0 next to the huge ones
    x[4, 0, 7] = float("nan")
    x[5, 0, 40 % head_dim] = float("inf")
    x[6, 0, 3] = -float("inf")
    x[7, 0, 9] *= 2.0**20  # a spike: the rest of its block rounds coarsely or to zero
    return x


def _assert_bit_equal(scale, elements, ref_scale, ref_elements):
    assert scale.dtype == torch.uint8 and elements.dtype == torch.float8_e4m3fn
    assert torch.equal(scale.cpu(), ref_scale)
    expected = ref_elements.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(elements.cpu().contiguous().view(torch.uint8), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_head_dim_blocks_bit_equal_to_mx(fmt):
    gen = torch.Generator().manual_seed(21)
    x = _hard_blocks(37, 3, 64, gen)  # 37 tokens: a partial program of 16
    scale, elements = quantize_head_dim(x.to(DEVICE), fmt)
    assert scale.shape == (37, 3, 2) and elements.shape == x.shape
    _assert_bit_equal(scale, elements, *quantize_mx(x, fmt, dim=-1))


def test_head_dim_strided_input_and_head_dim_256():
    """A q sliced out of a packed (tokens, 3, heads, head_dim) qkv tensor, and a (tokens, heads, 256) one
    read with a non-unit head_dim stride."""
    gen = torch.Generator().manual_seed(22)
    qkv = torch.randn(19, 3, 2, 128, generator=gen).bfloat16()
    q = qkv[:, 1]
    _assert_bit_equal(*quantize_head_dim(q.to(DEVICE), "e4m3"), *quantize_mx(q, "e4m3", dim=-1))
    wide = torch.randn(5, 2, 256, 2, generator=gen).bfloat16()[..., 0]
    assert wide.stride(-1) == 2
    _assert_bit_equal(*quantize_head_dim(wide.to(DEVICE), "e2m1"), *quantize_mx(wide, "e2m1", dim=-1))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("keys_contiguous", [False, True])
def test_key_blocks_restart_per_sequence(fmt, keys_contiguous):
    """Sequences of 0, 1, 31, 32, 33 and 70 keys: every sequence's blocks start at its first key and equal
    quantize_mx of that sequence alone along keys; the transposed layout holds the same bytes."""
    gen = torch.Generator().manual_seed(23)
    lengths = [0, 1, 31, 32, 33, 70]
    bounds = torch.tensor([0] + lengths).cumsum(0)
    total = int(bounds[-1])
    v = _hard_blocks(total, 2, 64, gen)
    v[100, 1, 5] = float("nan")  # poisons one key block of one head and lane
    cu = bounds.to(torch.int32)
    elements, scale, cu_blocks = quantize_keys(v.to(DEVICE), fmt, cu.to(DEVICE), keys_contiguous=keys_contiguous)
    assert elements.shape == v.shape and scale.shape == (total // 32 + len(lengths), 2, 64)
    assert cu_blocks.tolist() == [0, 0, 1, 2, 3, 5, 8]
    if keys_contiguous:
        assert elements.stride(0) == 1 and elements.stride(2) % 16 == 0
    for s in range(len(lengths)):
        start, end = int(bounds[s]), int(bounds[s + 1])
        if start == end:
            continue
        ref_scale, ref_elements = quantize_mx(v[start:end], fmt, dim=0)
        _assert_bit_equal(scale[cu_blocks[s] : cu_blocks[s + 1]], elements[start:end], ref_scale, ref_elements)


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e2m1_codes(values):
    """The 4-bit codes of quantize_mx's e2m1 values: sign << 3 | index of the magnitude in the grid."""
    code = (values.double().abs().unsqueeze(-1) == E2M1_VALUES).double().argmax(-1).to(torch.uint8)
    return (torch.signbit(values).to(torch.uint8) << 3) | code


def _unpack(packed, dim):
    """Two codes a byte along ``dim``, the even element in the low nibble (Note [Packed e2m1])."""
    dim %= packed.dim()
    return torch.stack((packed & 0xF, packed >> 4), dim=dim + 1).flatten(dim, dim + 1)


def test_head_dim_e2m1_packed_bit_equal_to_mx():
    """Note [Packed e2m1]: the codes are mx.py's e2m1 values, signed zeros included; a poisoned block is
    its scale byte 255."""
    gen = torch.Generator().manual_seed(24)
    x = _hard_blocks(37, 3, 64, gen)
    scale, packed = quantize_head_dim(x.to(DEVICE), "e2m1", pack_e2m1=True)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 3, 32)
    ref_scale, ref_elements = quantize_mx(x, "e2m1", dim=-1)
    assert torch.equal(scale.cpu(), ref_scale) and bool((ref_scale == 255).any())
    finite = (ref_scale != 255).repeat_interleave(32, dim=-1)
    codes = _unpack(packed.cpu(), -1)
    assert torch.equal(codes[finite], _e2m1_codes(ref_elements)[finite])
    assert bool((codes[finite] == 8).any()) and bool((codes[finite] == 7).any())  # -0 and 6 occur


def test_key_blocks_e2m1_packed_by_block():
    """V packed along keys, laid out by block: sequence s's keys in rows 16 * cu_blocks[s] on, the padding
    keys of its last block 0 (Note [Packed e2m1])."""
    gen = torch.Generator().manual_seed(25)
    lengths = [0, 1, 31, 32, 33, 70]
    bounds = torch.tensor([0] + lengths).cumsum(0)
    v = _hard_blocks(int(bounds[-1]), 2, 64, gen)
    cu = bounds.to(torch.int32)
    elements, scale, cu_blocks = quantize_keys(v.to(DEVICE), "e2m1", cu.to(DEVICE), pack_e2m1=True)
    assert elements.dtype == torch.uint8 and elements.shape == (scale.shape[0] * 16, 2, 64)
    for s in range(len(lengths)):
        start, end = int(bounds[s]), int(bounds[s + 1])
        if start == end:
            continue
        first, last = int(cu_blocks[s]), int(cu_blocks[s + 1])
        ref_scale, ref_elements = quantize_mx(v[start:end], "e2m1", dim=0)
        assert torch.equal(scale[first:last].cpu(), ref_scale)
        codes = _unpack(elements[16 * first : 16 * last].cpu(), 0)
        finite = (ref_scale != 255).repeat_interleave(32, dim=0)[: end - start]
        assert torch.equal(codes[: end - start][finite], _e2m1_codes(ref_elements)[finite])
        assert bool((codes[end - start :] == 0).all())


def test_empty_and_bad_arguments():
    empty = torch.zeros(0, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    scale, elements = quantize_head_dim(empty, "e4m3")
    assert scale.shape == (0, 2, 2) and elements.shape == (0, 2, 64)
    x = torch.zeros(4, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="bfloat16"):
        quantize_head_dim(x.float(), "e4m3")
    with pytest.raises(ValueError, match="head_dim"):
        quantize_head_dim(x[..., :48], "e4m3")
    with pytest.raises(ValueError, match="fmt"):
        quantize_head_dim(x, "e5m2")
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        quantize_keys(x, "e4m3", cu.long())
    with pytest.raises(ValueError, match="pack_e2m1=True needs fmt='e2m1'"):
        quantize_head_dim(x, "e2m3", pack_e2m1=True)
    with pytest.raises(ValueError, match="pack_e2m1=True and keys_contiguous=True"):
        quantize_keys(x, "e2m1", cu, keys_contiguous=True, pack_e2m1=True)


_SM90_COMPILE = textwrap.dedent("""
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from aiter_fused.quantize import _format_constants, _quantize_head_dim_kernel, _quantize_keys_kernel
    built = []
    for kernel, pointers, extra in (
            (_quantize_head_dim_kernel, dict(X="*i16", Elements="*u8", Scale="*u8", prescale="fp32"),
             dict(BLOCK_T=16, PRESCALED=True)),
            (_quantize_keys_kernel, dict(V="*i16", Elements="*u8", Scale="*u8", cu_seqlens="*i32",
                                         cu_blocks="*i32", seq_of_block="*i32"), {})):
        for fmt in ("e4m3", "e2m1"):
            constants = dict(HEAD_DIM=128, **extra, **_format_constants(fmt), PACK_E2M1=fmt == "e2m1")
            signature = {name: pointers.get(name, "constexpr" if name in constants else "i32")
                         for name in kernel.arg_names}
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": 4})
            built.append(len(compiled.asm["ptx"]) > 0)
    print(json.dumps(built))
""")


def test_kernels_compile_for_sm90(tmp_path):
    """The CUDA build on the CPU (Triton ships ptxas), outside the interpreter: int16 loads, bit casts,
    the e4m3 conversion and the uint8 stores must lower for sm_90. A subprocess: this module runs
    Triton in interpreter mode."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True] * 4


@pytest.mark.parametrize("fmt,pack", [("e4m3", False), ("e2m1", True)])
def test_prescaled_head_dim_blocks_bit_equal_to_mx(fmt, pack):
    """Note [Prescaled Q] (exp_fold): ``prescale`` quantizes fl32(x * prescale), the reference's
    ``quantize_mx(x.float() * prescale)``; a prescale that is no fp32 value is refused."""
    gen = torch.Generator().manual_seed(23)
    x = _hard_blocks(37, 3, 64, gen)
    prescale = 128 * torch.tensor(64**-0.5 * 1.4426950408889634, dtype=torch.float32).item()
    ref_scale, ref_elements = quantize_mx(x.float() * prescale, fmt, dim=-1)
    scale, elements = quantize_head_dim(x.to(DEVICE), fmt, pack_e2m1=pack, prescale=prescale)
    assert torch.equal(scale.cpu(), ref_scale)
    if pack:
        finite = (ref_scale != 255).repeat_interleave(32, dim=-1)
        assert torch.equal(_unpack(elements.cpu(), -1)[finite], _e2m1_codes(ref_elements)[finite])
    else:
        _assert_bit_equal(scale, elements, ref_scale, ref_elements)
    with pytest.raises(ValueError, match="prescale must be None or a finite float"):
        quantize_head_dim(x.to(DEVICE), fmt, pack_e2m1=pack, prescale=0.1)
