"""The measurement's tests: measuring on, as users run it."""

import pytest

from compile_pass import measure
from compile_pass.measure import store as measure_store
from compile_pass.measure import table as measured_table
from compile_pass.measure.table import TABLE


@pytest.fixture(autouse=True)
def measuring(monkeypatch, tmp_path):
    """Measurement on, for these tests only, with its cache in the test's own directory, an
    empty table, and a short budget (these shapes take milliseconds)."""
    monkeypatch.setenv(measure.MODE_VARIABLE, measure.MEASURE)
    monkeypatch.setenv(measure.SECONDS_VARIABLE, "1,4")
    monkeypatch.setenv(measure_store.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    TABLE.clear()
    measure._WARNED.clear()
    measured_table._WARNED_FILES.clear()
    yield
    TABLE.clear()
