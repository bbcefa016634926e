"""Every family in transformers whose config has a sliding window (or chunked attention, or
local attention), as a tiny random config (no downloads, window w = 8): what the rules do to
its layers, and whether a training step through the rewritten graph is eager's. Decoders train
as causal LMs; encoders by their masked-LM or token-classification loss (an embedding encoder
with no head by the mean square of its states), T5Gemma by its generation loss, and Gemma-3
also as embedding models train it, bidirectionally (two-sided windows).

Each family's causal LM is built on SDPA, or with eager attention where transformers gives it
no SDPA path, and compiled with the rules (the rewritten graph run as it is, no inductor).
Recorded per family: every attention call's decision, by the kind of its layer (sliding or
chunked, full attention; calls elsewhere apart), and a training step's loss and every
gradient against eager's, fp32, batch 2, unpadded and then right-padded (``attention_mask``),
as the worst error relative to each tensor's scale, max |a - b| / max(1, max |eager|).

    python benchmarks/families.py                   # every family; prints both tables (minutes)
    python benchmarks/families.py --write           # also records them (see below)
    python benchmarks/families.py Gemma-4 Mistral   # some families, printed only
    python benchmarks/families.py --pages           # the pages' tables from the record, not run

It prints (a) the table of every family (docs/rewritten.md, between the ``recall-table``
markers) and (b) README.md's supported-models table, families with one result in one row.
``--write`` stores the run in benchmarks/families.json, with the transformers release it ran
on, and writes both tables into the two pages. tests/integrations/test_recall_table.py keeps them true:
the pages' tables must be what the record makes, a few families run live in the default
suite must give what the record holds, and the slow suite runs every family against it. A
transformers release that brings a new family with a sliding window fails the suite until the
family is in FAMILIES or in EXCLUDED.

Excluded (EXCLUDED, by transformers' model directory): speech, audio, protein or OCR
models, and T5Gemma-2 (its encoder reads images); multimodal
models whose text model has no causal-LM class of its own (trained with their images, through
the multimodal class); configs whose window the modeling code never reads; and models that
are no decoder LM trained by next-token loss (block diffusion).

The tiny models are short, so every length is rewritten here (COMPILE_PASS_SHORT_KEYS=0 and
COMPILE_PASS_MEASURE=static, as in the tests: nothing is timed); at real lengths the CPU keeps
SDPA below a measured crossover (docs/performance.md).

The families and EXCLUDED are in benchmarks/family_configs.py, one family's run in
family_sweep.py, the record and the tables made from it in family_tables.py; this script runs
them, and the tests and packed_training.py import their names from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.family_configs import CHECKED_LIVE, COMMON, EXCLUDED, FAMILIES, SETUP_FAMILIES  # noqa: E402
from benchmarks.family_sweep import available, family_model, run_family, transformers_directory  # noqa: E402
from benchmarks.family_tables import (  # noqa: E402
    FAMILY_MARKERS,
    MARKERS,
    README,
    REWRITTEN,
    block,
    error_text,
    family_table,
    load_record,
    replace_block,
    summary,
    supported_models_table,
    write_pages,
    write_record,
)
from tests.helpers.models import TOLERANCE  # noqa: E402

# What the tests and packed_training.py take from here; each is defined in the module it came from.
__all__ = [
    "CHECKED_LIVE",
    "COMMON",
    "EXCLUDED",
    "FAMILIES",
    "FAMILY_MARKERS",
    "MARKERS",
    "README",
    "REWRITTEN",
    "SETUP_FAMILIES",
    "TOLERANCE",
    "available",
    "block",
    "family_model",
    "family_table",
    "load_record",
    "replace_block",
    "run_all",
    "run_family",
    "supported_models_table",
    "transformers_directory",
]


def run_all(families) -> dict[str, dict]:
    records = {}
    for family in families:
        records[family] = run_family(family)
        print(
            f"{family}: {summary(records[family], 'sliding')} / {summary(records[family], 'full')}, "
            f"worst error {error_text(records[family]['worst_error'])}",
            file=sys.stderr,
            flush=True,
        )
    return records


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv == ["--pages"]:  # the pages' tables from the record, as after a change to how they read
        write_pages(load_record()["families"])
        return
    write = "--write" in argv
    chosen = [name for name in argv if name != "--write"] or [family for family in FAMILIES if available(family)]
    if write and len(chosen) != len(FAMILIES):
        raise SystemExit("--write records every family: run it on a transformers that has them all")
    records = run_all(chosen)
    print(family_table(records), supported_models_table(records), sep="\n\n")
    if write:
        write_record(records)
        write_pages(records)


if __name__ == "__main__":
    main(sys.argv[1:])
