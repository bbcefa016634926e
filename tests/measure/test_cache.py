"""The cache of measurements cannot poison a run: records are checked on read, what passes is
never a verdict, a refusal holds for its bucket, ``remeasure`` clears the key, and the
environment's fingerprint follows the imports of what a measurement runs."""

import json
import math
import warnings

import pytest
import torch

from compile_pass import measure, sources
from compile_pass.kernels import chunked, policy
from compile_pass.measure import run as measure_run
from compile_pass.measure import store as measure_store
from compile_pass.measure.table import TABLE, Measured, key_of
from tests.measure.test_measure import KEYS, Altered, call_facts, measured_of, said


def _record_file(facts=None, kernel="chunked", keys=KEYS):
    """The file that holds the chunked kernel's record of the call's key at ``keys``."""
    facts = facts or call_facts()
    device = torch.device("cpu")
    store = measure_store.MeasurementStore(measure_store.cache_root(), device)
    key = key_of(facts, device)
    (path,) = store.directory.glob(f"{key.name}-*-{keys}.json")
    assert kernel in path.read_text()
    return path


def _rewrite(path, **changes):
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


def _choose_in_a_new_process(facts=None):
    """The choice as a new process makes it: nothing in memory, the cache directory read."""
    TABLE.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = policy.POLICY.choose(facts or call_facts())
    return choice, [str(w.message) for w in caught if "compile_pass" in str(w.message)]


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"kernel_ms": "fast"}, "kernel_ms is 'fast'"),
        ({"kernel_ms": -1.0}, "kernel_ms is -1.0, not a finite time"),
        ({"sdpa_ms": math.inf}, "sdpa_ms is inf, not a finite time"),
        ({"keys": 300}, "keys is 300, not a bucket's edge"),
        ({"keys": 384}, "not what its name says"),
        ({"kernel": "another kernel"}, "not what its name says"),
        ({"rounds": True}, "rounds is True"),
        ({"refused": 3}, "refused is 3"),
    ],
)
def test_a_damaged_record_is_ignored_measured_again_and_rewritten(changes, why):
    policy.POLICY.choose(call_facts())
    path = _record_file()
    _rewrite(path, **changes)
    choice, said_warnings = _choose_in_a_new_process()
    (warned,) = said_warnings
    assert warned.startswith(f"compile_pass: ignored the cached measurement {path} (") and why in warned
    assert warned.endswith("): measured again")
    assert TABLE.measured == 1 and not measured_of("chunked").cached
    assert "cached" not in said(choice)
    Measured.from_record(json.loads(path.read_text()))  # written anew, and valid
    assert _choose_in_a_new_process()[1] == [] and TABLE.measured == 0  # read back, nothing measured


def test_a_file_that_is_not_json_is_ignored_and_rewritten():
    policy.POLICY.choose(call_facts())
    path = _record_file()
    path.write_text('{"kernel": "chunked", "keys": 2')
    _, said_warnings = _choose_in_a_new_process()
    assert len(said_warnings) == 1 and str(path) in said_warnings[0] and "not JSON" in said_warnings[0]
    assert TABLE.measured == 1


def test_low_memory_is_not_cached_and_is_measured_again_by_the_next_compile(monkeypatch):
    with monkeypatch.context() as low_memory, measure.compiling():
        low_memory.setattr(measure_run, "free_bytes", lambda device: 1 << 16)
        assert not policy.POLICY.choose(call_facts()).fast
    assert not list(
        measure_store.MeasurementStore(measure_store.cache_root(), torch.device("cpu")).directory.glob("*-256.json")
    )
    with measure.compiling():  # a new compile, in the same process: memory is free now
        choice = policy.POLICY.choose(call_facts())
    assert measured_of("chunked").kernel_ms is not None
    assert "not measured: the call's tensors need" not in said(choice)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: "
            "you tried to allocate 4294967296 bytes."
        ),
    ],
)
def test_running_out_of_memory_on_any_device_passes_and_is_not_a_refusal(monkeypatch, error):
    class Starving(Altered):
        def forward(self, call, plan):
            raise error

    starving = Starving("starving")
    choice = policy.KernelPolicy((starving,)).choose(call_facts())
    assert not choice.fast and "out of memory at this length" in choice.reason
    measured = measured_of("starving")
    assert measured.refused is None and not measured.lasting
    assert not list(
        measure_store.MeasurementStore(measure_store.cache_root(), torch.device("cpu")).directory.glob("*.json")
    )


def test_a_refusal_decides_its_own_bucket_only():
    wrong = Altered("wrong", dk_error=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not policy.KernelPolicy((wrong,)).choose(call_facts(keys=2 * KEYS)).fast
    assert [m.keys for _, m in TABLE.entries()] == [2 * KEYS]
    # A kernel refused at 512 keys, and measured winning at 256 in the cache of another run:
    # 256 keys are decided by their own bucket, whatever 512's said.
    TABLE.add(key_of(call_facts(), torch.device("cpu")), Measured("wrong", KEYS, 1, 5, 10.0, 1.0), None)
    assert policy.KernelPolicy((wrong,)).choose(call_facts()).fast


def test_remeasure_clears_every_verdict_of_the_key_it_measures():
    wrong = Altered("chunked", dk_error=0.01)  # under the chunked kernel's name: its files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy.KernelPolicy((wrong,)).choose(call_facts(keys=2 * KEYS))  # a refusal at 512 keys, cached
    refused = _record_file(keys=2 * KEYS)
    with measure.compiling(measure.REMEASURE):
        policy.POLICY.choose(call_facts())  # the real kernel, at 256 keys
    assert not refused.exists()
    TABLE.clear()
    choice = policy.POLICY.choose(call_facts(keys=2 * KEYS))  # measured again, not refused
    (at_512,) = [m for _, m in TABLE.entries() if m.keys == 2 * KEYS]
    assert "differs" not in said(choice) and at_512.kernel_ms is not None and at_512.refused is None


def test_the_fingerprint_follows_the_imports_of_what_a_measurement_runs():
    measured_code = sources.imported_closure({"compile_pass.measure.run"})
    # the kernels' helpers outside their folders, which a list of folders missed
    assert {"compile_pass.window", "compile_pass.sizes", "compile_pass.registration"} <= measured_code
    assert {"compile_pass.kernels.wide_head.forward", "compile_pass.kernels.wide_head.backward"} <= measured_code
    for kernel in policy.KERNELS:
        assert type(kernel).__module__ in measured_code
    assert "compile_pass.rules.sliding_window" not in measured_code  # what decides, not what runs


def test_a_changed_helper_outside_the_kernels_folders_measures_afresh(monkeypatch, tmp_path):
    policy.POLICY.choose(call_facts())
    TABLE.clear()
    window = tmp_path / "window.py"
    window.write_text(sources.modules()["compile_pass.window"].read_text() + "\n# changed\n")
    measure_store.ops_source_hash.cache_clear()
    try:
        with monkeypatch.context() as changed:
            changed.setitem(sources.modules(), "compile_pass.window", window)
            policy.POLICY.choose(call_facts())
    finally:
        measure_store.ops_source_hash.cache_clear()
    assert TABLE.measured == 1 and not measured_of("chunked").cached


def test_budget_spent_leaves_the_call_to_the_static_tables_and_says_so(monkeypatch):
    monkeypatch.setenv(measure.SECONDS_VARIABLE, "0,0")
    choice = policy.POLICY.choose(call_facts())
    assert choice.fast  # the suite's static crossover is 0: the chunked kernel
    assert "not measured (budget spent): decided by the static tables" in choice.name
    assert not choice.measured and TABLE.measured == 0
    slow = chunked.ChunkedKernel()
    assert slow.describe(call_facts()) in choice.name


@pytest.mark.parametrize("seconds", ["nan", "inf", "-1", "1,nan", "x"])
def test_a_budget_that_is_not_a_finite_count_of_seconds_is_a_clear_error(monkeypatch, seconds):
    monkeypatch.setenv(measure.SECONDS_VARIABLE, seconds)
    with pytest.raises(ValueError, match="COMPILE_PASS_MEASURE_SECONDS=.*expected seconds per key"):
        measure.settings_from_environment()


def _attend(q, k, v):
    positions = torch.arange(q.shape[2])
    mask = (positions[None, :] > positions[:, None] - 8) & (positions[None, :] <= positions[:, None])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_under_enable_a_changed_setting_compiles_afresh_from_one_inductor_cache(monkeypatch):
    """Measure mode keeps a short call (too short to measure); the same function compiled
    again with COMPILE_PASS_MEASURE=static (troubleshooting.md's way to see it rewritten) in
    the same inductor cache must run the pass again, not take the graph measure mode made."""
    from torch._inductor.utils import fresh_inductor_cache

    import compile_pass

    q, k, v = torch.randn(3, 1, 2, 32, 8).unbind(0)
    verdicts = []
    with fresh_inductor_cache():
        for mode in ("measure", "static"):
            monkeypatch.setenv(measure.MODE_VARIABLE, mode)
            torch._dynamo.reset()
            with compile_pass.enable(), compile_pass.decisions() as report:
                torch.compile(_attend)(q, k, v)
            verdicts.append([d.rewritten for d in report])
    assert verdicts == [[False], [True]]
