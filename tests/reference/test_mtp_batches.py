"""The MTP reference's `batch_last` candidate follows the run's target batches (issue 48):
llama-server prefills a prompt in several decode calls (25 + 4 tokens), and the fault pairs each
call's first token with that call's last hidden, where the reference decodes the prompt at once."""

from __future__ import annotations

from featdiff.torchref.rounds import batch_last_rows


def test_one_batch_pairs_its_first_row_with_its_last():
    assert batch_last_rows((0, 1, 2, 3), ()) == [3, 0, 1, 2]


def test_the_runs_batches_cut_the_reference_batch_where_they_begin():
    rows = batch_last_rows(tuple(range(29)), (0, 25))  # the server's 25 + 4 prompt tokens
    assert rows == [24, *range(24), 28, 25, 26, 27]


def test_run_batches_outside_the_reference_batch_change_nothing():
    positions = (10, 11, 12)  # a verify at positions 10..12; the run's prefill calls began at 0 and 7
    assert batch_last_rows(positions, (0, 7, 13)) == [2, 0, 1]
