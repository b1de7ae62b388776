"""The serving benchmark's pure parts: window figures, percentiles, the comparison table."""

from __future__ import annotations

import json

import pytest

from coordinator.bench.loadgen import RequestRecord
from coordinator.bench.serving import (
    error_samples,
    format_table,
    group_runs,
    main,
    parse_ratios,
    percentile,
    ratio_rows,
    summarize,
)


def _ok(request_id: int, arrival_s: float, ttft_s: float, tpot_s: float, num_tokens: int = 4,
        tokens_per_chunk: int = 1) -> RequestRecord:
    """A successful request streamed `tokens_per_chunk` tokens per chunk (TPOT per token)."""
    record = RequestRecord(request_id, arrival_s, prompt_len=8, max_tokens=num_tokens, status=200)
    record.token_times_s = [arrival_s + ttft_s + i * tpot_s for i in range(0, num_tokens, tokens_per_chunk)]
    record.num_tokens = num_tokens
    record.finished_s = record.token_times_s[-1]
    return record


def _failed(request_id: int, arrival_s: float, status: int = 503, error: str = "overloaded") -> RequestRecord:
    return RequestRecord(request_id, arrival_s, prompt_len=8, max_tokens=4, status=status, error=error)


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summarize_counts_the_window_and_reports_ms() -> None:
    records = [
        _ok(0, 0.5, ttft_s=0.1, tpot_s=0.01),  # before the window: its tokens do not count
        _ok(1, 1.0, ttft_s=0.2, tpot_s=0.02),
        _ok(2, 1.5, ttft_s=0.4, tpot_s=0.04),
        _ok(3, 2.7, ttft_s=0.2, tpot_s=0.2),  # finishes after the window: not timed, 1 token inside
        _failed(4, 2.0),
    ]
    s = summarize(records, 1.0, 3.0)
    assert s["completed"] == 2
    assert s["failed"] == 1
    assert s["num_timed"] == 2
    assert s["output_tok_s"] == pytest.approx((4 + 4 + 1) / 2.0)
    assert s["ttft_ms_p50"] == pytest.approx(300.0)
    assert s["ttft_ms_p99"] == pytest.approx(200.0 + 0.99 * 200.0)
    assert s["tpot_ms_p50"] == pytest.approx(30.0)
    assert s["tpot_ms_p99"] == pytest.approx(20.0 + 0.99 * 20.0)
    assert s["itl_ms_p99"] == pytest.approx(40.0) and s["itl_ms_max"] == pytest.approx(40.0)  # the timed two's gaps


def test_a_stall_shows_in_the_gaps_between_chunks() -> None:
    stalled = _ok(0, 1.0, ttft_s=0.1, tpot_s=0.01, num_tokens=5)
    stalled.token_times_s[3:] = [t + 0.1 for t in stalled.token_times_s[3:]]  # 100 ms before the 4th token
    stalled.finished_s = stalled.token_times_s[-1]
    s = summarize([stalled] + [_ok(i, 1.0, ttft_s=0.1, tpot_s=0.01, num_tokens=5) for i in range(1, 4)], 1.0, 3.0)
    assert s["tpot_ms_p50"] == pytest.approx(10.0)  # three of four requests never stalled
    assert s["itl_ms_max"] == pytest.approx(110.0)
    assert s["itl_ms_p99"] > 80.0


def test_merged_chunks_count_their_own_tokens() -> None:
    # Half the requests got a chunk per token, half 8 tokens per chunk: each counts its own tokens,
    # not the median ratio times all chunks (which would count (1 + 8) / 2 per chunk).
    records = [_ok(i, 0.0, ttft_s=0.5, tpot_s=0.01, num_tokens=64, tokens_per_chunk=1 + 7 * (i % 2))
               for i in range(4)]
    s = summarize(records, 0.0, 2.0)
    assert s["output_tok_s"] == pytest.approx(4 * 64 / 2.0)
    assert s["tokens_per_chunk_mean"] == pytest.approx(4.5)
    assert s["tpot_ms_p50"] == pytest.approx((10.0 + 560 / 63) / 2)  # (last - first chunk) / 63 tokens


def test_a_failing_request_is_failed_not_completed() -> None:
    cut = _ok(0, 1.0, ttft_s=0.1, tpot_s=0.01)
    cut.error = "stream ended without [DONE]"  # 200, tokens streamed, then cut short
    records = [cut, _failed(1, 1.2), _failed(2, 1.3, status=None, error="ConnectError")]  # type: ignore[arg-type]
    s = summarize(records, 1.0, 3.0)
    assert (s["completed"], s["failed"], s["num_timed"]) == (0, 3, 0)
    assert s["ttft_ms_p50"] is None and s["tpot_ms_p99"] is None
    assert error_samples(records + [_failed(3, 1.4)]) == [
        "200: stream ended without [DONE]", "503: overloaded", "None: ConnectError"]


def _doc(label: str, tok_s: float, ttft: float | None, tpot: float) -> dict:
    return {"label": label, "loadavg_1m": [2.0, 3.5],
            "result": {"output_tok_s": tok_s, "completed": 10, "failed": 0, "num_timed": 10, "ttft_ms_p50": ttft,
                       "ttft_ms_p99": None if ttft is None else 2 * ttft, "tpot_ms_p50": tpot,
                       "tpot_ms_p99": 2 * tpot}}


def test_ratios_and_table() -> None:
    docs = [_doc("single", 1000.0, 500.0, 20.0), _doc("elastic", 900.0, 600.0, 25.0), _doc("vllm", 800.0, None, 30.0)]
    docs[1]["result"].update(itl_ms_p99=45.0, itl_ms_max=120.0)  # runs before the ITL columns have none
    assert parse_ratios("elastic/single, elastic/vllm") == [("elastic", "single"), ("elastic", "vllm")]
    with pytest.raises(ValueError, match="LABEL/LABEL"):
        parse_ratios("elastic")
    rows = ratio_rows(docs, parse_ratios("elastic/single,elastic/vllm,elastic/missing"))
    assert [r["ratio"] for r in rows] == ["elastic/single", "elastic/vllm"]
    assert rows[0]["output_tok_s"] == pytest.approx(0.9)
    assert rows[0]["ttft_ms_p50"] == pytest.approx(1.2)
    assert rows[1]["ttft_ms_p50"] is None  # vLLM's TTFT missing: no ratio
    table = format_table(docs, parse_ratios("elastic/single,elastic/vllm"))
    assert "| single | 1000.0 | 10 | 0 | 500 / 1000 | 20.0 / 40.0 | - / - | 2.0-3.5 |" in table, table
    assert "| vllm | 800.0 | 10 | 0 | - / - | 30.0 / 60.0 | - / - | 2.0-3.5 |" in table
    assert "| elastic | 900.0 | 10 | 0 | 600 / 1200 | 25.0 / 50.0 | 45.0 / 120.0 | 2.0-3.5 |" in table
    assert "| elastic/single | 0.90 | 1.20 | 1.25 |" in table
    assert "| elastic/vllm | 1.12 | - | 0.83 |" in table


def test_repeated_labels_report_medians() -> None:
    docs = [_doc("single", 1000.0, 500.0, 20.0), _doc("elastic", 900.0, 600.0, 25.0),
            _doc("single", 1200.0, 400.0, 18.0), _doc("elastic", 1000.0, 700.0, 22.0),
            _doc("single", 800.0, 450.0, 30.0), _doc("elastic", 950.0, 650.0, 24.0)]
    docs[1]["loadavg_1m"] = [1.5, 6.0]
    medians = {g["label"]: g for g in group_runs(docs)}
    assert medians["single"]["num_runs"] == 3
    assert medians["single"]["result"]["output_tok_s"] == 1000.0
    assert medians["single"]["result"]["tpot_ms_p50"] == 20.0
    assert medians["elastic"]["loadavg_1m"] == [1.5, 6.0]
    table = format_table(docs, parse_ratios("elastic/single"))
    assert "| single | 1000.0 (1000, 1200, 800) | 10 | 0 | 450 / 900 | 20.0 / 40.0 | - / - | 2.0-3.5 |" in table, table
    assert "| elastic/single | 0.95 | 1.44 | 1.20 |" in table, table


def test_compare_mode_reads_files(tmp_path, capsys) -> None:
    paths = []
    for doc in (_doc("single", 1000.0, 500.0, 20.0), _doc("elastic", 950.0, 550.0, 21.0)):
        path = tmp_path / f"{doc['label']}.json"
        path.write_text(json.dumps(doc))
        paths.append(str(path))
    out = tmp_path / "summary.json"
    assert main(["--compare", *paths, "--out", str(out)]) == 0
    assert "| elastic/single | 0.95 |" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert [r["ratio"] for r in summary["ratios"]] == ["elastic/single"]
