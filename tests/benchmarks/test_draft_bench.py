"""benchmarks.draft_bench: acceptance per draft position and phase costs from the runner's step outputs."""

from benchmarks.draft_bench import PositionTally
from scheduler.types import RowOutput, StepOutput


def test_acceptance_per_position_counts_the_verifies_that_drafted_it():
    tally = PositionTally()
    tally.add(
        StepOutput(
            rows=[
                RowOutput("a", [1, 2, 3], num_draft_tokens=4, num_accepted_tokens=2),
                RowOutput("b", [1], num_draft_tokens=2, num_accepted_tokens=0),
                RowOutput("plain", [5]),  # did not speculate: not a verify
            ],
            phase_seconds={"draft": 0.002, "verify": 0.030},
        )
    )
    tally.add(
        StepOutput(
            rows=[RowOutput("a", [4, 5, 6, 7, 8], num_draft_tokens=4, num_accepted_tokens=4)],
            phase_seconds={"draft": 0.004, "verify": 0.050},
        )  # fmt: skip
    )
    tally.add(StepOutput(rows=[RowOutput("a", [9])], phase_seconds={"decode": 0.020}))
    # Position 1 drafted by 3 verifies, accepted by 2; positions 3-4 drafted only by row a's two verifies.
    assert tally.rates(5) == [2 / 3, 2 / 3, 1 / 2, 1 / 2, None]
    assert tally.verifies == 3 and tally.mean_accepted == 6 / 3
    assert tally.ms_per_step("draft") == 3.0 and tally.ms_per_step("verify") == 40.0
    assert tally.ms_per_step("decode") == 20.0 and tally.ms_per_step("prefill") is None
