"""Kernel choice measured on the device (compile_pass/measure/__init__.py): the chooser follows what it
measured, checks each kernel against SDPA first, passes over kernels that fail, keeps SDPA where
memory is short, caches what it measured (atomically, across processes, per environment), and
agrees across ranks. No test asserts a timing value: the measured numbers decide, and each test
checks that the choice follows them."""

from __future__ import annotations

import multiprocessing
import time
import warnings

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from compile_pass import measure
from compile_pass.kernels import chunked, documents, policy
from compile_pass.kernels import contract as kernel
from compile_pass.kernels.contract import CallFacts
from compile_pass.measure import run as measure_run
from compile_pass.measure import store as measure_store
from compile_pass.measure.table import TABLE, Measured, bucket, next_edge, previous_edge, table_text

KEYS = 256  # a bucket's edge: measured at exactly this length


def call_facts(keys=KEYS, **changes) -> CallFacts:
    facts = CallFacts(
        torch.device("cpu"),
        torch.float32,
        32,
        True,
        keys=keys,
        left=15,
        right=0,
        batch=1,
        heads=2,
        kv_heads=1,
        queries=keys,
    )
    return facts._replace(**changes)


class Altered:
    """The chunked kernel changed on purpose: slowed, wrong by a share of dK, or failing in
    ``plan`` or ``forward``. Its static answer is "fast", so only a measurement keeps it out."""

    def __init__(self, name: str, *, delay: float = 0.0, dk_error: float = 0.0, fails_in: str | None = None):
        self.name, self.delay, self.dk_error, self.fails_in = name, delay, dk_error, fails_in
        self.inner = chunked.ChunkedKernel()

    def describe(self, facts):
        return self.name

    def cannot(self, facts):
        return None

    def slower(self, facts):
        return None

    def plan(self, call):
        if self.fails_in == "plan":
            raise RuntimeError("planned to fail")
        return self.inner.plan(call)

    def forward(self, call, plan):
        if self.fails_in == "forward":
            raise ValueError("launch failed")
        if self.fails_in == "memory":
            raise torch.OutOfMemoryError("simulated: no memory left for this kernel")
        time.sleep(self.delay)
        return self.inner.forward(call, plan)

    def backward(self, call, plan, grad_out, out, logsumexp):
        dq, dk, dv = self.inner.backward(call, plan, grad_out, out, logsumexp)
        return dq, dk * (1 + self.dk_error), dv


def said(choice: policy.KernelChoice) -> str:
    """Everything a choice says: what runs, and why each kernel before it was passed over."""
    return "; ".join([choice.name, *choice.passed_over])


def measured_of(kernel: str, facts: CallFacts | None = None) -> Measured:
    """The one measurement of ``kernel`` in the table (at the facts' bucket, where given)."""
    (measured,) = [m for _, m in TABLE.entries() if m.kernel == kernel]
    assert facts is None or measured.keys == bucket(facts.keys)
    return measured


# -- the chooser follows measurements ---------------------------------------------------------


def test_with_real_timings_the_choice_is_what_was_measured():
    facts = call_facts()
    choice = policy.POLICY.choose(facts)
    measured = measured_of("chunked", facts)
    assert measured.sdpa_ms > 0 and measured.kernel_ms > 0 and measured.rounds >= 1
    assert choice.fast == measured.wins
    words = measured.words()
    assert words.startswith("measured on this device: ") and f"at {KEYS} keys" in words
    if choice.fast:
        assert isinstance(choice.kernel, chunked.ChunkedKernel) and words in choice.name
    else:
        assert f"chunked: {words}" in choice.reason


def test_a_kernel_slowed_on_purpose_is_not_chosen():
    slowed = Altered("slowed", delay=0.25)  # far more than SDPA's call of a millisecond or two
    choice = policy.KernelPolicy((slowed, chunked.ChunkedKernel())).choose(call_facts())
    measured = measured_of("slowed", call_facts())
    assert measured.kernel_ms is not None and not measured.wins
    assert choice.kernel is not slowed
    assert "slowed: measured on this device" in said(choice)
    # Chosen without the measurement: its static answer is "fast".
    with measure.compiling(measure.STATIC):
        assert policy.KernelPolicy((slowed,)).choose(call_facts()).kernel is slowed


def test_a_kernel_wrong_by_one_percent_of_dk_is_never_chosen_and_warned_of():
    wrong = Altered("wrong", dk_error=0.01)
    with pytest.warns(UserWarning, match=r"wrong: not used for such calls on this device at 256 keys: differs on th"):
        choice = policy.KernelPolicy((wrong,)).choose(call_facts())
    assert not choice.fast and "wrong: differs on this device: dK differs from SDPA's" in choice.reason
    assert measured_of("wrong").kernel_ms is None  # never timed
    # Refused for its bucket: another length is checked for itself (and refused again).
    assert not policy.KernelPolicy((wrong,)).choose(call_facts(keys=4 * KEYS)).fast
    assert TABLE.measured == 2


@pytest.mark.parametrize("fails_in", ["plan", "forward"])
def test_a_kernel_that_fails_is_passed_over(fails_in):
    failing = Altered("failing", fails_in=fails_in)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = policy.KernelPolicy((failing, chunked.ChunkedKernel())).choose(call_facts())
    error = "RuntimeError: planned to fail" if fails_in == "plan" else "ValueError: launch failed"
    assert f"failing: failed on this device: {error}" in said(choice)
    assert [str(w.message) for w in caught if "failing" in str(w.message)] == [
        f"compile_pass: failing: not used for such calls on this device at {KEYS} keys: failed on this device: {error}"
    ]
    assert choice.kernel is not failing  # the chunked kernel, measured after it, decides for itself
    assert measured_of("chunked").kernel_ms is not None


# -- memory -----------------------------------------------------------------------------------


def test_shapes_that_do_not_fit_are_not_measured_and_keep_sdpa(monkeypatch):
    monkeypatch.setattr(measure_run, "free_bytes", lambda device: 1 << 16)
    choice = policy.POLICY.choose(call_facts())
    assert not choice.fast
    assert "not measured: the call's tensors need about" in choice.reason and "free on cpu" in choice.reason
    measured = measured_of("chunked", call_facts())
    assert measured.why_not and measured.sdpa_ms is None and measured.kernel_ms is None


def test_out_of_memory_while_measuring_passes_the_kernel_over():
    starving = Altered("starving", fails_in="memory")
    choice = policy.KernelPolicy((starving,)).choose(call_facts())
    assert not choice.fast
    assert "starving: not measured on this device: out of memory at this length" in choice.reason
    # Not refused for the key: a shorter length may fit.
    assert measured_of("starving").refused is None


# -- the cache --------------------------------------------------------------------------------


def test_a_second_run_measures_nothing_and_reads_what_the_first_wrote():
    first = policy.POLICY.choose(call_facts())
    assert TABLE.measured == 1
    TABLE.clear()  # a new process: only the cache directory remembers
    second = policy.POLICY.choose(call_facts())
    assert TABLE.measured == 0
    assert measured_of("chunked").cached and "cached" in said(second)
    assert first.fast == second.fast


def test_remeasure_ignores_the_cache():
    policy.POLICY.choose(call_facts())
    TABLE.clear()
    with measure.compiling(measure.REMEASURE):
        policy.POLICY.choose(call_facts())
    assert TABLE.measured == 1 and not measured_of("chunked").cached


def test_static_measures_nothing():
    with measure.compiling(measure.STATIC):
        choice = policy.POLICY.choose(call_facts())
    assert choice.fast and choice.name == chunked.ChunkedKernel().describe(call_facts())  # the suite's crossover: 0
    assert TABLE.measured == 0 and not TABLE.entries()


def test_another_version_measures_afresh(monkeypatch):
    policy.POLICY.choose(call_facts())
    TABLE.clear()
    monkeypatch.setattr(measure_store, "ops_source_hash", lambda: "a changed kernel")
    policy.POLICY.choose(call_facts())
    assert TABLE.measured == 1 and not measured_of("chunked").cached


def _write_entries(directory: str, worker: int, count: int) -> None:
    import os

    os.environ[measure_store.CACHE_DIR_VARIABLE] = directory
    store = measure_store.MeasurementStore(measure_store.cache_root(), torch.device("cpu"))
    for index in range(count):
        store.save(
            f"key{index % 5}", f"kernel-{1000 * worker + index}", {"worker": worker, "index": index, "pad": "x" * 4000}
        )


def test_processes_writing_at_once_lose_no_entry(tmp_path):
    directory = str(tmp_path / "shared")
    context = multiprocessing.get_context("fork")  # the writers need nothing torch set up
    workers = [context.Process(target=_write_entries, args=(directory, worker, 40)) for worker in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    store = measure_store.MeasurementStore(tmp_path / "shared", torch.device("cpu"))
    records = [record for key in range(5) for _, record in store.load(f"key{key}", "kernel")]
    assert sorted((r["worker"], r["index"]) for r in records) == [(w, i) for w in range(2) for i in range(40)]
    assert not list((tmp_path / "shared").rglob("*.tmp"))


# -- lengths: buckets, and the guards of a symbolic length -----------------------------------


def test_buckets():
    assert [bucket(n) for n in (63, 64, 95, 96, 127, 128, 8191, 8192, 12288)] == [
        None,
        64,
        64,
        96,
        96,
        128,
        6144,
        8192,
        12288,
    ]
    assert next_edge(8192) == 12288 and previous_edge(8192) == 6144 and previous_edge(64) is None


def _measured(keys: int, kernel_ms: float, sdpa_ms: float = 10.0) -> Measured:
    return Measured("k", keys, 1, 3, sdpa_ms, kernel_ms)


def test_a_length_is_decided_by_its_bucket_else_the_longest_win_below():
    buckets = {256: _measured(256, 11.0), 384: _measured(384, 9.0), 768: _measured(768, 10.0)}
    covering = measure._covering
    assert covering(buckets, 300) is buckets[256]  # its own bucket: a loss
    assert covering(buckets, 500) is buckets[384]  # none of its own: the win below
    assert covering(buckets, 800) is buckets[768]  # its own: a loss within the margin
    assert covering(buckets, 2000) is None  # the longest below lost: measure its own
    assert covering(buckets, 100) is None


def test_a_symbolic_length_is_guarded_to_where_its_answer_holds():
    def symbolic(hint: int):
        env = ShapeEnv()
        source = ConstantSource("keys")
        symbol = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        return env, env.create_symintnode(symbol, hint=hint, source=source)

    env, size = symbolic(1000)
    buckets = {512: _measured(512, 11.0), 768: _measured(768, 9.0), 1024: _measured(1024, 8.0)}
    answer = measure._answer(buckets, 1000, size)
    assert answer.slower is None and not env.guards  # 1000 keys: the 768 bucket's win; guarded when read
    answer.guard()
    assert any("768 <= " in str(guard.expr) or ">= 768" in str(guard.expr) for guard in env.guards), env.guards
    assert not any("1536" in str(guard.expr) for guard in env.guards)  # nothing lost above: no upper bound
    env, size = symbolic(1000)
    noisy = {**buckets, 1536: _measured(1536, 12.0)}  # a loss measured above the win
    measure._answer(noisy, 1000, size).guard()
    assert any("1536" in str(guard.expr) for guard in env.guards), env.guards
    env2, size2 = symbolic(600)
    losing = {512: _measured(512, 11.0), 1024: _measured(1024, 8.0)}
    answer = measure._answer(losing, 600, size2)
    assert answer.slower is not None
    answer.guard()
    assert any("1024" in str(guard.expr) for guard in env2.guards), env2.guards


# -- through a compile, and the report ----------------------------------------------------------


def test_a_compile_measures_once_per_call_key_and_the_report_says_what_it_measured():
    import torch.nn.functional as F

    import compile_pass

    def attention(q, k, v):
        seq = q.shape[2]
        positions = torch.arange(seq)
        distance = positions[None, :] - positions[:, None]
        band = ((distance <= 0) & (distance > -16))[None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band)

    q, k, v = (torch.randn(1, 2, 384, 32, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    with compile_pass.decisions() as report:
        out = torch.compile(attention, backend="compile_pass", fullgraph=True)(q, k, v)
    out.sum().backward()
    (decision,) = report
    measured = measured_of("chunked", call_facts(keys=384))
    words = measured.words()
    assert TABLE.measured == 1
    if decision.rewritten:
        assert words in decision.kernel
    else:
        assert words in decision.full_verdict
    torch._dynamo.reset()
    torch.compile(attention, backend="compile_pass", fullgraph=True)(q, k, v)
    assert TABLE.measured == 1  # the same key: nothing measured again


# -- as on sm90: the wide-head Triton kernel, interpreted on the CPU ---------------------------


@pytest.mark.slow
def test_as_on_sm90_the_wide_head_kernel_is_measured_against_sdpa_and_routed_by_the_table(monkeypatch):
    """Gemma-4's global layer (head_dim 512) as if on an sm90 GPU: nothing this project measured
    covers the wide-head kernel, so it is checked against SDPA and timed (here in Triton's
    interpreter, on CPU tensors: ``measuring_on``), and the choice is what the table says; the
    question asked again is answered from the table, measuring nothing."""
    from compile_pass.kernels import wide_head
    from compile_pass.window import UNBOUNDED
    from tests.helpers.small_graphs import pretend_gpu

    pretend_gpu(monkeypatch, (9, 0))
    facts = call_facts(
        keys=64, head_dim=512, heads=1, kv_heads=1, left=UNBOUNDED, device=torch.device("cuda"), sdpa_unmasked=True
    )
    with measure.measuring_on("cpu", seconds_per_key=0.1):
        choice = policy.POLICY.choose(facts)
        measured = measured_of(wide_head.NAME, call_facts(keys=64))
        assert measured.kernel_ms is not None and measured.refused is None  # checked against SDPA, then timed
        assert choice.fast == measured.wins
        assert measured.words() in said(choice)
        again = policy.POLICY.choose(facts)
    assert (again.fast, again.name, TABLE.measured) == (choice.fast, choice.name, 1)


def test_tune_measures_a_models_calls_ahead_and_prints_them(tmp_path, capsys):
    """``python -m compile_pass tune``: a config traced on the meta device, each call's kernels
    measured on the CPU and cached; the table, then the decisions they give."""
    from transformers import MistralConfig

    from compile_pass.inspect import main

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=32,
    )
    config.save_pretrained(tmp_path / "model")
    assert main(["tune", str(tmp_path / "model"), "--seq", "128", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    ((key, measured),) = TABLE.entries()  # two layers, one key
    assert (key.head_dim, key.heads, key.kv_heads, key.left, key.right, measured.keys) == (16, 2, 1, 31, 0, 128)
    assert "measured on " in printed and table_text([(key, measured)]) in printed
    summary = "2 of 2 attention calls rewritten" if measured.wins else "0 of 2 attention calls rewritten"
    assert summary in printed and measured.words() in printed
    TABLE.clear()
    assert main(["tune", str(tmp_path / "model"), "--seq", "128", "--device", "cpu"]) == 0
    assert TABLE.measured == 0 and "| cached |" in capsys.readouterr().out
    # --again (a new process) measures again, the cache ignored: the compile inside keeps tune's mode.
    TABLE.clear()
    assert main(["tune", str(tmp_path / "model"), "--seq", "128", "--device", "cpu", "--again"]) == 0
    assert TABLE.measured == 1


def test_a_compile_inside_tune_keeps_its_mode_and_budget():
    """The rewrite opens a compile's session (``measure.compiling``); inside ``tune``'s it
    keeps tune's mode and seconds, where an option of the compile does not set the mode."""
    with measure.measuring_on("cpu", measure.REMEASURE, 30.0):
        with measure.compiling():
            settings = measure._session().settings
            assert (settings.mode, settings.seconds_per_key) == (measure.REMEASURE, 30.0)
        with measure.compiling(measure.STATIC):
            assert measure._session().settings.mode == measure.STATIC


def test_a_call_too_short_to_measure_keeps_sdpa(monkeypatch):
    """Whatever COMPILE_PASS_SHORT_KEYS says (the suite's 0 here): it sets the static tables'
    crossover, and the reason says so, for a user who set it and sees the call kept."""
    choice = policy.POLICY.choose(call_facts(keys=48))
    assert not choice.fast and "its 48 keys are fewer than 64: SDPA stays" in choice.reason
    assert "COMPILE_PASS_SHORT_KEYS=0 sets the crossover of measure='static'" in choice.reason
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)
    choice = policy.POLICY.choose(call_facts(keys=40))
    assert not choice.fast and "COMPILE_PASS_SHORT_KEYS" not in choice.reason
    assert TABLE.measured == 0


def test_settings_that_cannot_be_read_raise_before_anything_is_rewritten(monkeypatch):
    import compile_pass

    graph = torch.fx.symbolic_trace(torch.nn.Identity())
    monkeypatch.setenv(measure.MODE_VARIABLE, "sometimes")
    with pytest.raises(
        ValueError, match="COMPILE_PASS_MEASURE='sometimes': expected one of measure, static, remeasure"
    ):
        compile_pass.rewrite(graph)
    monkeypatch.setenv(measure.MODE_VARIABLE, "static")
    monkeypatch.setenv(measure.SECONDS_VARIABLE, "2,x")
    with pytest.raises(ValueError, match="COMPILE_PASS_MEASURE_SECONDS='2,x'"):
        compile_pass.rewrite(graph)
    monkeypatch.setenv(measure.SECONDS_VARIABLE, "2")
    assert measure.settings_from_environment() == measure.Settings("static", 2.0, measure.SECONDS_PER_COMPILE)
    with pytest.raises(ValueError, match="setting 'measure' takes one of 'measure', 'static', 'remeasure'"):
        compile_pass.rewrite(graph, measure="always")


def test_the_op_called_directly_measures_at_run_time_inside_its_kernel():
    """A direct call of the op (no compile): its route measures below autograd, where SDPA's
    backward needs autograd recorded again; the result is the reference's."""
    import compile_pass
    from tests.helpers.attention_reference import reference_attention

    q, k, v = (torch.randn(1, 2, KEYS, 32, dtype=torch.float32, requires_grad=True) for _ in range(3))
    out = compile_pass.sliding_window_attention(q, k, v, window=(15, 0))
    out.sum().backward()
    assert TABLE.measured == 1
    reference = reference_attention(*(x.double() for x in (q, k, v)), 15, 0, 32**-0.5)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


def test_a_kernel_that_would_run_what_sdpa_runs_is_not_measured():
    """A causal call with no window and no batch masks, which SDPA computes as is_causal: the
    chunked kernel would run one causal run of the kernel SDPA's is_causal runs itself, so no
    measurement is made for it. A padded one is measured (the document kernel first)."""
    from compile_pass.window import UNBOUNDED

    choice = policy.POLICY.choose(call_facts(left=UNBOUNDED, sdpa_unmasked=True))
    assert not choice.fast and "chunked: SDPA computes such a call without its mask" in choice.reason
    assert "nothing left to skip" in choice.reason
    assert TABLE.measured == 0
    padded = policy.POLICY.choose(call_facts(left=UNBOUNDED, key_padding=True))
    assert measured_of(documents.NAME).words() in said(padded)  # the document kernel, measured
    assert TABLE.measured >= 1


@pytest.mark.parametrize("beyond_sdpa", ["spelled", "softcap"])
def test_a_call_sdpa_alone_does_not_compute_is_not_passed_over_as_sdpa(beyond_sdpa):
    """Attention spelled out in ops (with or without sinks) or soft-capped scores: what the op
    replaces is a chain of ops, not an SDPA call, so the chunked kernel's whole-call run is not
    "what SDPA runs" for it. On the CPU such calls keep the crossovers measured against the
    compiled chain, which cannot be compiled and timed inside the compile that asks."""
    from compile_pass.window import UNBOUNDED

    choice = policy.POLICY.choose(call_facts(left=UNBOUNDED, sdpa_unmasked=True, **{beyond_sdpa: True}))
    assert "nothing left to skip" not in said(choice)
    assert choice.kernel is not None and "not measured: " in choice.name
    assert TABLE.measured == 0


def test_a_soft_capped_compile_on_the_cpu_keeps_the_static_crossover_and_compiles():
    """On the CPU what a spelled-out, soft-capped call's op replaces is the chain inductor compiles, which
    cannot be timed inside the compile that asks (it failed in inductor's own bookkeeping when
    it was): such calls keep the crossover this project measured against the compiled chain,
    the report says so, and the compile completes."""
    import compile_pass

    def capped(q, k, v):  # Gemma-2's eager attention, causal, no window
        scores = torch.tanh(q @ k.transpose(-1, -2) * 0.25 / 50.0) * 50.0
        keys = torch.arange(q.shape[2])
        hidden = keys[None, :] > keys[:, None]
        scores = scores + torch.zeros(hidden.shape, dtype=q.dtype).masked_fill(hidden, torch.finfo(q.dtype).min)
        return torch.softmax(scores, dim=-1) @ v

    q, k, v = (torch.randn(1, 4, 512, 16, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    with compile_pass.decisions() as report:
        out = torch.compile(capped, backend="compile_pass", fullgraph=True)(q, k, v)
    out.sum().backward()
    (decision,) = report
    assert TABLE.measured == 0
    assert "not measured: attention spelled out in ops on the CPU keeps the crossovers" in decision.kernel
    reference = capped(*(x.double() for x in (q, k, v)))
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


def test_a_soft_capped_call_is_timed_against_sdpa_without_the_cap():
    """Off the CPU (here measured directly, outside a compile) SDPA without the cap stands for
    the chain it would replace, which scores what SDPA scores and more; the table says so."""
    shape = measure_run.Shape(torch.device("cpu"), torch.float32, 1, 2, 1, 256, 32, None, 15, 0, softcap=True)
    outcome = measure_run.measure(shape, chunked.ChunkedKernel(), 1.0, 2)
    assert outcome.replaced == "SDPA without the cap" and outcome.sdpa_ms is not None
    assert "SDPA without the cap" in Measured.of("chunked", 256, 1, outcome).words()
    wrong = measure_run.measure(shape, Altered("wrong", dk_error=0.01), 1.0, 2)
    assert wrong.refused is not None and "differs" in wrong.refused


def test_records_cached_before_what_was_replaced_was_kept_are_read_as_sdpa():
    record = Measured("chunked", 256, 1, 3, 2.0, 1.0).record()
    del record["replaced"]
    assert Measured.from_record(record).replaced == "SDPA"


class SlowOnDocuments:
    """The document kernel, recording the plans it is given, and slowed where a row holds several
    documents or padding (a call per document or row): as the document kernel's fixed cost per
    call shows on rows of many short documents, but not where every row is one document."""

    name = "slowed documents"

    def __init__(self):
        self.planned: set[str] = set()

    def describe(self, facts):
        return self.name

    def cannot(self, facts):
        return documents.DOCUMENTS.cannot(facts)

    def slower(self, facts):
        return None

    def plan(self, call):
        plan = documents.DOCUMENTS.plan(call)
        self.planned.add("one call" if plan.whole else "a call per document")
        return plan

    def forward(self, call, plan):
        if not plan.whole:
            time.sleep(0.25)
        return documents.DOCUMENTS.forward(call, plan)

    def backward(self, call, plan, grad_out, out, logsumexp):
        return documents.DOCUMENTS.backward(call, plan, grad_out, out, logsumexp)


@pytest.mark.parametrize("form", ["key_padding", "segment_ids"])
def test_padded_and_packed_calls_are_measured_where_rows_hold_several_documents_too(form):
    """Every key valid and one document a row is the layout a kernel skips least in, yet the
    document kernel runs one call over the batch there and a call per document elsewhere. Such
    calls are measured in a second layout too (tails padded, or short documents), each against
    SDPA on the same masks, and the worse decides: a kernel slow on documents is not chosen."""
    from compile_pass.window import UNBOUNDED

    slowed = SlowOnDocuments()
    choice = policy.KernelPolicy((slowed,)).choose(call_facts(left=UNBOUNDED, **{form: True}))
    assert slowed.planned == {"one call", "a call per document"}  # both layouts checked and timed
    measured = measured_of(slowed.name)
    assert measured.kernel_ms is not None and measured.kernel_ms > 250 and not measured.wins
    assert not choice.fast and f"{slowed.name}: {measured.words()}" in choice.reason


@pytest.mark.parametrize(("left", "padded"), [(15, 15), (127, 32), (-1, 32)])
def test_the_second_layout_pads_a_rows_tail_no_longer_than_the_window_sees(left, padded):
    """The second layout pads no more of a row's tail than the window's left side, so every row
    still sees a valid key (a row that sees none is NaN on some of SDPA's backends); and the
    chunked kernel, measured there too, matches SDPA."""
    shape = measure_run.Shape(torch.device("cpu"), torch.float32, 2, 2, 1, KEYS, 32, None, left, 0, key_padding=True)
    split = measure_run._Inputs(shape, KEYS).split(shape, KEYS)
    assert split is not None and split.mask is not None
    assert (~split.key_padding).sum(dim=1).tolist() == [padded, padded]
    assert split.mask.any(dim=-1).all()  # every row sees a key
    policy.POLICY.choose(call_facts(key_padding=True, left=left))
    measured = measured_of("documents" if left == -1 else "chunked")
    assert measured.refused is None and measured.kernel_ms is not None


def test_a_kernel_is_timed_through_the_op_as_the_rewritten_graph_calls_it(monkeypatch):
    """What the rewrite replaces SDPA with is the op: its checks, layouts and autograd count
    with the kernel's work (at 64 keys they were a tenth of the call, and a kernel timed alone
    won where the op lost). Work put into the op's own entry shows in the kernel's time."""
    from compile_pass.ops import window_attention

    checked = window_attention.check_softcap

    def slow_check(softcap):
        time.sleep(0.05)
        return checked(softcap)

    monkeypatch.setattr(window_attention, "check_softcap", slow_check)
    policy.POLICY.choose(call_facts())
    measured = measured_of("chunked", call_facts())
    assert measured.kernel_ms is not None and measured.kernel_ms >= 50.0
    assert not measured.wins


# -- evaluation: calls traced under no_grad ------------------------------------------------------


def test_a_no_grad_call_is_measured_forward_alone_under_its_own_key():
    training = policy.POLICY.choose(call_facts())
    evaluating = policy.POLICY.choose(call_facts(grad=False))
    keys = {key.backward: key for key, _ in TABLE.entries()}
    assert set(keys) == {True, False} and TABLE.measured == 2  # one measurement each
    assert keys[True].name != keys[False].name
    assert "the forward alone (a no_grad call)" in said(evaluating)
    assert "the forward alone" not in said(training)


def test_a_graph_traced_under_no_grad_asks_for_its_forward_alone():
    import torch.nn.functional as F

    import compile_pass

    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 16)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(1, 2, KEYS, 32, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    with torch.no_grad(), compile_pass.decisions() as report:
        out = torch.compile(attend, backend="compile_pass")(q, k, v)
    torch.testing.assert_close(out, attend(q, k, v).detach(), atol=1e-5, rtol=1e-5)
    assert [key.backward for key, _ in TABLE.entries()] == [False]
    (decision,) = list(report)
    assert "the forward alone (a no_grad call)" in decision.kernel + decision.reason
