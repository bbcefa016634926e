"""A bounded run of the adversarial differential fuzzer (tests/helpers/fuzz_masks.py): every program
compiled through compile_pass must match eager at three sequence lengths, forward and, for a
third of them, the gradient, and no rule may raise. The long run (10,000+ programs) is
``python benchmarks/fuzz_soundness.py``."""

import functools

import pytest

from tests.helpers import fuzz_masks

# Fixed seeds, so a failure here reproduces with `benchmarks/fuzz_soundness.py --show SEED`.
# Beyond the first 70, programs whose soft-capped scores (569), logsumexp-scaled sinks (722) and
# sinks per row (1964) are rewritten: the grammar draws those forms in few of the first seeds
# (1253's sinks per row came with window (-1, -1), which no measured crossover covers: kept);
# and the second round's: Gemma-3's two-sided window spelled with abs OR its causal band (145),
# key padding read from a buffer filled in place (387), and a chain over packed positions that
# the op checks at run time, its fallback the chain itself (362).
NEW_FORMS = {
    "softcap": 569,
    "lse_sinks": 722,
    "row_sinks": 1964,
    "two_sided": 145,
    "filled_buffer": 387,
    "spelled_packed": 362,
}
SEEDS = [*range(70), *NEW_FORMS.values()]


@functools.cache
def _outcome(seed: int) -> fuzz_masks.Outcome:
    return fuzz_masks.check(seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_program_matches_eager(seed):
    outcome = _outcome(seed)
    assert not outcome.failed, f"{outcome.status}\n{fuzz_masks.generate(seed)}\n{outcome.decisions}\n{outcome.detail}"


def test_the_fuzzer_reaches_every_rule():
    """The grammar must make each rule rewrite and keep: a fuzzer that never reaches a
    rewrite cannot find a false one. (Reuses the outcomes above when they ran first.)"""
    outcomes = [_outcome(seed) for seed in SEEDS]
    reached = {(rule, rewritten) for outcome in outcomes for rule, rewritten, _ in outcome.decisions}
    for rule in ("sliding_window", "topk_mask", "spelled_attention"):
        assert (rule, True) in reached and (rule, False) in reached, (rule, sorted(reached))
    assert ("mask_input", True) in reached, sorted(reached)
    additive = [
        verdict for o in outcomes for _, rewritten, verdict in o.decisions if rewritten and "additive" in verdict
    ]
    assert additive, "no additive mask was rewritten"
    for form, seed in NEW_FORMS.items():
        assert form in fuzz_masks.generate(seed).splitlines()[0].split(), form
        assert any(rewritten for _, rewritten, _ in _outcome(seed).decisions), form


@pytest.fixture
def measuring_afresh(monkeypatch, tmp_path):
    """The default mode, as users run it: measured on this machine, a fresh cache, short budgets."""
    from compile_pass import measure
    from compile_pass.measure.table import TABLE

    monkeypatch.setenv("COMPILE_PASS_MEASURE", "measure")
    monkeypatch.setenv("COMPILE_PASS_MEASURE_SECONDS", "0.05,0.3")
    monkeypatch.setenv("COMPILE_PASS_CACHE_DIR", str(tmp_path))
    TABLE.clear()
    yield measure
    TABLE.clear()


# Programs whose calls this mode measures (a fresh cache each): the measurement chooses, and the
# results must still be eager's whatever it chose.
MEASURED_SEEDS = [0, 39, 45, 50]


@pytest.mark.parametrize("seed", MEASURED_SEEDS)
def test_a_program_decided_by_measuring_matches_eager(measuring_afresh, seed):
    from compile_pass.measure.table import TABLE

    outcome = fuzz_masks.check(seed, lengths=fuzz_masks.MEASURED_LENGTHS)
    assert not outcome.failed, f"{outcome.status}\n{fuzz_masks.generate(seed)}\n{outcome.decisions}\n{outcome.detail}"
    assert TABLE.measured >= 1  # decided by a measurement, not by the static tables
