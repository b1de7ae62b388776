"""The benchmarks' shared admin-API helpers (`coordinator.bench.server_admin`) against a fake
server (httpx's MockTransport): waiting on a scale event, moving the server to a dp, the
standby wait's give-up, model resolution, and the progress lines' format."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from coordinator.bench.report_output import progress_printer
from coordinator.bench.server_admin import ensure_dp, resolve_model, wait_event, wait_standby


class FakeServer:
    """`/admin/status`, `POST /admin/scale` and `/admin/scale/{id}`: a scale finishes after
    `polls_to_finish` polls of its event."""

    def __init__(self, dp: int, polls_to_finish: int = 2, standby_preparing: bool = False) -> None:
        self.dp, self.polls_to_finish, self.standby_preparing = dp, polls_to_finish, standby_preparing
        self.target: int | None = None
        self.polls = 0
        self.posts: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/status":
            event = None if self.target is None else {"event_id": "e1", "state": "running"}
            return httpx.Response(200, json={"active_config": {"dp": self.dp}, "scale_event": event,
                                             "standby": {"preparing": self.standby_preparing}})
        if request.method == "POST" and request.url.path == "/admin/scale":
            self.posts.append(json.loads(request.content))
            self.target = self.posts[-1]["dp"]
            return httpx.Response(202, json={"event_id": "e1"})
        if request.url.path == "/admin/scale/e1":
            self.polls += 1
            if self.target is not None and self.polls >= self.polls_to_finish:
                self.dp, self.target = self.target, None
                return httpx.Response(200, json={"event_id": "e1", "state": "succeeded"})
            return httpx.Response(200, json={"event_id": "e1", "state": "running"})
        return httpx.Response(404)


def _run(server: FakeServer, call) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server.handle), base_url="http://fake") as client:
            return await call(client)

    return asyncio.run(main())


def test_ensure_dp_scales_once_and_waits_for_the_event():
    server, lines = FakeServer(dp=1), []
    _run(server, lambda c: ensure_dp(c, 2, timeout_s=10, progress=lines.append))
    assert server.dp == 2 and server.posts == [{"dp": 2, "strategy": "elastic"}]
    assert lines == ["reset: elastic scale dp 1 -> 2 (unmeasured)"]
    _run(server, lambda c: ensure_dp(c, 2, timeout_s=10, progress=lines.append))  # already there: no POST
    assert len(server.posts) == 1 and len(lines) == 1


def test_wait_event_gives_up_with_an_error_after_its_timeout():
    server = FakeServer(dp=1, polls_to_finish=10**9)
    server.target = 2
    event = _run(server, lambda c: wait_event(c, "e1", timeout_s=0.0))
    assert event["state"] == "running" and event["error"] == "still running after 0s"


def test_wait_standby_measures_anyway_after_its_timeout():
    lines: list[str] = []
    _run(FakeServer(dp=1, standby_preparing=True), lambda c: wait_standby(c, 0.0, lines.append))
    assert lines == ["warning: standby preparation still running; measuring anyway"]


def test_resolve_model_refuses_a_directory_without_a_checkpoint(tmp_path):
    import argparse

    args = argparse.Namespace(model=str(tmp_path), preset="tiny")
    with pytest.raises(SystemExit, match="has no config.json"):
        resolve_model(args, progress=lambda _: None)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(args, progress=lambda _: None) == str(tmp_path)


def test_progress_lines_name_the_benchmark_and_go_to_stderr(capsys):
    progress_printer("scaling")("event 1/2")
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(r"\[scaling \d\d:\d\d:\d\d\] event 1/2\n", err)
