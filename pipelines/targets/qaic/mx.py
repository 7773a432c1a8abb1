"""OCP Microscaling (MX v1.0) emulation: MXFP6 E2M3 weights and MXINT8 KV cache, quantize-dequantize in
torch, to predict what an AI 100 compile with `-mxfp6-matmul` and an mxint8 `custom_io.yaml` costs in
quality before spending compile time.

Both formats share one E8M0 (power-of-two) scale per block of 32 consecutive elements along the
reduction axis. The scale is 2^(floor(log2(amax)) - emax), emax being the element format's largest
exponent, so the block's largest value lands in the element's top binade (OCP MX v1.0, section 6.3).
- E2M3: sign, 2 exponent bits (bias 1), 3 mantissa bits; magnitudes 0, 0.125 ... 0.875 (subnormal),
  1 ... 7.5; emax 2. Values beyond 7.5 x scale saturate.
- MXINT8: 8-bit two's complement with an implicit 2^-6 (fixed point 1.6): -2 ... 127/64; emax 0.
Rounding is to nearest, ties to even (torch.round).
"""

from __future__ import annotations

BLOCK = 32
E2M3_MAX, E2M3_EMAX, E2M3_MANTISSA = 7.5, 2, 3
INT8_EMAX = 0


def _blocks(x, block: int = BLOCK):
    """x [..., K] -> ([..., K/32, 32] zero-padded, K)."""
    import torch

    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), k


def _shared_scale(blocks, emax: int):
    import torch

    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exp = torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))) - emax
    return torch.where(amax > 0, torch.exp2(exp.clamp(-127, 127)), torch.ones_like(amax))


def fake_mxfp6(x):
    """Quantize-dequantize to MXFP6 E2M3 along the last axis (blocks of 32)."""
    import torch

    b, k = _blocks(x.float())
    scale = _shared_scale(b, E2M3_EMAX)
    y = b / scale
    # the binade of each element: exponent 0 below 1 (subnormals share exponent 0's step, 1/8)
    e = torch.floor(torch.log2(y.abs().clamp(min=1.0))).clamp(0, E2M3_EMAX)
    step = torch.exp2(e - E2M3_MANTISSA)
    q = (torch.round(y / step) * step).clamp(-E2M3_MAX, E2M3_MAX)
    return (q * scale).reshape(*x.shape[:-1], -1)[..., :k].to(x.dtype)


def fake_mxint8(x):
    """Quantize-dequantize to MXINT8 along the last axis (blocks of 32)."""
    import torch

    b, k = _blocks(x.float())
    scale = _shared_scale(b, INT8_EMAX)
    q = (torch.round(b / scale * 64) / 64).clamp(-2.0, 127 / 64)
    return (q * scale).reshape(*x.shape[:-1], -1)[..., :k].to(x.dtype)
