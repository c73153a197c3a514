"""`fit_to_budget`: the fitted step count never exceeds the run, always takes one step, and fills the budget."""

from __future__ import annotations

import pytest

from hstap.train.budget import fit_to_budget, probe_sizes, refit_to_budget

# (total, step, seconds_per_step, seconds_left, expected): expected worked out by hand as
# min(total, step + whole steps that fit in seconds_left), at least step + 1
CASES = [
    pytest.param(100, 0, 1.0, 0.5, 1, id="budget-shorter-than-one-step"),
    pytest.param(100, 0, 1.0, 0.0, 1, id="no-budget-left-still-one-step"),
    pytest.param(100, 0, 1.0, -5.0, 1, id="probe-overran-the-budget"),
    pytest.param(100, 0, 1.0, 1000.0, 100, id="budget-longer-than-the-run"),
    pytest.param(100, 0, 1.0, 100.0, 100, id="budget-exactly-the-run"),
    pytest.param(100, 0, 2.0, 50.0, 25, id="half-a-run-at-2s-per-step"),
    pytest.param(100, 0, 0.5, 10.0, 20, id="20-steps-at-half-a-second"),
    pytest.param(100, 0, 0.25, 1.0, 4, id="quarter-second-steps"),
    pytest.param(100, 0, 3.0, 10.0, 3, id="partial-step-rounds-down"),
    pytest.param(100, 0, 1.0, 99.999, 99, id="just-short-of-the-run"),
    pytest.param(100, 40, 1.0, 30.0, 70, id="resumed-at-40-with-30-steps-of-budget"),
    pytest.param(100, 40, 1.0, 100.0, 100, id="resumed-budget-past-the-end"),
    pytest.param(100, 40, 1.0, 0.1, 41, id="resumed-tiny-budget-one-more-step"),
    pytest.param(100, 99, 1.0, 50.0, 100, id="resumed-one-step-before-the-end"),
    pytest.param(1, 0, 10.0, 1.0, 1, id="one-step-run"),
    pytest.param(10**6, 0, 0.001, 3600.0, 10**6, id="an-hour-of-millisecond-steps-capped-by-total"),
    pytest.param(10**7, 0, 0.001, 3600.0, 3_600_000, id="an-hour-of-millisecond-steps"),
    pytest.param(100, 100, 1.0, 50.0, 100, id="resumed-after-the-run-finished"),
]


@pytest.mark.parametrize("total, step, seconds_per_step, seconds_left, expected", CASES)
def test_fit_to_budget(total, step, seconds_per_step, seconds_left, expected):
    assert fit_to_budget(total, step, seconds_per_step, seconds_left) == expected


@pytest.mark.parametrize("step", [0, 7, 99], ids=lambda s: f"step-{s}")
def test_fitted_count_grows_with_the_budget_and_stays_within_bounds(step):
    fitted = [fit_to_budget(100, step, 0.7, seconds) for seconds in [x * 0.5 for x in range(0, 200)]]
    assert fitted == sorted(fitted), "more budget never means fewer steps"
    assert all(step + 1 <= f <= 100 for f in fitted)
    assert fitted[0] == step + 1 and fitted[-1] == 100


@pytest.mark.parametrize("batches, expected", [
    (13, (3, 10)), (100, (3, 10)),  # a real run: 3 untimed warm-up steps, 10 timed
    (12, (1, 12)), (2, (1, 2)), (1, (1, 1)), (0, (1, 1)),  # a tiny plan: never probe more than its own batches
])
def test_probe_sizes(batches, expected):
    assert probe_sizes(batches) == expected


# (cap, step, seconds_per_step, seconds_left, eval_seconds, steps_per_epoch, step_in_epoch, expected), by hand
REFITS = [
    pytest.param(1000, 100, 1.0, 500.0, 0.0, 200, 100, 600, id="no-evaluations-is-fit_to_budget"),
    # 440 steps + evaluations at the epoch ends after 100 and 300 more steps and at the stop 140 steps into an
    # epoch: 3 × 20 s; 440 + 60 = 500
    pytest.param(1000, 100, 1.0, 500.0, 20.0, 200, 100, 540, id="three-evaluations-ahead"),
    pytest.param(300, 100, 1.0, 500.0, 20.0, 200, 100, 300, id="capped-by-the-run"),
    pytest.param(1000, 100, 1.0, 5.0, 20.0, 200, 100, 100, id="budget-spent-stops-now"),
    pytest.param(1000, 100, 1.0, -3.0, 0.0, 200, 100, 100, id="budget-overrun-stops-now"),
]


@pytest.mark.parametrize("cap, step, per_step, left, eval_s, per_epoch, in_epoch, expected", REFITS)
def test_refit_to_budget(cap, step, per_step, left, eval_s, per_epoch, in_epoch, expected):
    assert refit_to_budget(cap, step, per_step, left, eval_s, per_epoch, in_epoch) == expected
