"""The load generator without a server: arrival patterns, CSV rates, length specs, adapter
mixes, request planning, the report figures, and the runner against a fake server
(coordinator/bench/{arrivals,request_shapes,load_runner,load_report}.py). Every RNG is
seeded, so the statistical bounds are deterministic."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter

import httpx
import pytest

from coordinator.bench.arrivals import (
    Bursty,
    Constant,
    Patterned,
    Poisson,
    Ramp,
    RateSchedule,
    parse_rate_csv,
)
from coordinator.bench.load_report import slo_attainment_over_time, summarize, timeline
from coordinator.bench.load_runner import LoadProgress, LoadSpec, plan_requests, run_load
from coordinator.bench.loadgen import LoadResult, RequestRecord
from coordinator.bench.request_shapes import AdapterMix, parse_length


def rate_integral(schedule: RateSchedule, start_s: float, end_s: float, step_s: float = 1e-3) -> float:
    """The expected number of arrivals in [start_s, end_s): midpoint rule on rps(t)."""
    n = round((end_s - start_s) / step_s)
    return sum(schedule.rps(start_s + (i + 0.5) * step_s) for i in range(n)) * step_s


def within_poisson_bounds(count: int, expected: float) -> bool:
    return abs(count - expected) <= 4 * math.sqrt(max(expected, 1.0))


PATTERNS = {
    "poisson": Poisson(20.0),
    "bursty": Bursty(rps_on=30.0, rps_off=5.0, on_s=2.0, off_s=3.0),
    "ramp-linear": Ramp.linear(0.0, 40.0, 20.0),
    "ramp-points": Ramp(((0.0, 5.0), (5.0, 30.0), (15.0, 10.0))),
    "csv": Patterned((0.0, 10.0, 30.0, 5.0, 0.0, 50.0, 20.0)),
}


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arrival_counts_match_the_rate_integral(name, seed):
    schedule, duration = PATTERNS[name], 30.0
    times = schedule.arrivals(duration, random.Random(seed))
    assert times == sorted(times) and all(0 <= t < duration for t in times)
    assert within_poisson_bounds(len(times), rate_integral(schedule, 0, duration)), (len(times), name)
    for start in (0.0, 10.0, 20.0):  # and in each third: the rate's shape, not just its total
        count = sum(start <= t < start + 10 for t in times)
        assert within_poisson_bounds(count, rate_integral(schedule, start, start + 10)), (start, count)


def test_constant_spacing_is_exact():
    assert Constant(4.0).arrivals(10.0, random.Random(0)) == [i / 4 for i in range(40)]
    assert Constant(3.0).arrivals(1.0, random.Random(0)) == [0.0, 1 / 3, 2 / 3]
    assert Constant(0.5).arrivals(3.0, random.Random(0)) == [0.0, 2.0]
    assert Constant(0.0).arrivals(10.0, random.Random(0)) == []


def test_constant_ignores_the_rng():
    rng = random.Random(5)
    state = rng.getstate()
    Constant(10.0).arrivals(5.0, rng)
    assert rng.getstate() == state


def test_bursty_sends_nothing_while_off_when_rps_off_is_zero():
    schedule = Bursty(rps_on=40.0, rps_off=0.0, on_s=1.0, off_s=2.0)
    times = schedule.arrivals(60.0, random.Random(3))
    assert times and all(t % 3.0 < 1.0 for t in times)
    assert all(any(k * 3 <= t < k * 3 + 1 for t in times) for k in range(20))  # every on window has arrivals


def test_ramp_interpolates_and_holds_its_ends():
    ramp = Ramp(((2.0, 4.0), (6.0, 12.0)))
    assert [ramp.rps(t) for t in (0.0, 2.0, 4.0, 6.0, 100.0)] == [4.0, 4.0, 8.0, 12.0, 12.0]
    assert Ramp.linear(10.0, 0.0, 5.0).rps(2.5) == 5.0
    with pytest.raises(ValueError, match="strictly increasing"):
        Ramp(((0.0, 1.0), (0.0, 2.0)))
    with pytest.raises(ValueError):
        Ramp(((0.0, -1.0),))


def test_patterned_rate_steps_each_second_and_repeats():
    p = Patterned((1.0, 2.0, 3.0))
    assert [p.rps(t) for t in (0.0, 0.99, 1.0, 2.5, 3.0, 4.2)] == [1.0, 1.0, 2.0, 3.0, 1.0, 2.0]
    assert p.max_rps(1.0) == 1.0 and p.max_rps(10.0) == 3.0


def test_zero_rate_sends_nothing():
    assert Poisson(0.0).arrivals(100.0, random.Random(0)) == []
    assert Patterned((0.0, 0.0)).arrivals(100.0, random.Random(0)) == []


@pytest.mark.parametrize("name", PATTERNS)
def test_same_seed_same_schedule(name):
    schedule = PATTERNS[name]
    a = schedule.arrivals(20.0, random.Random(7))
    assert a == schedule.arrivals(20.0, random.Random(7))
    assert a != schedule.arrivals(20.0, random.Random(8))


@pytest.fixture(params=["-1", "nan", "inf"])
def bad_rate(request) -> float:
    return float(request.param)


def test_bad_rate_values_raise(bad_rate):
    for make in (Poisson, Constant, lambda r: Bursty(r, 0.0, 1.0, 1.0), lambda r: Patterned((1.0, r))):
        with pytest.raises(ValueError):
            make(bad_rate)


# ---- CSV ----------------------------------------------------------------------------------


def test_csv_with_and_without_a_header():
    assert parse_rate_csv("1\n2.5\n0\n") == (1.0, 2.5, 0.0)
    assert parse_rate_csv("rps\n1\n2\n") == (1.0, 2.0)
    assert parse_rate_csv("RPS \n3\n") == (3.0,)
    assert parse_rate_csv("t,rps\n0,4\n1,5\n") == (4.0, 5.0)  # the named column
    assert parse_rate_csv("# trace\n\nrps\n1\n\n# gap\n2\n") == (1.0, 2.0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("rps\n1\nfast\n3\n", "line 3"),
        ("1\n2\n-4\n", "line 3"),
        ("1\n\n\nnan\n", "line 4"),
        ("t,rps\n0,1\n1\n", "line 3"),  # the rps cell is missing
        ("speed\n1\n", "line 1.*rps"),
        ("", "no rows"),
        ("rps\n", "no rows"),
    ],
)
def test_csv_errors_name_the_line(text, match):
    with pytest.raises(ValueError, match=match):
        parse_rate_csv(text)


# ---- lengths and adapter mixes --------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "bounds"),
    [
        ("32", (32, 32)),
        ("fixed:7", (7, 7)),
        ("uniform:16:64", (16, 64)),
        ("normal:64:16", (1, None)),
        ("normal:64:40:20:90", (20, 90)),
        ("lognormal:50:1.0", (1, None)),
        ("lognormal:50:1.0:10:200", (10, 200)),
        ("normal:64:16::100", (1, 100)),
    ],
)
def test_length_specs_parse_and_samples_stay_in_bounds(spec, bounds):
    dist = parse_length(spec)
    assert dist.bounds == bounds and parse_length(dist.spec()) == dist
    rng = random.Random(0)
    samples = [dist.sample(rng) for _ in range(2000)]
    lo, hi = bounds
    assert all(isinstance(n, int) and lo <= n and (hi is None or n <= hi) for n in samples)
    if spec.startswith("uniform"):
        assert min(samples) == 16 and max(samples) == 64


def test_length_distributions_have_their_centre():
    rng = random.Random(1)
    normal = [parse_length("normal:64:8").sample(rng) for _ in range(4000)]
    assert abs(sum(normal) / len(normal) - 64) < 1.0
    lognormal = sorted(parse_length("lognormal:40:0.8").sample(rng) for _ in range(4000))
    assert abs(lognormal[len(lognormal) // 2] - 40) <= 3


@pytest.mark.parametrize(
    "spec",
    ["", "0", "fixed:0", "fixed:2.5", "uniform:5", "uniform:9:3", "uniform:0:4", "normal:64", "normal:-1:3",
     "normal:64:16:50:10", "gamma:2:2", "lognormal:0:1", "fixed:x", "normal:nan:1", "uniform:1:2:3"],
)
def test_bad_length_specs_raise(spec):
    with pytest.raises(ValueError):
        parse_length(spec)


def test_zipf_mix_frequencies_follow_the_ranks():
    names = ("base", "a1", "a2", "a3")
    mix = AdapterMix.zipf(names, alpha=1.0)
    harmonic = sum(1 / k for k in (1, 2, 3, 4))
    assert mix.probabilities == pytest.approx([1 / k / harmonic for k in (1, 2, 3, 4)])
    rng = random.Random(0)
    counts = Counter(mix.sample(rng) for _ in range(20000))
    assert [counts[n] for n in names] == sorted((counts[n] for n in names), reverse=True)
    for name, p in zip(names, mix.probabilities, strict=True):
        assert abs(counts[name] / 20000 - p) < 0.02
    flat = Counter(AdapterMix.zipf(names, alpha=0.0).sample(rng) for _ in range(20000))
    assert all(abs(flat[n] / 20000 - 0.25) < 0.02 for n in names)


def test_explicit_weights_and_bad_mixes():
    rng = random.Random(0)
    mix = AdapterMix(("a", "b"), (0.0, 3.0))
    assert {mix.sample(rng) for _ in range(200)} == {"b"}
    for names, weights in [(("a", "a"), (1.0, 1.0)), (("a", "b"), (1.0,)), (("a",), (0.0,)), (("",), (1.0,)),
                           (("a", "b"), (1.0, -1.0))]:
        with pytest.raises(ValueError):
            AdapterMix(names, weights)


# ---- planning and report ---------------------------------------------------------------------


def make_spec(**kw) -> LoadSpec:
    base = dict(schedule=Poisson(10.0), duration_s=10.0, mix=AdapterMix.zipf(["m0", "m1"], 1.0),
                prompt_len=parse_length("uniform:4:12"), output_len=parse_length("fixed:3"), vocab_size=50, seed=3)
    return LoadSpec(**{**base, **kw})


def test_plan_is_seeded_and_arrivals_do_not_depend_on_the_shapes():
    plan = list(plan_requests(make_spec()))
    assert plan == list(plan_requests(make_spec()))
    assert [r.arrival_s for r in plan] == Poisson(10.0).arrivals(10.0, random.Random("3:arrivals"))
    other = list(plan_requests(make_spec(prompt_len=parse_length("fixed:100"), mix=AdapterMix.single("x"))))
    assert [r.arrival_s for r in other] == [r.arrival_s for r in plan]
    assert [r.arrival_s for r in plan_requests(make_spec(seed=4))] != [r.arrival_s for r in plan]
    for r in plan:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len and 4 <= r.prompt_len <= 12
        assert all(5 <= t < 50 for t in r.prompt) and r.max_tokens == 3 and r.model in ("m0", "m1")
        assert r.body()["model"] == r.model and r.body()["stream"] is True
    text = next(plan_requests(make_spec(prompt_kind="text")))
    assert isinstance(text.prompt, str) and len(text.prompt.split()) == text.prompt_len


def record(arrival_s: float, ttft_s: float, tpot_s: float, n: int = 3, ok: bool = True, model: str = "m") -> RequestRecord:
    times = [arrival_s + ttft_s + i * tpot_s for i in range(n)]
    return RequestRecord(0, arrival_s, 4, n, status=200 if ok else 503, token_times_s=times if ok else [],
                         num_tokens=n if ok else 0, finished_s=times[-1] if ok else None,
                         error=None if ok else "overloaded", model=model)


def test_slo_attainment_over_time_and_summary():
    records = [record(0.2, 0.1, 0.05), record(0.7, 2.0, 0.05), record(1.5, 0.1, 0.5),
               record(2.1, 0.1, 0.05, ok=False, model="a")]
    bins = slo_attainment_over_time(records, 1.0, slo_ttft_s=1.0, slo_tpot_s=0.1, end_s=3.0)
    assert [(b.num_requests, b.num_attained) for b in bins] == [(2, 1), (1, 0), (1, 0)]
    assert [b.attainment for b in slo_attainment_over_time(records, 1.0, None, None, end_s=3.0)] == [1.0, 1.0, 0.0]
    s = summarize(records, duration_s=3.0, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (4, 3, 1)
    assert s["errors"] == {"503: overloaded": 1} and s["slo"]["attainment"] == 0.25
    assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["tpot_s"]["p99"] <= 0.5
    assert s["by_model"]["a"] == {"num_requests": 1, "num_failed": 1, "ttft_s_p50": None, "tpot_s_p50": None}
    assert s["offered_rps"] == pytest.approx(4 / 3.0)
    tl = timeline(records, lambda t: 2.0, 3.0, 1.0, 1.0, 0.1)
    assert [b.offered_rps for b in tl] == [2.0, 1.0, 1.0] and [b.target_rps for b in tl] == [2.0] * 3
    assert [b.completed_rps for b in tl] == [1.0, 0.0, 2.0]  # by finish time


# ---- the runner against a fake server (httpx.MockTransport) -----------------------------------


def fake_server(admin: str) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """Streams two chunks per completion; `admin`: "elastic" (one scale event), "single" (404s) or "down"."""
    seen: list[httpx.Request] = []
    started = time.time()

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if admin == "down":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/v1/completions":
            model = json.loads(request.content)["model"]
            if model == "missing":
                return httpx.Response(404, json={"error": {"message": "no such model"}})
            chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                      {"choices": [], "usage": {"completion_tokens": 2}}]
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        if admin == "single":
            return httpx.Response(404, json={"detail": "Not Found"})
        event = {"event_id": "scale-1", "from_dp": 1, "to_dp": 2, "strategy": "elastic", "started_at": started}
        if request.url.path == "/admin/status":
            return httpx.Response(200, json={"scale_event": {**event, "state": "running", "finished_at": None}})
        assert request.url.path == "/admin/scale/scale-1"
        return httpx.Response(200, json={**event, "state": "succeeded", "finished_at": started + 0.2})

    return httpx.MockTransport(handle), seen


def run_fake(admin: str, mix: AdapterMix | None = None, **kw) -> tuple[LoadResult, LoadProgress, list[httpx.Request]]:
    transport, seen = fake_server(admin)
    spec = make_spec(schedule=Constant(20.0), duration_s=0.5, mix=mix or AdapterMix.single("m0"))
    progress = LoadProgress(spec.duration_s)
    result = asyncio.run(run_load(spec, "http://fake", progress=progress, transport=transport,
                                  poll_interval_s=0.1, **kw))
    return result, progress, seen


def test_runner_records_streams_and_the_scale_events():
    result, progress, seen = run_fake("elastic", api_key="k", admin_key="adm", watch_scale_events=True,
                                      mix=AdapterMix(("m0", "missing"), (1.0, 1.0)))
    assert [r.arrival_s for r in result.records] == [i / 20 for i in range(10)]
    for r in result.records:
        assert r.is_ok == (r.model == "m0"), r
        assert r.is_ok or (r.status == 404 and "no such model" in (r.error or ""))
        assert not r.is_ok or (r.num_tokens == 2 and len(r.token_times_s) == 2 and r.ttft_s >= 0)
    assert (progress.num_sent, progress.num_ok + progress.num_failed, progress.num_in_flight) == (10, 10, 0)
    for req in seen:
        admin = req.url.path.startswith("/admin/")
        assert req.headers["authorization"] == ("Bearer adm" if admin else "Bearer k"), req.url
    (event,) = result.scale_events or []
    assert event["state"] == "succeeded" and event["end_s"] - event["start_s"] == pytest.approx(0.2)
    assert -1.0 < event["start_s"] <= 0.1  # the event started as the load did


def test_runner_without_admin_api_or_server():
    result, _, seen = run_fake("single", watch_scale_events=True)
    assert result.scale_events is None and all(r.is_ok for r in result.records)
    assert sum(req.url.path == "/admin/status" for req in seen) == 1  # a 404 ends the watch
    result, progress, _ = run_fake("down")
    assert result.scale_events is None and progress.num_failed == len(result.records) == 10
    assert all(r.status is None and (r.error or "").startswith("ConnectError") for r in result.records)
