"""CoServe §4.1 on the elastic server: a new instance fills its LoRA slots with the adapters most
likely to be used (declared `usage_probability`, descending), not in registration order."""

from types import SimpleNamespace

from coordinator import adapters as adapters_module
from coordinator.adapters import AdapterState, ClusterAdapterHost, initial_load_order


def _lora(name: str, p: float | None) -> AdapterState:
    return AdapterState(name, None, f"/adapters/{name}", {}, kind="lora", usage_probability=p)


def test_declared_probabilities_first_descending_then_the_rest_in_registration_order():
    registered = [_lora("a", None), _lora("b", 0.1), _lora("c", 0.5), _lora("d", None), _lora("e", 0.5),
                  _lora("f", 0.2), _lora("g", 0.0)]
    assert [a.name for a in initial_load_order(registered)] == ["c", "e", "f", "b", "g", "a", "d"]


class _Rank:
    """A rank with `num_slots` LoRA slots: free slots in order, then host memory (None)."""

    def __init__(self, num_slots: int) -> None:
        self.free, self.loaded = list(range(num_slots)), []
        self.load_lora_adapter = SimpleNamespace(remote=self._load)

    def _load(self, name, path, usage_probability):
        self.loaded.append(name)
        return self.free.pop(0) if self.free else None


def test_a_new_instance_gives_its_slots_to_the_most_probable_adapters(monkeypatch):
    monkeypatch.setattr(adapters_module.ray, "get", lambda refs, timeout=None: refs)
    config = SimpleNamespace(backend="native", adapter_eviction="coserve", profile=None, max_esft_adapters=0,
                             max_esft_experts=0, max_loras=2)
    host = ClusterAdapterHost(SimpleNamespace(config=config), publish=lambda names: None)  # type: ignore[arg-type]
    for name, p in [("rare", 0.01), ("unknown", None), ("hot", 0.6), ("warm", 0.3)]:  # registration order
        host.adapters[name] = _lora(name, p)
    ranks = [_Rank(2), _Rank(2)]  # under EP every rank loads the same adapters in the same order
    host.prepare_instance(SimpleNamespace(ranks=ranks))  # type: ignore[arg-type]
    assert ranks[0].loaded == ranks[1].loaded == ["hot", "warm", "rare", "unknown"]
    assert {name: a.slot for name, a in host.adapters.items()} == {"hot": 0, "warm": 1, "rare": None,
                                                                    "unknown": None}
