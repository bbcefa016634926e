"""docs/training.md's packed-training table (benchmarks/packed_training.py): TRL's SFTTrainer
with ``packing=True`` and ``padding_free=True`` on Llama, Qwen3, Mistral and Gemma-4 tiny
configs. The page must hold a row for every model and set-up (here), and (``slow``) what a run
makes: the same layers on the op, windows and kernels, and errors within a factor of 10 of the
page's (round-off differs between CPUs). On a mismatch the test says what to run."""

import math

import pytest

from benchmarks import families, packed_training

REGENERATE = "run `python benchmarks/packed_training.py --write` (minutes) and commit what it changes"
ERROR_COLUMNS = (5, 6)  # worst error vs eager, vs fp64 (eager's)


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def _errors(cell: str) -> list[float]:
    return [float(part.strip("()")) for part in cell.split()]


def test_the_page_has_a_row_for_every_model_and_setup():
    rows = _rows(families.block(packed_training.PAGE, packed_training.MARKERS))
    expected = [[name, setup] for name in packed_training.MODELS for setup in packed_training.SETUPS]
    assert [row[:2] for row in rows] == expected, REGENERATE
    for row in rows:  # every layer on the op, within the tests' tolerance of eager and fp64
        on_op, total = row[2].split(" of ")
        assert on_op == total, row
        assert all(error <= 1e-4 for column in ERROR_COLUMNS for error in _errors(row[column])), row


@pytest.mark.slow
def test_the_page_holds_what_a_run_makes():
    page = _rows(families.block(packed_training.PAGE, packed_training.MARKERS))
    live = _rows(packed_training.run_all())
    assert len(page) == len(live), REGENERATE
    for ours, theirs in zip(live, page, strict=True):
        same = [index for index in range(len(ours)) if index not in ERROR_COLUMNS]
        assert [ours[i] for i in same] == [theirs[i] for i in same], f"{ours} != {theirs}: {REGENERATE}"
        for column in ERROR_COLUMNS:
            for a, b in zip(_errors(ours[column]), _errors(theirs[column]), strict=True):
                assert abs(math.log10(max(a, 1e-9) / max(b, 1e-9))) <= 1, f"{ours} != {theirs}: {REGENERATE}"
