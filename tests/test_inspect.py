"""``python -m compile_pass inspect``: offline, from a config directory or file, on the meta device."""

import subprocess
import sys

import pytest
from transformers import Gemma4TextConfig

from compile_pass.inspect import inspect_config, load_config


def test_inspect_a_saved_config(tmp_path):
    # A Gemma-4 shaped like the real checkpoint's attention (window 1024, head_dim 256/512),
    # with few layers: built on the meta device, nothing is allocated.
    Gemma4TextConfig(num_hidden_layers=6, sliding_window=1024).save_pretrained(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "compile_pass", "inspect", str(tmp_path), "--seq", "2048"],
        check=True, capture_output=True, text=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "Gemma4TextConfig, seq 2048, batch 1"
    assert sum("rewritten: window (1023, 0)" in line for line in lines) == 5
    assert any("causal_mask" in line and "is_causal=True" in line for line in lines)
    assert lines[-1] == "6 of 6 decisions rewrite the graph"


@pytest.mark.parametrize("batch", [1, 2])
def test_inspect_padded_from_a_config_file(tmp_path, batch):
    Gemma4TextConfig(num_hidden_layers=6, sliding_window=256).save_pretrained(tmp_path)
    report = inspect_config(load_config(str(tmp_path / "config.json")), seq=512, batch=batch, padded=True)
    assert [d.verdict for d in report.rewritten()] == ["rewritten: window (255, 0), key padding from attention_mask"] * 5
    assert report.kept()[0].verdict.startswith("kept: ")
