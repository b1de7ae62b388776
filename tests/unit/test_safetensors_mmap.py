"""Zero-copy views of a safetensors file (`elasticmoe.models.safetensors_mmap`), the weight
provider's reads through them and the disk tier's expert rows: the tensors safetensors gives."""

from __future__ import annotations

import pytest
import torch
from offload_factories import bf16_disk_experts
from safetensors.torch import load_file, save_file

from elasticmoe.engine.expert_sources import DiskExperts, LayerExpertSpecs
from elasticmoe.models.safetensors_mmap import MappedSafetensors
from elasticmoe.models.weights import ParamSpec, SafetensorsWeightProvider


@pytest.fixture
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(6, 4, generator=gen).bfloat16(),
        "b.f32": torch.randn(3, 5, generator=gen),
        "c.f16": torch.randn(7, generator=gen).half(),
        "d.i64": torch.arange(5, dtype=torch.int64),
        "e.bool": torch.tensor([True, False, True]),
        "f.u8": torch.arange(3, dtype=torch.uint8),  # leaves the next tensor at an odd offset
        "g.f32": torch.randn(2, 2, generator=gen),
        "h.scalar": torch.tensor(2.5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_views_equal_what_safetensors_reads(checkpoint):
    want = load_file(str(checkpoint / "model.safetensors"))
    mapped = MappedSafetensors(checkpoint / "model.safetensors")
    assert sorted(mapped.names()) == sorted(want)
    for name, tensor in want.items():
        view = mapped.view(name)
        if view is None:  # only an unaligned tensor may need safetensors' own read
            continue
        assert view.dtype == tensor.dtype and view.shape == tensor.shape and torch.equal(view, tensor), name
    assert mapped.dtype("a.bf16") == "BF16"


def test_the_provider_reads_into_its_destination_converting_dtype(checkpoint):
    want = load_file(str(checkpoint / "model.safetensors"))
    provider = SafetensorsWeightProvider(checkpoint)
    dst = torch.empty(9, 4, dtype=torch.float32)
    provider.read_into(dst[:6], ("a.bf16",))
    assert torch.equal(dst[:6], want["a.bf16"].float())
    rows = torch.empty(4, 2)
    provider.read_into(rows, ("g.f32", "g.f32"))  # concatenated along dim 0
    assert torch.equal(rows, torch.cat([want["g.f32"], want["g.f32"]]))
    with pytest.raises(ValueError, match="rows"):
        provider.read_into(torch.empty(3, 2), ("g.f32",))
    with pytest.raises(KeyError):
        provider.read_into(dst, ("missing",))
    assert provider.bytes_read > 0
    provider.close()


def test_a_view_outlives_the_provider(checkpoint):
    provider = SafetensorsWeightProvider(checkpoint)
    view = provider.mapped_view("b.f32")
    provider.close()
    assert torch.equal(view, load_file(str(checkpoint / "model.safetensors"))["b.f32"])


def test_disk_experts_fill_a_row_from_the_mapped_checkpoint(tmp_path):
    names, experts, w13, w2 = bf16_disk_experts(tmp_path)
    row13, row2 = torch.empty(6, 4), torch.empty(3, 4)  # fp32 rows from a bf16 checkpoint
    assert experts.copy_into(0, 1, row13, row2) == row13.nbytes + row2.nbytes
    assert torch.equal(row13, torch.cat([names["e1.gate"], names["e1.up"]]).float())
    assert torch.equal(row2, names["e1.down"].float())
    bad = ParamSpec("w13", (2, 5, 4), w13.sources, expert_ids=(0, 1))  # gate + up make 6 rows, not 5
    with pytest.raises(ValueError, match="expert row"):
        DiskExperts(str(tmp_path), [LayerExpertSpecs(bad, w2)])
