"""bench_report: the bench's table as a person reads it."""

from __future__ import annotations

from chatcli.bench_report import times_faster


def test_bench_says_a_time_ratio_the_way_round_that_reads():
    assert times_faster(0.0167, 0.0049) == "3.41x faster"
    assert times_faster(0.0035, 0.0041) == "1.17x slower"
    assert times_faster(0.004, 0.004) == "1.0x faster"
