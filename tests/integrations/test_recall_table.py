"""Which transformers families' attention layers the rules rewrite, and in which training
set-ups. benchmarks/families.py tries every decoder family with a sliding window (a training
step against eager, unpadded and right-padded) and records the run in benchmarks/families.json;
README.md's supported-models table and docs/rewritten.md's family table are made from that
record. Here: the pages hold what the record makes, every family transformers has with a window
is tried or excluded with a reason, a few families run live must give what the record holds,
and (``slow``) every family does. docs/rewritten.md's set-up table is computed here.

On a mismatch the test says what to run or paste."""

import copy
import math
import re
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks import families
from benchmarks.families import COMMON, FAMILIES, SETUP_FAMILIES
from benchmarks.families import family_model as _model
from tests.helpers.models import CACHE, Capture, cache_of, token_batch

ROOT = Path(__file__).resolve().parent.parent.parent
# The tables of what the rules do to each family, and in which set-ups, are docs/rewritten.md's.
REWRITTEN = ROOT / "docs" / "rewritten.md"
REGENERATE = "run `python benchmarks/families.py --write` (minutes) and commit what it changes"


def _assert_block(page: Path, markers: tuple[str, str], table: str) -> None:
    """The page's text between ``markers`` is ``table``; else prints what it should be."""
    assert families.block(page, markers) == table, f"{page.name}'s table is out of date; it should read:\n{table}"


def test_pages_hold_the_recorded_tables():
    """README.md's supported-models table and docs/rewritten.md's family table are what the
    record of the last run makes, and the record holds every family, none other."""
    record = families.load_record()["families"]
    assert list(record) == list(FAMILIES), f"benchmarks/families.json is not FAMILIES': {REGENERATE}"
    _assert_block(families.REWRITTEN, families.FAMILY_MARKERS, families.family_table(record))
    _assert_block(families.README, families.MARKERS, families.supported_models_table(record))


def _windowed_directories() -> set[str]:
    """The installed transformers' model directories whose config has a window, chunks or local
    attention."""
    models = Path(transformers.__file__).parent / "models"
    pattern = re.compile(r"\b(sliding_window|attention_chunk_size|local_attention)\b")
    return {path.parent.name for path in models.glob("*/configuration_*.py") if pattern.search(path.read_text())}


def test_every_family_with_a_window_is_tried_or_excluded():
    tried = {families.transformers_directory(family) for family in FAMILIES if families.available(family)}
    untold = _windowed_directories() - tried - set(families.EXCLUDED)
    assert not untold, (
        f"add these to FAMILIES (or EXCLUDED, with the reason) in benchmarks/family_configs.py: {sorted(untold)}"
    )
    assert not tried & set(families.EXCLUDED)


def test_the_window_count_is_found():
    """The search above finds what it looks for (a release that renamed the settings would
    leave it nothing to check)."""
    assert {"mistral", "gemma3", "llama4", "gpt_oss"} <= _windowed_directories()


def _assert_is_the_record(family: str, live: dict) -> None:
    """The live run's decisions are the record's, and its worst error the record's to within a
    factor of 10 (errors below 1e-9 counting as 1e-9: round-off differs between CPUs)."""
    recorded = families.load_record()["families"][family]
    assert {k: v for k, v in live.items() if k != "worst_error"} == {
        k: v for k, v in recorded.items() if k != "worst_error"
    }, f"{family}: the rules decide otherwise than recorded: {REGENERATE}"
    live_error, recorded_error = (max(error, 1e-9) for error in (live["worst_error"], recorded["worst_error"]))
    assert abs(math.log10(live_error / recorded_error)) <= 1, (
        f"{family}: worst error {live['worst_error']:.1e}, recorded {recorded['worst_error']:.1e}: {REGENERATE}"
    )
    assert live["worst_error"] <= families.TOLERANCE, f"{family}: a training step is not eager's"


@pytest.mark.parametrize("family", families.CHECKED_LIVE)
def test_family_run_is_the_record(family):
    """A few families (SDPA with sliding and full layers, attention spelled out in ops with
    sinks, chunks) train as recorded, in the default suite on every supported release."""
    _assert_is_the_record(family, families.run_family(family))


def _older_than_the_record() -> bool:
    from packaging.version import Version

    return Version(transformers.__version__) < Version(families.load_record()["transformers"])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_run(family):
    """Every family trains exactly; on the release the record was made with or a newer one, it
    gives what the record holds (a newer release that changes a family fails here until the
    record is made again). An older release may build some families otherwise, or lack them."""
    if not families.available(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    live = families.run_family(family)
    if not _older_than_the_record():
        _assert_is_the_record(family, live)
    else:
        assert live["worst_error"] <= families.TOLERANCE, f"{family}: a training step is not eager's"


# -- training set-ups against each family ------------------------------------------------------

SETUP_MARKERS = ("<!-- setup-table -->", "<!-- /setup-table -->")
LENGTH = 32
IMAGE_TOKEN = 120
# The multimodal classes whose sliding layers see image blocks, with the input naming them.
MULTIMODAL = {
    "Gemma-3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        "token_type_ids",
        dict(boi_token_index=121, eoi_token_index=122),
    ),
    "Gemma-4": (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        "mm_token_type_ids",
        dict(
            boi_token_id=121,
            eoi_token_id=122,
            video_token_id=123,
            audio_token_id=124,
            boa_token_id=125,
            eoa_token_index=126,
            audio_config=None,
        ),
    ),
}


def _padding() -> torch.Tensor:
    padding = torch.ones(2, LENGTH, dtype=torch.long)
    padding[0, :5] = 0
    padding[1, LENGTH - 7 :] = 0
    return padding


def _packed_positions() -> torch.Tensor:
    return torch.cat([torch.arange(12), torch.arange(LENGTH - 12)]).repeat(2, 1)


def _image_model(family: str):
    """(the family's multimodal model without a vision tower, inputs with a 10-token image), or
    None for a text-only family: image tokens get the pad embedding, the mask its image block."""
    if family not in MULTIMODAL:
        return None
    config_class, model_class, token_types, extra = MULTIMODAL[family]
    text = dict(COMMON, **FAMILIES[family].settings)
    if family == "Gemma-4":
        text["use_bidirectional_attention"] = "vision"
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=None, image_token_id=IMAGE_TOKEN, **extra
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa").eval()
    input_ids = token_batch(LENGTH) % 100
    input_ids[0, 4:14] = IMAGE_TOKEN
    return model, {"input_ids": input_ids, token_types: (input_ids == IMAGE_TOKEN).long()}


# set-up: (weights dtype, autocast dtype or None, extra inputs, logits tolerance relative to eager's scale)
SETUPS = {
    "fp32": (torch.float32, None, {}, 1e-4),
    "bf16 autocast": (torch.float32, torch.bfloat16, {}, 5e-2),
    "bf16 weights": (torch.bfloat16, None, {}, 5e-2),
    "padded": (torch.float32, None, {"attention_mask": _padding()}, 1e-4),
    "packed": (torch.float32, None, {"position_ids": _packed_positions()}, 1e-4),
    "padding-free": (
        torch.float32,
        None,
        {"position_ids": _packed_positions()[:1], "input_ids": token_batch(LENGTH, batch=1)},
        1e-4,
    ),
    "images": (torch.float32, None, {}, 1e-4),
    "decode": (torch.float32, None, {}, 1e-4),
}
SETUP_NOTES = {
    "fp32": "fp32 weights, a batch of 2 rows without padding",
    "bf16 autocast": (
        'fp32 weights under `torch.autocast("cpu", torch.bfloat16)`, as `TrainingArguments(bf16=True)` runs them'
    ),
    "padded": "`attention_mask` with left and right padding",
    "packed": "two rows of two sequences each, `position_ids` restarting per sequence and no mask (TRL `packing=True`)",
    "padding-free": "one flattened row (`DataCollatorWithFlattening`, TRL `padding_free=True`)",
    "images": "a 10-token image in the batch, the multimodal class of the family (Gemma-3 and Gemma-4 only)",
    "decode": "one `generate()` step of a left-padded batch of 2 with a `DynamicCache`, compiled",
}


def _decode_step(model, dtype):
    """Prefill eagerly, then one token for each row of a left-padded batch, as generate() does."""
    input_ids = token_batch(LENGTH)
    attention_mask = torch.ones(2, LENGTH + 1, dtype=torch.long)
    attention_mask[0, :5] = 0
    cache = cache_of(model(input_ids=input_ids, attention_mask=attention_mask[:, :-1], use_cache=True))
    return {"input_ids": input_ids[:, -1:], "attention_mask": attention_mask, CACHE: cache, "use_cache": True}


def _sliding_verdicts(family: str, setup: str) -> set[str] | None:
    """The verdicts of the family's sliding (or chunked) layers in the set-up, None where the
    set-up does not apply; the logits must equal eager's."""
    dtype, autocast, extra, tolerance = SETUPS[setup]
    if setup == "images":
        built = _image_model(family)
        if built is None:
            return None
        model, inputs = built
        config = model.config.get_text_config()
    else:
        config, model = _model(family)
        model = model.to(dtype)
        inputs = {"input_ids": token_batch(LENGTH), "use_cache": False, **extra}
    torch._dynamo.reset()
    capture = Capture()
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if setup == "decode":
            inputs = _decode_step(model, dtype)
            eager_inputs = dict(inputs, **{CACHE: copy.deepcopy(inputs[CACHE])})
        else:
            eager_inputs = inputs
        logits = torch.compile(model, backend=capture)(**inputs).logits
        reference = model(**eager_inputs).logits
    scale = max(1.0, reference.abs().max().item())
    assert (logits.double() - reference.double()).abs().max().item() <= tolerance * scale, (family, setup)
    attention = [d for report in capture.reports for d in report if d.rule != "topk_mask"]
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * len(attention)
    sliding = {kind for kind in kinds if kind != "full_attention"}
    return {
        re.sub(r" at \S+\.py:\d+$", "", decision.verdict)
        for kind, decision in zip(kinds, attention, strict=True)
        if kind in sliding
    }


def _cell(verdicts: set[str] | None, reasons: list[str]) -> str:
    """ "rewritten", "—" (does not apply), or "kept [n]" with n the reason's number."""
    if verdicts is None:
        return "—"
    if all(verdict.startswith("rewritten") for verdict in verdicts):
        return "rewritten"
    numbers = []
    for verdict in sorted(v for v in verdicts if not v.startswith("rewritten")):
        reason = re.sub(r"\b\d+\b", "#", verdict.removeprefix("kept: "))
        if reason not in reasons:
            reasons.append(reason)
        numbers.append(f"[{reasons.index(reason) + 1}]")
    return "kept " + " ".join(numbers)


def setup_table() -> str:
    """Every family in every set-up: its sliding layers' decisions, the reasons numbered below."""
    reasons: list[str] = []
    rows = []
    for family in SETUP_FAMILIES:
        cells = [_cell(_sliding_verdicts(family, setup), reasons) for setup in SETUPS]
        rows.append(f"| {family} | " + " | ".join(cells) + " |")
    header = "| family | " + " | ".join(SETUPS) + " |\n| --- |" + " --- |" * len(SETUPS)
    notes = [f"- {setup}: {note}" for setup, note in SETUP_NOTES.items()]
    legend = [f"- [{number}] {reason}" for number, reason in enumerate(reasons, 1)]
    return "\n".join([header, *rows, "", *notes, "", "Kept, because:", "", *legend])


def test_setup_table_is_the_docs_table():
    _assert_block(REWRITTEN, SETUP_MARKERS, setup_table())
