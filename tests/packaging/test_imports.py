"""The package's imports point down its layers and form no circle (``.ci/imports.py``)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("ci_imports", ROOT / ".ci" / "imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_points_up_a_layer_or_forms_a_circle():
    run = subprocess.run([sys.executable, str(ROOT / ".ci" / "imports.py")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "none up a layer, no circle" in run.stdout


def test_the_checker_finds_an_upward_import_and_a_circle():
    checker = _checker()
    edges = checker.graph()
    # lazy imports count: the wide-head kernel imports its Triton code when a call runs
    assert "compile_pass.kernels.wide_head.forward" in edges["compile_pass.kernels.wide_head"]
    # the circle this layout removed: the policy asking the measurement by importing it
    edges["compile_pass.kernels.policy"] = edges["compile_pass.kernels.policy"] | {"compile_pass.measure"}
    found = checker.problems(edges)
    assert any("compile_pass.kernels.policy (kernels) imports compile_pass.measure" in line for line in found)
    circle = next(line for line in found if line.startswith("a circle"))
    assert "compile_pass.kernels.policy" in circle and "compile_pass.measure" in circle


def test_every_module_is_in_a_layer_and_no_folder_is_crowded():
    checker = _checker()
    for name in checker.modules():
        checker.layer_of(name)  # raises for a module no layer names
    for folder in (ROOT / "compile_pass").rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__":
            assert len(list(folder.glob("*.py"))) <= 13, folder


def test_a_new_module_at_the_root_must_be_placed_in_a_layer():
    import pytest

    with pytest.raises(SystemExit, match="compile_pass.newcomer: in no layer"):
        _checker().layer_of("compile_pass.newcomer")
    assert _checker().layer_of("compile_pass.kernels.wide_head.forward") == _checker().layer_of("compile_pass.kernels")
