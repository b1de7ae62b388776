"""`RankProcessPool` without Ray: which processes it keeps, hands out and kills."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from imm import rank_processes
from imm.rank_processes import RankProcessPool


class FakeRank:
    def __init__(self, pid: int, node: str, answers: bool = True) -> None:
        self.pid, self.node, self.answers = pid, node, answers
        self.where = SimpleNamespace(remote=self._where)

    def _where(self) -> dict[str, object]:
        return {"pid": self.pid, "ray_node_id": self.node, "answers": self.answers}


@pytest.fixture
def killed(monkeypatch) -> list[int]:
    """The pids `ray.kill` was called on; `ray.get` fails like Ray if any rank cannot answer."""
    gone: list[int] = []

    def get(refs, timeout):
        if not all(r["answers"] for r in refs):
            raise TimeoutError("a rank did not answer")
        return refs

    monkeypatch.setattr(rank_processes, "ray", SimpleNamespace(get=get, kill=lambda actor: gone.append(actor.pid)))
    return gone


def test_keeps_up_to_its_capacity_evicting_the_oldest(killed):
    pool = RankProcessPool(capacity=2)
    a, b, c = FakeRank(1, "n1"), FakeRank(2, "n1"), FakeRank(3, "n2")
    assert pool.give([a, b]) == [True, True]
    assert pool.give([c]) == [True]
    assert killed == [1] and len(pool) == 2
    assert pool.status()["idle"] == [{"pid": 2, "ray_node_id": "n1"}, {"pid": 3, "ray_node_id": "n2"}]


def test_takes_a_process_on_the_wanted_node_newest_first(killed):
    pool = RankProcessPool(capacity=3)
    pool.give([FakeRank(1, "n1"), FakeRank(2, "n2"), FakeRank(3, "n1")])
    assert pool.take("n3") is None
    assert pool.take("n1").pid == 3
    assert pool.take(None).pid == 2  # unpinned: any node
    assert pool.take("n1").pid == 1
    assert pool.take(None) is None and not killed
    assert pool.status()["reused"] == 3


def test_a_rank_that_cannot_say_where_it_runs_is_killed_not_kept(killed):
    pool = RankProcessPool(capacity=2)
    assert pool.give([FakeRank(1, "n1"), FakeRank(2, "n1", answers=False)]) == [False, False]
    assert sorted(killed) == [1, 2] and len(pool) == 0


def test_capacity_zero_keeps_nothing(killed):
    pool = RankProcessPool(capacity=0)
    assert pool.give([FakeRank(1, "n1")]) == [False]
    assert killed == [1]
    with pytest.raises(ValueError, match="capacity"):
        RankProcessPool(capacity=-1)


def test_a_node_that_leaves_takes_its_idle_processes_with_it(killed):
    pool = RankProcessPool(capacity=3)
    pool.give([FakeRank(1, "n1"), FakeRank(2, "n2"), FakeRank(3, "n1")])
    assert pool.drop_node("n1") == 2
    assert sorted(killed) == [1, 3] and pool.take("n1") is None and pool.take("n2").pid == 2


def test_after_close_every_process_given_is_killed(killed):
    pool = RankProcessPool(capacity=2)
    pool.give([FakeRank(1, "n1")])
    pool.close()
    assert killed == [1]
    assert pool.give([FakeRank(2, "n1")]) == [False]
    assert killed == [1, 2] and len(pool) == 0
