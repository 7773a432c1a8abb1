"""MX emulation (pipelines/targets/qaic/mx.py) on values whose encodings are known. The predicted quality
built on it (quality.py) is tests/targets/qaic/test_qaic_quality.py."""

from __future__ import annotations

import torch

from pipelines.targets.qaic.mx import fake_mxfp6, fake_mxint8

E2M3_GRID = sorted({m / 8 for m in range(8)} | {(1 + m / 8) * 2**e for e in range(3) for m in range(8)})


def test_e2m3_grid_and_shared_power_of_two_scale():
    assert E2M3_GRID[-1] == 7.5 and len(E2M3_GRID) == 32  # 0, 7 subnormals, 24 normals
    block = torch.tensor([7.5] + E2M3_GRID[1:-1] + [0.0] * 2)  # amax 7.5: scale 2^(2 - 2) = 1
    assert torch.equal(fake_mxfp6(block), block)  # every grid value is exact
    assert torch.equal(fake_mxfp6(block * 2**-10), block * 2**-10)  # the scale is a power of two
    x = torch.tensor([6.0, 0.3, 0.0625, -2.6] + [0.0] * 28)  # amax 6 -> scale 1
    assert fake_mxfp6(x)[:4].tolist() == [6.0, 0.25, 0.0, -2.5]  # nearest; 0.0625 ties to even (0)
    big = torch.tensor([8.0, 1.0] + [0.0] * 30)  # amax 8: floor(log2 8) - 2 = 1 -> scale 2, 8 = 4 x 2
    assert fake_mxfp6(big)[:2].tolist() == [8.0, 1.0]


def test_blocks_are_32_wide_along_the_reduction_axis():
    x = torch.zeros(2, 40)
    x[0, 0], x[0, 1], x[0, 33] = 100.0, 1.0, 1.0  # 1.0 shares a block with 100 (lost), the other is alone
    q = fake_mxfp6(x)
    assert q[0, 1] == 0.0 and q[0, 33] == 1.0 and q.shape == (2, 40)
    assert torch.equal(fake_mxfp6(torch.zeros(3, 7)), torch.zeros(3, 7))


def test_mxint8_fixed_point_with_shared_scale():
    x = torch.tensor([1.5, 1 / 64, 1 / 256, -1.0] + [0.0] * 28)  # amax 1.5 -> scale 1; step 1/64
    assert fake_mxint8(x)[:4].tolist() == [1.5, 1 / 64, 0.0, -1.0]
    r = torch.randn(4, 64)
    err = (fake_mxint8(r) - r).abs().max() / r.abs().max()
    assert 0 < err < 2**-6
