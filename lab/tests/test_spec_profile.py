"""bench/spec_profile.py's per-kernel table: launches and device µs per cycle by kernel name, largest time first."""

from __future__ import annotations

import pytest

import spec_profile


def test_kernels_are_summed_by_name_per_cycle_and_ordered_by_time():
    events = [("gemm", 0.0, 10.0), ("scatter", 10.0, 12.0), ("gemm", 12.0, 20.0),
              ("a_very_long_kernel_name", 20.0, 21.0), ("scatter", 21.0, 25.0)]
    table = spec_profile.kernel_table(events, cycles=2, width=7)
    assert list(table) == ["gemm", "scatter", "a_very_"]
    assert table["gemm"] == pytest.approx((1.0, 9.0)) and table["scatter"] == pytest.approx((1.0, 3.0))
    assert table["a_very_"] == pytest.approx((0.5, 0.5))


def test_the_timeline_merges_overlaps_and_counts_gaps():
    t = spec_profile.timeline([(0.0, 10.0), (5.0, 12.0), (20.0, 25.0)])
    assert t["busy_us"] == pytest.approx(17.0) and t["span_us"] == pytest.approx(25.0) and t["gaps"] == [8.0]
