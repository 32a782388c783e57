"""`rosechat bench structured` end to end on the demo model: the report's figures and checks."""

from __future__ import annotations

import json

from rosechat.bench import structured


def test_the_structured_bench_reports_both_batches(capsys) -> None:
    rc = structured.main(["--model", "demo", "--max-tokens", "24", "--repeats", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [r["constrained"] for r in report["rounds"]] == [False, True, False, True]  # alternated
    assert all(r["full_steps"] >= 1 and r["step_ms"] > 0 for r in report["rounds"])
    assert report["free_unchanged"] is True
    assert len(report["json"]) == 2 * len(structured.SCHEMAS)
    for reply in report["json"]:
        assert reply["finish_reason"] in ("stop", "length") and 1 <= reply["tokens"] <= 24
        assert reply["valid"] or reply["finish_reason"] == "length"
    assert report["throughput_ratio"] == report["free_step_ms"] / report["constrained_step_ms"]
    text = structured.render(report)
    assert "4 JSON Schema + 4 free" in text and "free replies the same tokens" in text
