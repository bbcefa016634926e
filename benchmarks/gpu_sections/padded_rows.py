"""The ``padded`` and ``profile`` sections: the op on padded batches, with the sequences' varlen
pass in its two forms (gathered, in place), against no padding (the data for
``fa2_varlen.IN_PLACE_MOST_PADDING``), and where one left-padded call's time goes, per form."""

from __future__ import annotations

import contextlib

from .common import WINDOW, Printer, layer_inputs, layer_medians_ms


@contextlib.contextmanager
def sequences_pass(most_padding: float):
    """The padded sequences' pass in one form while inside: ``fa2_varlen.IN_PLACE_MOST_PADDING`` set
    (-1: gathered always, 1: in place always), the op's own threshold restored after."""
    from compile_pass.kernels.fa2 import varlen as fa2_varlen

    default = fa2_varlen.IN_PLACE_MOST_PADDING
    fa2_varlen.IN_PLACE_MOST_PADDING = most_padding
    try:
        yield
    finally:
        fa2_varlen.IN_PLACE_MOST_PADDING = default


def time_padded_rows(say: Printer, seqs: list[int], repeats: int) -> None:
    """The cost of a padded batch: the op on a batch of 4 with the same valid tokens per row,
    left-padded (no padded row sees a key: the sequences' pass alone) and right-padded (the
    padded rows within the window see the last keys: one more varlen call), against no
    padding at all; each with the sequences' pass in its two forms, on the valid tokens
    gathered and on the batch in place (its padding runs computed and dropped), at a light
    and a heavy share of padding: the data for ``fa2_varlen.IN_PLACE_MOST_PADDING``."""
    import torch

    from compile_pass import sliding_window_attention
    from compile_pass.kernels.fa2 import varlen as fa2_varlen

    batch = 4
    say(
        f"# padded rows: one sliding layer, fwd+bwd, bf16, batch {batch}, window {WINDOW}, the op called directly; "
        f"interleaved median of {repeats}, ms; 'gathered'/'in place': the sequences' pass's two forms"
    )
    say(
        f"{'S':>6} {'padding':>8} {'no padding':>11} {'left gathered':>14} {'left in place':>14} "
        f"{'right gathered':>15} {'right in place':>15} {'gathered/in place':>18}"
    )
    default = fa2_varlen.IN_PLACE_MOST_PADDING

    def one_length(seq):
        leaves = layer_inputs(batch, seq)
        q, k, v, grad_out = (x.transpose(1, 2) for x in leaves)
        for share in (8, 2):
            padded = seq // share
            left = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
            left[:, :padded] = False
            right = left.flip(-1).contiguous()

            def step(padding, most_padding):
                def run():
                    with sequences_pass(most_padding):
                        out = sliding_window_attention(q, k, v, window=(WINDOW - 1, 0), key_padding=padding)
                        torch.autograd.grad(out, (q, k, v), grad_out)

                return run

            steps = {"none": step(None, default)}
            for name, padding in (("left", left), ("right", right)):
                steps[f"{name} gathered"] = step(padding, -1.0)
                steps[f"{name} in place"] = step(padding, 1.0)
            ms = layer_medians_ms(say, seq, steps, repeats)
            if ms is None:
                continue
            ratios = "/".join(f"{ms[f'{name} gathered'] / ms[f'{name} in place']:.2f}" for name in ("left", "right"))
            say(
                f"{seq:6d} {f'1/{share}':>8} {ms['none']:11.2f} {ms['left gathered']:14.2f} "
                f"{ms['left in place']:14.2f} "
                f"{ms['right gathered']:15.2f} {ms['right in place']:15.2f} {ratios + 'x':>18}"
            )

    for seq in seqs:
        one_length(seq)
    say(f"# the op's choice: in place up to {default:.0%} padding")


def profile_padded_call(say: Printer, seq: int) -> None:
    """Where a left-padded call's time goes, per form of the sequences' pass: the CUDA time of
    the ops of one fwd+bwd under torch.profiler (batch 4, 1/8 of each row padding)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from compile_pass import sliding_window_attention

    batch = 4
    leaves = layer_inputs(batch, seq)
    q, k, v, grad_out = (x.transpose(1, 2) for x in leaves)
    padding = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    padding[:, : seq // 8] = False

    def call():
        out = sliding_window_attention(q, k, v, window=(WINDOW - 1, 0), key_padding=padding)
        torch.autograd.grad(out, (q, k, v), grad_out)

    for form, most_padding in (("gathered", -1.0), ("in place", 1.0)):
        with sequences_pass(most_padding):
            call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        say(f"# profile: one left-padded call, S {seq}, batch {batch}, the sequences' pass {form}; CUDA time by op")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=48)
        for line in table.splitlines():
            say(f"#   {line}")
