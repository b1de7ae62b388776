"""Replicated experts (ep = 1): data-parallel replicas that each hold every expert (the vLLM
backend's layout). Synthetic model of `hmm_factories`: D = 11000 B dense, X = 600 B per expert,
32 experts, so a full replica holds D + 32 X = 30200 B of weights."""

from __future__ import annotations

import pytest
from hmm_factories import KV, D, X, make_devices, make_sizes

from hmm.layout import layout_for
from hmm.planner import plan, restore_plan, scale_target
from hmm.scale_plan import DiskLoad, Free, P2PCopy, Remap, Reuse

FULL = D + 32 * X


def replicated(dp: int):
    return layout_for(None, make_sizes(), make_devices(dp), dp, 1, kv_bytes=KV)


def test_every_device_holds_every_expert():
    layout = replicated(3)
    assert layout.is_replicated and layout.ep == 1 and layout.dp == 3
    for d in layout.device_ids:
        assert layout.local_experts(d) == tuple(range(32))
        assert layout.weight_bytes(d) == FULL
    assert layout.holders(5) == (0, 1, 2)


def test_ep_must_be_dp_or_one():
    with pytest.raises(ValueError, match="ep must be dp"):
        layout_for(None, make_sizes(), make_devices(4), 4, 2, kv_bytes=KV)


def test_a_new_replica_gets_a_full_copy_by_p2p():
    current = replicated(1)
    p = plan(current, scale_target(current, 2, make_devices(2)[1:], kv_bytes=KV, replicated=True))
    p.validate()
    assert p.target.is_replicated
    assert p.bytes_p2p == FULL and p.bytes_disk == 0
    assert {s.dst_device for s in p.steps if isinstance(s, P2PCopy)} == {1}
    # Device 0 keeps everything in place (dense, 32 experts at their slots, its KV pool).
    assert p.bytes_reused == FULL + KV
    assert not any(isinstance(s, Remap | Free) for s in p.steps)


def test_copies_to_a_new_replica_are_spread_over_the_old_ones():
    current = replicated(2)
    p = plan(current, scale_target(current, 3, make_devices(3)[2:], kv_bytes=KV, replicated=True))
    p.validate()
    sent = p.bytes_sent_by_device()
    assert sum(sent.values()) == FULL and set(sent) == {0, 1}
    assert abs(sent[0] - sent[1]) <= 4000  # the largest single tensor


def test_scale_down_frees_the_replica_and_moves_nothing():
    current = replicated(2)
    p = plan(current, scale_target(current, 1, kv_bytes=KV, replicated=True))
    p.validate()
    assert p.bytes_moved == 0
    assert all(s.device == 1 for s in p.steps if isinstance(s, Free))
    assert sum(s.nbytes for s in p.steps if isinstance(s, Free)) == FULL + KV
    assert sum(1 for s in p.steps if isinstance(s, Reuse)) > 0


def test_a_lost_replica_is_restored_from_its_peers_not_from_disk():
    layout = replicated(3)
    p = restore_plan(layout, 1)
    assert not any(isinstance(s, DiskLoad) for s in p.steps)
    assert sum(s.nbytes for s in p.steps if isinstance(s, P2PCopy)) == FULL
    assert {s.src_device for s in p.steps if isinstance(s, P2PCopy)} == {0, 2}
