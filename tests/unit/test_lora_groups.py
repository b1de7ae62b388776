"""`LoraGroups.delta` and `add_delta` on a continuous batch's mix of group sizes, in both compute dtypes."""

import pytest
import torch

from elasticmoe.kernels.grouped_gemm import has_grouped_gemm
from elasticmoe.layers.lora import LoraGroups


def _reference(x: torch.Tensor, keys: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """Each row through its slot's factors alone, in x's dtype like the engine (h rounded to it)."""
    out = torch.zeros(x.shape[0], bt.shape[2], dtype=x.dtype)
    for row, key in enumerate(keys.tolist()):
        if key >= 0:
            h = x[row : row + 1] @ a[key].T
            out[row] = (h @ bt[key])[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[128] + [1] * 40, [1] * 64, [200, 30, 20, 6]], ids=["prefill+decodes", "decodes", "uneven"])
@pytest.mark.parametrize("keyless", [True, False], ids=["some-rows-keyless", "every-row-keyed"])
def test_a_mixed_batch_equals_each_row_through_its_own_adapter(dtype, sizes, keyless):
    g = torch.Generator().manual_seed(0)
    num_slots, rank, d_in, d_out = 128, 16, 96, 80
    a = (torch.randn(num_slots, rank, d_in, generator=g) * 0.1).to(dtype)
    bt = (torch.randn(num_slots, rank, d_out, generator=g) * 0.1).to(dtype)  # B transposed, as a site keeps it
    keys = torch.cat([torch.full((n,), 2 * k) for k, n in enumerate(sizes)])  # every other slot
    if keyless:
        keys[::7] = -1  # rows without an adapter
    order = torch.randperm(keys.numel(), generator=g)
    keys = keys[order]  # the batch's rows come in any order
    x = torch.randn(keys.numel(), d_in, generator=g).to(dtype)
    groups = LoraGroups.build(keys)
    assert groups is not None
    assert groups.one_per_row is not keyless and not groups.in_order  # the rows came shuffled
    got = groups.delta(x, a, bt)
    padded = groups._padded_delta(x, a, bt)  # the path without the kernel, per pair
    want = _reference(x, keys, a, bt)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(x.new_zeros(want.shape).index_add_(0, groups.rows, padded), want, **tol)
    assert (got[keys < 0] == 0).all()


def test_the_grouped_kernel_serves_both_compute_dtypes():
    """Where the kernels build, `delta` takes the grouped kernel in bf16 too: padding every group to the
    largest cost a prefill beside 40 decodes 27x the grouped time (docs/adapters.md)."""
    if not has_grouped_gemm(torch.float32, torch.float32):
        pytest.skip("the grouped kernel is not built here")
    assert has_grouped_gemm(torch.bfloat16, torch.bfloat16)


def test_one_adapter_in_row_order_returns_its_pairs_as_they_are():
    """An expert site's rows of one adapter (keys [N, 1], weight 1): the pairs are the rows in order,
    the LoRA output is the grouped product itself, and it equals each row through its factors."""
    g = torch.Generator().manual_seed(1)
    a, bt = torch.randn(8, 4, 16, generator=g), torch.randn(8, 4, 12, generator=g)
    keys = torch.tensor([[1], [1], [3], [3], [3], [6]])  # sorted, as an expert site's rows are
    x = torch.randn(6, 16, generator=g)
    groups = LoraGroups.build(keys, torch.ones(6, 1))
    assert groups is not None and groups.in_order and groups.one_per_row and groups.weights is None
    torch.testing.assert_close(groups.delta(x, a, bt), _reference(x, keys[:, 0], a, bt))
    scaled = LoraGroups.build(keys, torch.full((6, 1), 0.5))  # a router's weight stays applied
    assert scaled is not None and scaled.weights is not None
    torch.testing.assert_close(scaled.delta(x, a, bt), 0.5 * _reference(x, keys[:, 0], a, bt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[1] * 64, [3] * 20, [128], [128] + [1] * 40], ids=["decodes", "small-groups", "one-prefill", "prefill+decodes"])
def test_add_delta_gives_the_values_of_the_output_plus_delta(dtype, sizes):
    """`add_delta` (one kernel call for a batch whose rows have one adapter each, the two kernels
    where their groups run on panels) equals `y + delta`, bit for bit; rows of several weighted
    adapters take `y + delta` as it is."""
    g = torch.Generator().manual_seed(2)
    num_slots, rank, d_in, d_out = 64, 16, 96, 80
    a = (torch.randn(num_slots, rank, d_in, generator=g) * 0.1).to(dtype)
    bt = (torch.randn(num_slots, rank, d_out, generator=g) * 0.1).to(dtype)
    keys = torch.cat([torch.full((n,), k % num_slots) for k, n in enumerate(sizes)])
    keys = keys[torch.randperm(keys.numel(), generator=g)]
    x = torch.randn(keys.numel(), d_in, generator=g).to(dtype)
    y = torch.randn(keys.numel(), d_out, generator=g).to(dtype)
    groups = LoraGroups.build(keys)
    assert groups is not None and groups.one_per_row
    want = y + groups.delta(x, a, bt)
    assert torch.equal(groups.add_delta(y.clone(), x, a, bt), want)
    assert torch.equal(groups.add_delta(y.clone(), x, a, bt), want)  # a second site of the same build
    routed = torch.stack([keys, (keys + 1) % num_slots], dim=1)  # two adapters per row, weighted
    weights = torch.full(routed.shape, 0.5)
    mixed = LoraGroups.build(routed, weights)
    assert mixed is not None and not mixed.one_per_row
    assert torch.equal(mixed.add_delta(y.clone(), x, a, bt), y + mixed.delta(x, a, bt))


def test_the_engines_keys_with_an_unused_routing_column_are_one_pair_per_row():
    """The engine's keys carry K columns (learned routing's top-k), -1 beyond each row's adapter
    when no router runs: still one pair per row, in order when the rows are, so the site writes
    each row once (and `add_delta` takes its one kernel call); a second adapter in a row is not."""
    keys = torch.tensor([[3, -1], [3, -1], [5, -1], [5, -1]])
    groups = LoraGroups.build(keys, torch.tensor([[1.0, 0.0]] * 4))
    assert groups is not None and groups.one_per_row and groups.in_order and groups.weights is None
    keys[1, 1] = 7
    routed = LoraGroups.build(keys, torch.tensor([[1.0, 0.0]] * 4))
    assert routed is not None and not routed.one_per_row
