"""The fused rotary kernel against the PyTorch path it replaces, bit for bit: both conventions
(Qwen3/Mixtral's half rotation in the model dtype, DeepSeek's interleaved pairs in fp32), both
dtypes, every ISA build this CPU runs, heads read out of a fused projection's row."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.kernels import rotary as rk
from elasticmoe.kernels.build import load_kernel
from elasticmoe.layers import rotary
from elasticmoe.layers.rotary import RotaryEmbedding
from elasticmoe.utils.cpu_features import detect_cpu_features

_ORDER = ["avx2", "avx512", "avx512_bf16", "amx"]
_HOST = detect_cpu_features().kernel_isa
ISAS = _ORDER[: _ORDER.index(_HOST) + 1] if _HOST in _ORDER else []


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    if load_kernel("rotary", request.param) is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(rk, "load_kernel", lambda n, _isa=request.param: load_kernel(n, _isa))
    rk._kernel.cache_clear()
    yield request.param
    rk._kernel.cache_clear()


def _torch_path(rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(rotary, "fused_rotary", lambda *a, **k: None)
        return rope(x, positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_tokens", [5, 300])  # a decode step; a prefill, on all threads
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: halves of 12, not a whole vector
def test_fused_rotary_equals_the_torch_path(isa, monkeypatch, dtype, interleaved, num_tokens, head_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, interleaved=interleaved)
    qkv = torch.randn(num_tokens, 12, head_dim).to(dtype) * 3
    heads = qkv[:, :10]  # q and k heads of a fused projection: a token stride past the heads
    positions = torch.randint(0, 4096, (num_tokens,))
    got = rope(heads, positions)
    assert rk.fused_rotary(heads, positions, *((rope.cos, rope.sin) if interleaved else rope._table(dtype)),
                           interleaved=interleaved) is not None  # the kernel ran
    want = _torch_path(rope, heads, positions, monkeypatch)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_a_position_past_the_tables_is_refused_as_before(isa):
    rope = RotaryEmbedding(64, 128, 10000.0, interleaved=False)
    x = torch.randn(2, 4, 64)
    assert rk.fused_rotary(x, torch.tensor([3, 128]), *rope._table(x.dtype), interleaved=False) is None
    with pytest.raises(RuntimeError):  # index_select, as before the kernel
        rope(x, torch.tensor([3, 128]))
