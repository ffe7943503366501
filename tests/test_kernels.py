"""The CPU kernels (models/csrc) against torch's own ops, and the packed linear's promise:
a row's output does not depend on the batch it was computed in."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import kernels
from models.layers import RotaryEmbedding


@pytest.fixture(scope="module")
def ops():
    ops = kernels.cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels could not be built here")
    return ops


@pytest.mark.parametrize("n,k", [(768, 256), (100, 70), (17, 5), (4096, 32)])
def test_packed_linear_equals_torch(ops, n, k):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = ops.pack_linear_weight(w)
    for m in (1, 3, 4, 5, 33):
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(ops.packed_linear(x, packed, n), F.linear(x, w), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ops.packed_linear(x, packed, n, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_packed_linear_is_batch_invariant(ops):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 256, generator=g)
    packed, x = ops.pack_linear_weight(w), torch.randn(37, 256, generator=g)
    full = ops.packed_linear(x, packed, 300)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(30, 37)):
        assert torch.equal(ops.packed_linear(x[rows].contiguous(), packed, 300), full[rows])


def test_linear_packs_once_and_repacks_new_weights(ops):
    layer = torch.nn.Linear(64, 48, bias=False).requires_grad_(False)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear(layer, x, layer.weight), layer(x), rtol=1e-5, atol=1e-5)
        first = layer.__dict__["_packed"][1]
        kernels.linear(layer, x, layer.weight)
        assert layer.__dict__["_packed"][1] is first
        layer.weight = torch.nn.Parameter(torch.randn(48, 64), requires_grad=False)  # a new tensor: packed again
        torch.testing.assert_close(kernels.linear(layer, x, layer.weight), layer(x), rtol=1e-5, atol=1e-5)


def test_linear_with_autograd_takes_torch(ops):
    w = torch.randn(8, 4, requires_grad=True)
    y = kernels.linear(torch.nn.Module(), torch.randn(2, 4), w)
    y.sum().backward()
    assert w.grad is not None


def test_rms_norm(ops):
    x, w = torch.randn(9, 256), torch.randn(256)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (256,), w, 1e-5), rtol=1e-5, atol=1e-5)
    strided = torch.randn(9, 512)[:, :256]  # rows need not be packed together
    torch.testing.assert_close(ops.rms_norm(strided, w, 1e-5), F.rms_norm(strided, (256,), w, 1e-5))


def test_rotary_in_place_matches_torch(ops, monkeypatch):
    rope = RotaryEmbedding(32, 128, 10000.0)
    qkv = torch.randn(6, 24, 32)  # 16 query, 4 key and 4 value heads
    positions = torch.tensor([0, 1, 5, 9, 100, 127])
    with torch.no_grad():
        monkeypatch.setitem(kernels._state, "ops", None)
        expected = rope(positions, qkv[:, :20].clone())
        monkeypatch.setitem(kernels._state, "ops", ops)
        values = qkv[:, 20:].clone()
        out = rope(positions, qkv[:, :20])
    assert out.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 20:], values)  # the value heads beside them untouched


def test_silu_mul(ops):
    gate_up = torch.randn(7, 2 * 96) * 20  # far into both tails of the sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
