"""``python -m compile_pass inspect``: offline, from a config directory or file, on the meta device."""

import subprocess
import sys
import tempfile

import expecttest
import pytest
from transformers import Gemma4TextConfig

from compile_pass.inspect import inspect_config, load_config, main
from tests.helpers.models import at_sdpa_call

# Gemma-4 26B-A4B's attention (window 1024, head_dim 256 sliding / 512 global) with MoE layers,
# in 6 layers: built on the meta device, nothing is allocated.
MOE = dict(
    num_hidden_layers=6,
    sliding_window=1024,
    global_head_dim=512,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=128,
)


class TestCommand(expecttest.TestCase):
    def test_inspect_a_saved_moe_config(self):
        # Every MoE router takes a top-k of expert scores: no mask, so not in the report.
        with tempfile.TemporaryDirectory() as path:
            Gemma4TextConfig(**MOE).save_pretrained(path)
            done = subprocess.run(
                [sys.executable, "-m", "compile_pass", "inspect", path, "--seq", "2048"],
                check=True,
                capture_output=True,
                text=True,
            )
        self.assertExpectedInline(
            at_sdpa_call(done.stdout),
            """\
Gemma4TextConfig, seq 2048, batch 1
layers  module                    layer type         rule            decision                                        kernel
0-4     model.layers.*.self_attn  sliding_attention  sliding_window  rewritten: window (1023, 0)                     chosen on the device the model runs on
5       model.layers.5.self_attn  full_attention     causal_mask     rewritten: plain causal mask -> is_causal=True
called at transformers/integrations/sdpa_attention.py:<SDPA call>
6 of 6 attention calls rewritten
""",  # noqa: E501 (a snapshot: printed lines as they are)
        )


@pytest.mark.parametrize("batch", [1, 2])
def test_inspect_padded_from_a_config_file(tmp_path, batch):
    Gemma4TextConfig(num_hidden_layers=6, sliding_window=256).save_pretrained(tmp_path)
    report = inspect_config(load_config(str(tmp_path / "config.json")), seq=512, batch=batch, padded=True)
    # The full-attention layer too: padded rows on the CPU's document kernel.
    assert [d.verdict for d in report.rewritten()] == [
        "rewritten: window (255, 0), key padding from attention_mask"
    ] * 5 + ["rewritten: window (-1, 0), key padding from attention_mask"]
    assert report.summary() == "6 of 6 attention calls rewritten"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_inspect_packed_documents(tmp_path, capsys, dtype):
    """A padding-free batch (TRL's packing, DataCollatorWithFlattening): every layer is predicted
    rewritten behind the positions' run-time check, in fp32 and bf16 weights alike."""
    Gemma4TextConfig(num_hidden_layers=6, sliding_window=256).save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path), "--seq", "1024", "--packed", "4", "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    first = f"Gemma4TextConfig, seq 1024, batch 1{', bf16' if dtype == 'bf16' else ''}, 4 packed documents a row"
    assert out.splitlines()[0] == first
    for window in (255, -1):  # the sliding layers and the full-attention one
        assert (
            f"rewritten: window ({window}, 0), packed sequences from position_ids (positions checked at run time)"
            in out
        )
    assert out.rstrip().endswith("6 of 6 attention calls rewritten")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing", None, "no such file or directory: {path}"),
        ("empty-directory", "", "{path} is a directory without a config.json"),
        ("broken.json", "{", "{path} is not a readable JSON config: Expecting property name"),
        ("no-type.json", '{"hidden_size": 8}', '{path} has no "model_type": not a transformers config'),
        (
            "unknown.json",
            '{"model_type": "no_such_model"}',
            "{path}: model_type 'no_such_model' is unknown to transformers",
        ),
    ],
)
def test_a_path_without_a_config_says_so_in_one_line(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert main(["inspect", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("python -m compile_pass inspect: " + message.format(path=path))
    assert len(captured.err.splitlines()) == 1


def test_kill_switch_is_named(tmp_path, capsys, monkeypatch):
    Gemma4TextConfig(num_hidden_layers=2, sliding_window=256).save_pretrained(tmp_path)
    monkeypatch.setenv("COMPILE_PASS_DISABLE", "1")
    assert main(["inspect", str(tmp_path), "--seq", "512"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "compile_pass is off (COMPILE_PASS_DISABLE=1): no rule ran, 1 graph compiled unchanged"
    ]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--seq", "0"], "--seq must be a positive integer, got 0"),
        (["--seq", "-5"], "--seq must be a positive integer, got -5"),
        (["--batch", "0"], "--batch must be a positive integer, got 0"),
        (["--packed", "0"], "--packed must be a positive integer, got 0"),
        (
            ["--packed", "3", "--seq", "512"],
            "--packed 3 needs a --seq it divides, and no --padded (a packed batch has no mask)",
        ),
        (
            ["--packed", "2", "--padded"],
            "--packed 2 needs a --seq it divides, and no --padded (a packed batch has no mask)",
        ),
    ],
)
def test_a_size_that_is_not_positive_says_so_in_one_line(tmp_path, capsys, arguments, message):
    Gemma4TextConfig(num_hidden_layers=2, sliding_window=256).save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path), *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"python -m compile_pass inspect: {message}\n"


def test_a_config_field_of_the_wrong_type_says_so_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "gemma4_text", "num_hidden_layers": 2, "head_dim": "sixteen"}')
    assert main(["inspect", str(path), "--seq", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"python -m compile_pass inspect: {path}: ")


@pytest.mark.parametrize(
    ("seq", "dtype", "where"),
    [(384, "bf16", " on the CPU and on a GPU"), (800, "bf16", " on the CPU"), (600, "fp32", None)],
)
def test_a_short_length_says_where_its_crossover_keeps_sdpa(tmp_path, monkeypatch, seq, dtype, where):
    """Offline the device is unknown: the kernel column says on which devices the measured
    crossovers (CPU: fp32 512 keys, bf16 1024; GPU: 512 plain) keep SDPA at the traced length."""
    from compile_pass.inspect import DTYPES
    from compile_pass.kernels import contract as kernel

    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)
    Gemma4TextConfig(num_hidden_layers=6, sliding_window=256).save_pretrained(tmp_path)
    report = inspect_config(load_config(str(tmp_path)), seq=seq, dtype=DTYPES[dtype])
    kernels = {d.kernel for d in report.rewritten() if d.rule == "sliding_window"}
    note = "" if where is None else f"; at {seq} keys SDPA stays{where}, below a measured crossover"
    assert kernels == {"chosen on the device the model runs on" + note}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--device", "nonsense"], "--device 'nonsense' is not a device torch knows (cpu, cuda, cuda:N)"),
        (["--device", "meta"], "--device meta: measures on a CUDA GPU or the CPU only"),
        (["--device", "cuda:7"], "--device cuda:7: this machine has no such CUDA GPU"),
        (["--seconds", "-1"], "--seconds must be a positive number of seconds, got -1"),
        (["--seconds", "nan"], "--seconds must be a positive number of seconds, got nan"),
        (["--seconds", "inf"], "--seconds must be a positive number of seconds, got inf"),
    ],
)
def test_tunes_arguments_are_checked_in_one_line(tmp_path, capsys, arguments, message):
    Gemma4TextConfig(num_hidden_layers=2, sliding_window=256).save_pretrained(tmp_path)
    assert main(["tune", str(tmp_path), "--seq", "128", *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"python -m compile_pass tune: {message}\n"
