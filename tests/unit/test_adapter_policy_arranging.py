"""Request arranging in the window (CoServe §4.2) and its FCFS baseline, on (id, adapter) pairs."""

from __future__ import annotations

import pytest

from elasticmoe.adapter_policy.arranging import ARRANGERS, arrange_by_dependency, arrange_fcfs, arranger


def make_window(spec: str) -> list[tuple[str, str]]:
    """"ABA" -> [("A0", "A"), ("B0", "B"), ("A1", "A")]: ids numbered per adapter."""
    seen: dict[str, int] = {}
    out = []
    for a in spec:
        out.append((f"{a}{seen.get(a, 0)}", a))
        seen[a] = seen.get(a, 0) + 1
    return out


def ids(items: list[tuple[str, str]]) -> list[str]:
    return [i for i, _ in items]


def adapter(item: tuple[str, str]) -> str:
    return item[1]


def test_requests_of_one_adapter_follow_its_oldest_request():
    # CoServe Fig. 9: incoming requests are arranged behind queued requests of the same expert.
    assert ids(arrange_by_dependency(make_window("ABCABAC"), adapter)) == [
        "A0", "A1", "A2", "B0", "B1", "C0", "C1"]


def test_the_oldest_request_stays_first_and_nobody_moves_behind_a_younger_key():
    window = make_window("BAAAAB")
    arranged = ids(arrange_by_dependency(window, adapter))
    assert arranged[0] == "B0"
    # A request is passed only by younger ones whose key has an older request: A's are passed by B1.
    for position, (rid, _) in enumerate(window):
        assert arranged.index(rid) <= position + sum(1 for r, a in window[position + 1:] if a == "B"), rid


def test_fcfs_keeps_the_window_and_the_registry_names_both():
    window = make_window("ABAB")
    assert arrange_fcfs(window, adapter) == window
    assert arranger("fcfs") is arrange_fcfs and arranger("coserve") is arrange_by_dependency
    assert sorted(ARRANGERS) == ["coserve", "fcfs"]
    with pytest.raises(ValueError, match="request_arranging"):
        arranger("sjf")
    assert arrange_by_dependency([], adapter) == []
