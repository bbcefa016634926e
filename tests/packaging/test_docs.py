"""Examples that cannot rot: every code block in README.md and docs/ is either run here or
marked as not run with a reason, on the line right before its opening fence (other HTML
comments, such as README's ``<!-- setup -->``, may stand between):

    <!-- run: SETUP -->            this test runs the block after SETUP (below) built its names;
    <!-- run: SETUP (slow) -->     the same, under the ``slow`` marker (it compiles with inductor)
    <!-- not run: REASON -->       a block nobody can run as it stands, and why

The run blocks share nothing: each runs in a fresh namespace, with Dynamo reset around it."""

import re
from pathlib import Path

import pytest
import torch

import compile_pass
from tests.helpers.models import Capture, tiny_gemma4, token_batch

ROOT = Path(__file__).resolve().parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- (run: (?P<setup>[\w-]+)(?P<slow> \(slow\))?|not run: (?P<reason>\S.*?)) -->")
FENCE = re.compile(r"^(\s*)```")


def _tiny_gemma4(namespace, tmp_path):
    ids = token_batch(32)
    namespace.update(model=tiny_gemma4(), batch=dict(input_ids=ids, labels=ids))


def _compiled_gemma4(namespace, tmp_path):
    """A compiled model whose compile rewrites (no inductor: the tests' Capture backend)."""
    _tiny_gemma4(namespace, tmp_path)
    namespace["compiled"] = torch.compile(namespace["model"], backend=Capture())


def _trainer(namespace, tmp_path):
    ids = token_batch(32)
    namespace.update(model=tiny_gemma4(), dataset=[dict(input_ids=row, labels=row) for row in ids])


def _tensors(namespace, tmp_path):
    torch.manual_seed(0)
    namespace.update(
        query=torch.randn(2, 4, 64, 16),
        key=torch.randn(2, 2, 64, 16),
        value=torch.randn(2, 2, 64, 16),
        w=8,
    )


# What a block may take as given: SETUP name -> a function filling its namespace.
SETUPS = {"tiny-gemma4": _tiny_gemma4, "compiled-gemma4": _compiled_gemma4, "trainer": _trainer, "tensors": _tensors}


def _blocks(page: Path):
    """(line of the opening fence, the marker's match or None, the block's code) of each block."""
    lines = page.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, end = opening.group(1), index + 1
        while not lines[end].strip().startswith("```"):
            end += 1
        above = index - 1
        while above >= 0 and lines[above].strip().startswith("<!--") and not MARKER.search(lines[above]):
            above -= 1  # other comments between a marker and its block
        marker = MARKER.search(lines[above]) if above >= 0 else None
        code = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
        blocks.append((index + 1, marker, code))
        index = end + 1
    return blocks


def _run_blocks():
    params = []
    for page in PAGES:
        for line, marker, code in _blocks(page):
            if marker and marker.group("setup"):
                marks = [pytest.mark.slow] if marker.group("slow") else []
                where = f"{page.relative_to(ROOT)}:{line}"
                params.append(pytest.param(where, marker.group("setup"), code, marks=marks, id=where))
    return params


def test_every_block_is_run_or_says_why_not():
    unmarked = [f"{page.relative_to(ROOT)}:{line}" for page in PAGES for line, marker, _ in _blocks(page) if not marker]
    assert not unmarked, (
        f"code blocks with neither <!-- run: SETUP --> nor <!-- not run: REASON --> before them: {unmarked}"
    )
    unknown = [setup for *_, setup, _ in (p.values for p in _run_blocks()) if setup not in SETUPS]
    assert not unknown, f"unknown setups {unknown}; known: {sorted(SETUPS)}"
    assert any(p.values[0].startswith("README.md") for p in _run_blocks()), "README.md runs none of its blocks"


@pytest.mark.parametrize(("where", "setup", "code"), _run_blocks())
def test_block_runs(where, setup, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a block writes (a Trainer's output_dir) goes there
    namespace = {"torch": torch, "compile_pass": compile_pass}
    SETUPS[setup](namespace, tmp_path)
    torch._dynamo.reset()
    # A block may set Dynamo's process-wide settings (the Trainer recipe does); they end with it.
    # No cache hits: a graph taken from inductor's caches under enable() is not rewritten again.
    with (
        torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        compile_pass.decisions() as report,
    ):
        exec(compile(code, where, "exec"), namespace)
    torch._dynamo.reset()
    if "model" in namespace:  # a block about a model rewrites its sliding layers
        assert any(d.rewritten and d.rule == "sliding_window" for d in report), (where, report.table())
    if "loss" in namespace:
        assert torch.isfinite(namespace["loss"]).all(), where
    if "out" in namespace:
        assert namespace["out"].shape == namespace["query"].shape, where


def test_ci_builds_the_site_after_the_tests():
    """The strict site build comes after the README's test command and the slow tests, and
    before the oldest releases' run (tests/packaging/test_packaging.py checks the rest of the order)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    build = next(index for index, line in enumerate(ci) if "mkdocs build --strict" in line)
    slow = next(index for index, line in enumerate(ci) if "-m slow" in line)
    assert slow < build < ci.index("pip install $(python .ci/oldest.py)")


def test_the_api_page_renders_every_public_name():
    """docs/api.md renders (``::: ...``) every name ``compile_pass`` exports, so the reference
    cannot fall behind the package's ``__all__``."""
    rendered = re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "api.md").read_text(), flags=re.MULTILINE)
    missing = [name for name in compile_pass.__all__ if not any(path.split(".")[-1] == name for path in rendered)]
    assert not missing, f"docs/api.md renders none of {missing}: add a `::: compile_pass.NAME` line"
