"""A bounded run of the adversarial differential fuzzer (tests/helpers/fuzz_masks.py): every program
compiled through compile_pass must match eager at three sequence lengths, forward and, for a
third of them, the gradient, and no rule may raise. The long run (10,000+ programs) is
``python benchmarks/fuzz_soundness.py``."""

import functools

import pytest

from tests.helpers import fuzz_masks

# Fixed seeds, so a failure here reproduces with `benchmarks/fuzz_soundness.py --show SEED`.
# Beyond the first 70, programs whose soft-capped scores (569), logsumexp-scaled sinks (470) and
# sinks per row (1964) are rewritten: the grammar draws those forms in few of the first seeds
# (1253's sinks per row came with window (-1, -1), which no measured crossover covers: kept).
NEW_FORMS = {"softcap": 569, "lse_sinks": 470, "row_sinks": 1964}
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
