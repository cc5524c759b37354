"""The encoder's batch cost line (gateway/classify/batch_cost.py): pure arithmetic, no torch."""

from __future__ import annotations

import pytest

from gateway.classify.batch_cost import BatchCost, text_units


def test_units_follow_the_characters_up_to_the_window() -> None:
    assert text_units("", 32) == 2  # [CLS] and [SEP]
    assert text_units("What is RLHF?", 32) == 2 + 4
    assert text_units("word " * 1000, 32) == 32


def test_nothing_is_predicted_before_a_batch_is_seen() -> None:
    cost = BatchCost()
    assert cost.line is None and cost.predict(256, batches=4) == 0.0  # no refusal on a guess


def test_the_line_is_fitted_through_batches_of_different_sizes() -> None:
    cost = BatchCost()
    for units in (8, 32, 64, 128, 32, 8):
        cost.observe(units, 0.004 + 0.0001 * units)
    fixed, per_unit = cost.line or (0.0, 0.0)
    assert fixed == pytest.approx(0.004, rel=1e-6) and per_unit == pytest.approx(0.0001, rel=1e-6)
    assert cost.predict(64) == pytest.approx(0.0104)
    assert cost.predict(64, batches=2) == pytest.approx(0.0144)  # each pass pays the fixed part


def test_batches_of_one_size_give_a_line_through_the_origin() -> None:
    cost = BatchCost()
    for _ in range(5):
        cost.observe(32, 0.008)
    assert cost.line == pytest.approx((0.0, 0.008 / 32))
    assert cost.predict(64) == pytest.approx(0.016)  # never under a longer batch's real cost


def test_batches_of_one_size_keep_the_last_lines_shape_at_their_level() -> None:
    """Once a slope was fitted, batches all of one size (the usual case under a tight deadline)
    move the line's level, not its shape: a pair still costs the fixed part once."""
    cost = BatchCost()
    cost.observe(4, 0.0044)
    cost.observe(32, 0.0072)  # 4 ms + 0.1 ms a unit
    for _ in range(30):
        cost.observe(32, 0.0144)  # a loaded spell: twice as slow
    fixed, per_unit = cost.line or (0.0, 0.0)
    assert fixed + 32 * per_unit == pytest.approx(0.0144, rel=0.02)  # the level: the recent batches
    assert fixed > 0.0 and cost.predict(64) < 1.8 * cost.predict(32)  # a pair pays the fixed part once


def test_recent_batches_count_most() -> None:
    cost = BatchCost(decay=0.5)
    for units in (8, 32) * 10:
        cost.observe(units, 0.001 * units)  # a quiet machine
    for units in (8, 32) * 10:
        cost.observe(units, 0.003 * units)  # then a loaded one: three times slower
    assert cost.predict(32) == pytest.approx(0.096, rel=0.02)


def test_a_negative_intercept_falls_back_to_the_mean_cost_per_unit() -> None:
    cost = BatchCost()
    cost.observe(10, 0.001)
    cost.observe(100, 0.1)  # the line through both would cross zero at 9 units
    fixed, per_unit = cost.line or (1.0, 1.0)
    assert fixed == 0.0 and per_unit > 0.0
