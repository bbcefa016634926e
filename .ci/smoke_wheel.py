"""The installed wheel, used as a user would, from outside the checkout (.ci/run).

    python .ci/smoke_wheel.py CHECKOUT/compile_pass   # run from any other folder

1. The package imports from site-packages (not the checkout), at the version its metadata
   states, and carries every file of the checkout's package (the kernels' modules included).
2. The op on a small call against SDPA with the band mask, forward and every gradient.
3. A tiny Mistral with a sliding window (random weights, no downloads) compiled with
   ``torch.compile(model, backend="compile_pass")``, the backend found by its entry point's
   name: at least one attention call rewritten, and the loss as eager's.

Exits non-zero (an AssertionError) on any failure.
"""

import os
import sys
from pathlib import Path

# Every length rewritten: these calls are shorter than the measured crossovers, below which
# the op keeps SDPA (docs/kernels.md). The crossover is the static tables' (measured on a
# device, a call under 64 keys is too short to measure and keeps SDPA whatever it is set to).
os.environ["COMPILE_PASS_MEASURE"] = "static"
os.environ["COMPILE_PASS_SHORT_KEYS"] = "0"

import importlib.metadata  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import compile_pass  # noqa: E402


def check_installed(source: Path) -> None:
    package = Path(compile_pass.__file__).resolve().parent
    assert "site-packages" in package.parts, f"compile_pass imported from {package}, not an installed wheel"
    assert compile_pass.__version__ == importlib.metadata.version("compile_pass"), compile_pass.__version__
    shipped = {str(path) for path in importlib.metadata.files("compile_pass") if path.parts[0] == "compile_pass"}
    wanted = {
        str(Path("compile_pass") / path.relative_to(source))
        for path in source.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    missing = sorted(wanted - shipped)
    assert not missing, f"the wheel lacks {missing}"
    print(f"compile_pass {compile_pass.__version__} from {package}: {len(wanted)} files, all in the wheel")


def check_op() -> None:
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, head_dim, window = 2, 4, 2, 48, 16, 8
    q = torch.randn(batch, heads, seq, head_dim, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(batch, kv_heads, seq, head_dim, generator=generator, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    grad_out = torch.randn(batch, heads, seq, head_dim, generator=generator, dtype=torch.float64)
    out = compile_pass.sliding_window_attention(q, k, v, window=(window - 1, 0))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    positions = torch.arange(seq)
    band = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (expected, *expected_grads), strict=True):
        error = (ours - theirs).abs().max().item()
        assert error < 1e-10, f"{name}: {error}"
    print(f"the op against SDPA with the band mask (fp64, GQA, window {window}): out, dq, dk, dv within 1e-10")


def check_backend() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=8,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        compiled = torch.compile(model, backend="compile_pass")  # the entry point, by name
        with compile_pass.decisions() as report:
            loss = compiled(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    print(report.table())
    assert report.rewritten(), "no attention call was rewritten"
    assert abs(loss.item() - expected.item()) < 1e-4 * max(1.0, abs(expected.item())), (loss.item(), expected.item())
    print(f"a tiny Mistral through backend='compile_pass': loss {loss.item():.6f}, eager's {expected.item():.6f}")


if __name__ == "__main__":
    check_installed(Path(sys.argv[1]).resolve())
    check_op()
    check_backend()
    print("smoke test passed")
