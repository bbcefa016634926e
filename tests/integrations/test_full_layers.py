"""Full-attention layers over packed documents and padded rows: the masks transformers builds
for ``position_ids`` that restart (TRL's ``packing=True`` / ``padding_free=True``) or with an
``attention_mask``, in Llama, Qwen3 and BERT tiny configs (Gemma-4's in test_packed.py and
test_padded_batches.py), go to the op, whose document kernel computes each document apart.
Loss and every gradient against eager fp32 and fp64; what runs when the batch turns out
unpacked at run time; and the calls still kept, each with its reason."""

import pytest
import torch
import transformers
from torch.profiler import profile

from benchmarks import packed_training
from compile_pass.kernels import contract as kernel
from compile_pass.kernels import documents
from tests.helpers.models import Capture, assert_close_scaled, assert_training_matches, token_batch
from tests.helpers.small_graphs import (
    ask_as_if_on_cuda,
    assert_same_as_eager,
    compiled_with_capture,
    mask_input_paths,
    qkv,
)

PACKED = "rewritten: window (-1, 0), packed sequences from position_ids (positions checked at run time)"
PADDED = "rewritten: window (-1, 0), key padding from attention_mask"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _positions(*lengths):
    return torch.cat([torch.arange(length) for length in lengths])


def _verdicts(capture):
    return [d.verdict for report in capture.reports for d in report if d.kind == "attention call"]


def _flash_forward_calls(fn) -> int:
    with profile() as trace:
        fn()
    return sum(event.name == "aten::_scaled_dot_product_flash_attention_for_cpu" for event in trace.events())


def test_the_issues_example_rewrites_both_layers(monkeypatch):
    """A tiny Llama in fp32, 1,024 tokens packed from documents of 300, 500 and 224, as the
    issue tried it: both layers kept SDPA. With the measured crossovers (not the suite's
    setting of none), both go to the document kernel, one call per document each way."""
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)
    model = packed_training.model("Llama")
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    ids = token_batch(1024, batch=1)
    inputs = dict(input_ids=ids, position_ids=_positions(300, 500, 224)[None], labels=ids, use_cache=False)
    with mask_input_paths() as paths:
        assert_training_matches(model, compiled, **inputs)
    assert _verdicts(capture) == [PACKED] * 2
    assert all(d.kernel.startswith("documents") for d in capture.report)
    assert paths == {"band": 2}
    assert _flash_forward_calls(lambda: compiled(**inputs)) == 2 * 3


@pytest.mark.parametrize("name", ["Llama", pytest.param("Qwen3", marks=pytest.mark.slow)])
def test_packed_rows_train_as_eager(name, monkeypatch):
    """Two rows of documents (12 + 20, and 5 + 19 + 8 tokens): the full layers on the document
    kernel (a call for each document up to 8 tokens together: some alone, some grouped);
    Qwen3's sliding layer on the chunked kernel."""
    monkeypatch.setattr(documents, "GROUP_TOKENS", 8)
    model = packed_training.model(name)
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(32)
    positions = torch.stack([_positions(12, 20), _positions(5, 19, 8)])
    with mask_input_paths() as paths:
        assert_training_matches(model, compiled, input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    full = [d for d in capture.report if d.reason.startswith("window (-1, 0)")]
    assert len(full) == (2 if name == "Llama" else 1) and all(d.verdict == PACKED for d in full)
    assert all(d.rewritten for d in capture.report)
    assert paths == {"band": 2}


@pytest.mark.parametrize("name", [pytest.param("Llama", marks=pytest.mark.slow), "Qwen3"])
def test_padded_rows_train_as_eager(name):
    """Left padding, right padding, and a row of padding alone: every layer on the op, eager's
    result at every position."""
    model = packed_training.model(name)
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(24, batch=3)
    padding = torch.ones(3, 24, dtype=torch.long)
    padding[0, :5] = 0
    padding[1, 17:] = 0
    padding[2] = 0
    labels = ids.masked_fill(padding == 0, -100)
    assert_training_matches(model, compiled, input_ids=ids, attention_mask=padding, labels=labels, use_cache=False)
    full = [d.verdict for d in capture.report if d.reason.startswith("window (-1, 0)")]
    assert full == [PADDED] * (2 if name == "Llama" else 1)
    assert all(d.rewritten for d in capture.report)
    inputs = dict(input_ids=ids, attention_mask=padding, use_cache=False)
    assert_close_scaled(compiled(**inputs).logits, model(**inputs).logits, "logits at every position")


def test_a_batch_that_turns_out_unpacked_runs_one_causal_call_a_layer(monkeypatch):
    """The graph compiled for packed rows, given rows of one document each (positions 0..S-1):
    the same graph, the band path, and the document kernel's one fused causal call over the
    batch per layer, the call SDPA's ``is_causal`` makes; a padded graph given no padding
    likewise."""
    monkeypatch.setattr(documents, "GROUP_TOKENS", 0)  # packed: a call per document
    model = packed_training.model("Llama")
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(32)
    packed = dict(input_ids=ids, position_ids=torch.stack([_positions(12, 20), _positions(5, 19, 8)]), use_cache=False)
    unpacked = dict(packed, position_ids=torch.arange(32).repeat(2, 1))
    with torch.no_grad():
        compiled(**packed)  # compiles
        assert _flash_forward_calls(lambda: compiled(**packed)) == 2 * 5  # a call per document, each layer
        assert _flash_forward_calls(lambda: compiled(**unpacked)) == 2
        with mask_input_paths() as paths:
            compiled(**unpacked)
    assert paths == {"band": 2} and len(capture.graphs) == 1
    assert_training_matches(model, compiled, **unpacked, labels=ids)

    torch._dynamo.reset()
    padded = Capture()
    compiled = torch.compile(model, backend=padded, fullgraph=True)
    no_padding = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    with torch.no_grad():
        compiled(**no_padding)  # compiles
        assert _flash_forward_calls(lambda: compiled(**no_padding)) == 2
    assert _verdicts(padded) == [PADDED] * 2


def test_bidirectional_padded_encoder_layers_train_as_eager():
    """BERT's padded mask is the window (-1, -1) with key padding: each row one call over its
    valid keys, padded rows included."""
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM._from_config(config, attn_implementation="sdpa")
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(24)
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[0, 18:] = 0
    padding[1, :3] = 0
    assert_training_matches(model, compiled, input_ids=ids, attention_mask=padding, labels=ids)
    assert _verdicts(capture) == ["rewritten: window (-1, -1), key padding from attention_mask"] * 2
    assert all(d.kernel.startswith("documents") for d in capture.report)


# -- kept, each with its reason -------------------------------------------------------------


def _ids(positions):
    return (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)


def _full_with_ids_of_row_0(q, k, v, positions):
    """Equal ids at row b say that row b's positions are consecutive, nothing of row 0's."""
    ids = _ids(positions)
    row0 = positions[0]
    causal = row0[None, :] <= row0[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=(ids[:, None, :, None] == ids[:, None, None, :]) & causal[None, None]
    )


def _full_with_ids_from_a_rounding_cast(q, k, v, positions):
    """bfloat16 rounds 257 to 256: the float differences see one document where the positions
    jump by 2, so the positions do not restart where the ids say documents do."""
    rounded = positions.to(torch.bfloat16)
    ids = (torch.diff(rounded, prepend=rounded[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    q_pos, kv_pos = positions[:, None, :, None], positions[:, None, None, :]
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same & (kv_pos <= q_pos))


@pytest.mark.parametrize(
    ("fn", "positions", "reason"),
    [
        (
            _full_with_ids_of_row_0,
            torch.stack([torch.tensor([0, 1, 2, 3, 100, 101, 102, 103]), torch.arange(8)]),
            "kept: mask depends on input positions, even with input positions checked as packed positions at run "
            "time (a padded batch, one sequence a row with its attention_mask, is read without them)",
        ),
        (
            _full_with_ids_from_a_rounding_cast,
            torch.tensor([[250, 251, 252, 253, 254, 255, 257, 258]] * 2),
            "kept: mask depends on input positions",
        ),
    ],
    ids=["ids-of-row-b-causal-on-row-0", "ids-from-a-rounding-cast"],
)
def test_packed_full_masks_whose_positions_do_not_restart_at_documents_are_kept(fn, positions, reason):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=8, batch=2), positions)
    (decision,) = capture.report
    assert decision.verdict == reason, decision.verdict


def test_packed_full_layers_keep_sdpa_on_a_gpu_until_measured(monkeypatch):
    """On a GPU nothing is measured for such calls yet (``gpu_check.py --sections packed``):
    every kernel says why, and SDPA stays."""
    ask_as_if_on_cuda(monkeypatch)
    model = packed_training.model("Llama")
    capture = Capture()
    ids = token_batch(32, batch=1)
    torch.compile(model, backend=capture, fullgraph=True)(
        input_ids=ids, position_ids=_positions(12, 20)[None], use_cache=False
    )
    for verdict in _verdicts(capture):
        assert verdict.startswith(
            "kept: mask is window (-1, 0), packed sequences from position_ids (positions checked at run time): "
            "no sliding window, and no kernel is faster than SDPA for it here: "
        ), verdict
        assert "documents: the document kernel runs aten's fused CPU flash kernel, on the CPU only" in verdict


def test_short_packed_calls_keep_sdpa_below_the_crossover(monkeypatch):
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)
    model = packed_training.model("Llama")
    capture = Capture()
    ids = token_batch(32, batch=1)
    torch.compile(model, backend=capture, fullgraph=True)(
        input_ids=ids, position_ids=_positions(12, 20)[None], use_cache=False
    )
    for verdict in _verdicts(capture):
        assert "documents: its 32 keys are at most" in verdict, verdict


# -- TRL's SFTTrainer ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(packed_training.SETUPS))
def test_trl_packed_llama_through_the_backend(setup):
    """The packed-training table's run of one model (benchmarks/packed_training.py): every
    layer rewritten, the step's loss and every gradient eager's and fp64's."""
    row = packed_training.run("Llama", setup)
    assert (row["rewritten"], row["layers"], row["kernels"]) == (2, 2, ["documents"]), row
    assert row["eager"] <= 1e-4 and row["fp64"] <= 1e-4, row


def _sft_step_inside_enable(name: str, setup: str, folder) -> tuple[tuple, list]:
    """One SFTTrainer step with ``torch_compile=True`` (inductor) inside ``compile_pass.enable()``:
    (the step, the decisions)."""
    import compile_pass

    no_caches = (  # a cache hit would reuse the artifact without rewriting again
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )
    with no_caches[0], no_caches[1], compile_pass.enable(), compile_pass.decisions() as report:
        step = packed_training.sft_step(packed_training.model(name), setup, str(folder), torch_compile=True)
    return step, list(report)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "setup"), [("Llama", "packing"), ("Qwen3", "padding-free"), ("Gemma-4", "packing")])
def test_trl_packed_training_inside_enable(tmp_path, name, setup):
    """``compile_pass.enable()`` around TRL's SFTTrainer compiling with inductor: every
    full-attention layer on the document kernel, the step eager's and fp64's (each model in one
    set-up: the packed-training table's test runs both through the backend)."""
    ours, decisions = _sft_step_inside_enable(name, setup, tmp_path / "ours")
    eager = packed_training.sft_step(packed_training.model(name), setup, str(tmp_path / "eager"))
    fp64 = packed_training.sft_step(packed_training.model(name, torch.float64), setup, str(tmp_path / "fp64"))
    full = {d.verdict for d in decisions if d.reason.startswith("window (-1, 0)")}
    assert full == {PACKED}, [d.verdict for d in decisions]
    assert all(d.rewritten for d in decisions if d.kind == "attention call"), [d.verdict for d in decisions]
    assert packed_training.worst_error(ours, eager) <= 1e-4
    assert packed_training.worst_error(ours, fp64) <= 1e-4
