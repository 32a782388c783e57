"""`rosechat bench spec --streams N`: the free chat workload as N chats decoded at once, summed as the batch's
aggregate decode rate; its options checked."""

from __future__ import annotations

import pytest

from rosechat.bench import spec
from rosechat.bench.spec import WORKLOADS, batch_rate, build_parser, chat_streams, paired_ratios, render


def test_batch_rate_counts_every_reply_after_its_first_token_over_the_shared_decode_time() -> None:
    # (tokens, seconds to the first token, seconds to the last), from one start
    assert batch_rate([(10, 0.5, 2.5), (5, 0.4, 1.5)]) == pytest.approx((9 + 4) / (2.5 - 0.5))
    assert batch_rate([(1, 0.5, 0.5), (1, 0.4, 0.4)]) == 0.0  # nothing decoded after the first tokens
    assert batch_rate([]) == 0.0


def test_chat_streams_start_with_the_chat_workload_and_cycle() -> None:
    assert chat_streams(2) == WORKLOADS["chat"]
    many = chat_streams(20)
    assert len(many) == 20 and len(set(many[:8])) == 8 and many[8] == many[0]


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--workloads", "chat,poetry"], ["--workloads", ","]])
def test_bad_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert spec.main(argv) == 2
    assert "rosechat bench spec:" in capsys.readouterr().out


def test_streams_run_the_chats_in_one_batch_and_report_their_aggregate() -> None:
    args = build_parser().parse_args(["--model", "demo", "--no-llama-cpp", "--max-tokens", "6", "--repeats", "1",
                                      "--streams", "3", "--workloads", "chat"])
    report = spec.run(args)
    assert list(report["tok_s"]) == ["chat x3"] and set(report["tok_s"]["chat x3"]) == {"rosechat", "rosechat ngram"}
    assert all(rate > 0 for rate in report["tok_s"]["chat x3"].values())
    assert report["reply_tokens"] == {"chat x3": [6, 6, 6]} and report["identical"] == {"chat x3": True}
    text = render(report)
    assert "chat x3: 3 chats at once" in text and "chat x3    rosechat ngram" in text and "step cost" in text


def test_the_ratio_to_plain_is_paired_within_each_round() -> None:
    """The machine's speed drifts between rounds: speculation 4 % behind plain in two rounds of three looked
    1 % ahead when the best round of each was compared (plain's best in one round, speculation's in another)."""
    rounds = {"chat": {"rosechat": [100.0, 80.0, 90.0], "rosechat ngram": [96.0, 77.0, 101.0]}}
    paired = paired_ratios(rounds)["chat"]
    assert paired["rosechat"] == [1.0, 1.0, 1.0]
    assert paired["rosechat ngram"] == pytest.approx([0.96, 77 / 80, 101 / 90])
    assert max(rounds["chat"]["rosechat ngram"]) / max(rounds["chat"]["rosechat"]) == pytest.approx(1.01)
    report = {"header": {"model": "m", "dtype": "float32", "quantization": "auto", "threads": 2, "cpu": "c",
                         "kernels": "k", "load_before": "", "load_after": "", "wall_s": 1, "source": "s",
                         "max_tokens": 8, "repeats": 3, "speculative_config": {}, "sampling": "greedy"},
              "tok_s": {"chat": {"rosechat": 100.0, "rosechat ngram": 101.0}}, "paired": paired_ratios(rounds),
              "acceptance": 0.5, "tokens_per_check": 2.0, "reply_tokens": {}, "identical": {"chat": True}}
    row = next(line for line in render(report).splitlines() if "rosechat ngram" in line)
    assert row.split()[-2:] == ["0.96x", "(0.96-1.12)"]


def test_warm_up_rounds_are_not_counted_and_each_system_goes_first_in_turn(monkeypatch) -> None:
    """The first round measures first uses and a step cost still being learned (8 chats: 0.91x plain in the first
    round, 1.00x after); the system run second in a round met a different machine than the first."""
    calls: list[str] = []

    def fake_round(llm, prompts, max_tokens, sampling):
        calls.append("spec" if llm.scheduler.proposer is not None else "plain")
        return [{"tokens": [1, 2], "tok_s": float(len(calls))} for _ in prompts]

    monkeypatch.setattr(spec, "_rosechat_round", fake_round)
    args = build_parser().parse_args(["--model", "demo", "--no-llama-cpp", "--max-tokens", "6", "--repeats", "3",
                                      "--warmup", "1", "--workloads", "edit,chat"])
    report = spec.run(args)
    rounds = [calls[i : i + 4] for i in range(0, len(calls), 4)]  # edit's two systems, then chat's
    assert rounds == [["spec", "plain"] * 2, ["plain", "spec"] * 2, ["spec", "plain"] * 2, ["plain", "spec"] * 2]
    # counted: the rounds after the warm-up (calls 5-16); chat's: plain 7, spec 8 | spec 11, plain 12 | plain 15...
    assert report["paired"]["chat"]["rosechat ngram"] == pytest.approx([8 / 7, 11 / 12, 16 / 15])
    assert [list(by) for by in report["tok_s"].values()] == [["rosechat", "rosechat ngram"]] * 2  # whoever ran first
    assert "3 rounds after 1 warm-up" in render(report)
