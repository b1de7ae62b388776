"""An adapter change whose rank hangs or dies: a bounded wait, a 503 naming the change, what was
done undone, and the adapter lock free again (it guards every later adapter change and scale)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from coordinator import adapters as adapters_module
from coordinator.adapters import RANK_CALL_S, AdapterState, ClusterAdapterHost, on_ranks
from elasticmoe.entrypoints.openai.errors import to_openai_error
from elasticmoe.errors import AdapterUnavailableError

HANG, DEAD = object(), object()


class _Rank:
    """A rank whose calls answer at once, or (per method) hang or find it dead."""

    def __init__(self, **faults: object) -> None:
        self.faults = faults
        self.calls: list[str] = []

    def __getattr__(self, method: str) -> SimpleNamespace:
        def remote(*args: object) -> object:
            self.calls.append(method)
            fault = self.faults.get(method)
            if fault is not None:
                return fault
            return {"load_lora_adapter": 0, "adapter_in_use": False}.get(method)

        return SimpleNamespace(remote=remote)


def _fake_get(refs: list[object], timeout: float | None = None) -> list[object]:
    assert timeout == RANK_CALL_S  # every call of the adapter host is bounded
    if any(r is HANG for r in refs):
        raise GetTimeoutError("timed out")
    if any(r is DEAD for r in refs):
        raise RayActorError()
    return list(refs)


class _Hmm:
    def __init__(self) -> None:
        self.loaded: set[str] = set()

    def load_adapter(self, name, slot, path, experts):
        self.loaded.add(name)
        return {}

    def adapter_rows(self, name):
        return {}

    def unload_adapter(self, name):
        self.loaded.discard(name)
        return 0


def _host(monkeypatch, ranks: list[_Rank]) -> ClusterAdapterHost:
    monkeypatch.setattr(adapters_module.ray, "get", _fake_get)
    config = SimpleNamespace(backend="native", adapter_eviction="coserve", profile=None, max_esft_adapters=2,
                             max_esft_experts=4, max_loras=2)
    inst = SimpleNamespace(ranks=ranks, device_ids=list(range(len(ranks))))
    cluster = SimpleNamespace(config=config, active=inst, hmm=_Hmm(), scale_events=SimpleNamespace(running=None))
    host = ClusterAdapterHost(cluster, publish=lambda names: None)  # type: ignore[arg-type]
    host.poll_s = 0.001
    return host


@pytest.mark.parametrize("fault", [HANG, DEAD])
def test_a_lora_load_on_a_hung_or_dead_rank_is_a_503_undone_and_frees_the_lock(monkeypatch, fault):
    ranks = [_Rank(), _Rank(load_lora_adapter=fault)]
    host = _host(monkeypatch, ranks)
    with pytest.raises(AdapterUnavailableError, match="loading adapter 'a'") as info:
        host.load_lora_blocking("a", "/adapters/a")
    assert "a" not in host.adapters
    assert ranks[0].calls == ["load_lora_adapter", "finish_adapter_unload"]  # the rank that loaded it let go
    assert host.lock.acquire(timeout=0)  # free for the next change or scale
    host.lock.release()
    err = to_openai_error(info.value)
    assert err.status_code == 503 and "loading adapter 'a'" in err.message


def test_an_esft_load_whose_rank_hangs_returns_the_hmm_rows(monkeypatch):
    host = _host(monkeypatch, [_Rank(load_esft_adapter=HANG)])
    with pytest.raises(AdapterUnavailableError):
        host.load_blocking("e", "/adapters/e", {0: (1,)})
    assert host.cluster.hmm.loaded == set()  # mapped for the slot, then released
    assert "e" not in host.adapters and host.free_esft_slot() == 0


def test_an_unload_whose_stop_a_rank_does_not_confirm_still_finishes(monkeypatch):
    """The DELETE is accepted (some ranks may already turn the adapter away); the background
    release finishes once the ranks answer whether it is in use."""
    rank = _Rank(unload_adapter=HANG)
    host = _host(monkeypatch, [rank])
    host.adapters["a"] = AdapterState("a", 0, "/adapters/a", {}, kind="lora")
    host.unload_blocking("a", wait=True)
    assert "a" not in host.adapters
    assert rank.calls == ["unload_adapter", "adapter_in_use", "finish_adapter_unload"]


def test_the_background_unload_asks_again_while_a_rank_does_not_answer(monkeypatch):
    rank = _Rank(adapter_in_use=HANG)
    host = _host(monkeypatch, [rank])
    host.adapters["a"] = AdapterState("a", 0, "/adapters/a", {}, kind="lora")
    assert host.unload_blocking("a") is False
    threading.Event().wait(0.05)
    assert host.adapters["a"].state == "unloading" and rank.calls.count("adapter_in_use") > 1
    rank.faults.clear()  # the healer replaced it, or it came back
    assert host.adapters["a"].unloaded.wait(5.0)
    assert "a" not in host.adapters


def test_on_ranks_passes_the_answers_through(monkeypatch):
    monkeypatch.setattr(adapters_module.ray, "get", _fake_get)
    assert on_ranks([1, 2], "x") == [1, 2]
    with pytest.raises(AdapterUnavailableError, match=r"x: a rank did not answer within 120s"):
        on_ranks([1, HANG], "x")
    with pytest.raises(AdapterUnavailableError, match="x: a rank is gone"):
        on_ranks([DEAD], "x")
