"""The ``layer`` and ``short`` sections: one sliding layer, forward and backward, the op
against what transformers runs (SDPA with the band mask, K/V repeated) and against torch's FA2
called directly, the kernel the op runs: at long lengths (the op should be within 5% of
torch's FA2) and at short ones (the data for the CUDA crossovers, ``fa2.SHORT_KEYS``)."""

from __future__ import annotations

from .common import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    QUEUED_CALLS,
    WINDOW,
    Printer,
    causal_band,
    layer_inputs,
    layer_medians_ms,
)

TARGET_OVER_FA2 = 1.05


def time_layer(say: Printer, seqs: list[int], repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from compile_pass import sliding_window_attention

    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None
        say("# flash-attn is not importable: no direct flash-attn timing")
    groups = HEADS // KV_HEADS
    say(
        f"# one sliding layer, fwd+bwd, bf16, batch 1, {HEADS} heads, {KV_HEADS} kv heads, "
        f"head_dim {HEAD_DIM}, window {WINDOW}; interleaved median of {repeats}, ms"
    )
    say(
        f"# 'queued': the same, {QUEUED_CALLS} calls back to back per timing (the CPU runs ahead of the GPU, "
        "as in a training step), ms per call"
    )
    say(
        f"{'S':>6} {'op':>9} {'sdpa':>9} {'torch FA2':>10} {'flash-attn':>11} {'sdpa/op':>8} {'op/torch FA2':>13} "
        f"{'op queued':>10} {'FA2 queued':>11} {'op/FA2 queued':>14}"
    )

    def one_length(seq):
        q, k, v, grad_out = layer_inputs(1, seq)
        # SDPA layout: (B, H, S, D) views of that storage, as attention layers pass them.
        q_, k_, v_, grad_out_ = (x.transpose(1, 2) for x in (q, k, v, grad_out))
        band = causal_band(seq, WINDOW)

        def gradients(out, grad):
            torch.autograd.grad(out, (q, k, v), grad)

        steps = {
            "op": lambda: gradients(sliding_window_attention(q_, k_, v_, window=(WINDOW - 1, 0)), grad_out_),
            "sdpa": lambda: gradients(
                F.scaled_dot_product_attention(
                    q_,
                    k_.repeat_interleave(groups, dim=1),
                    v_.repeat_interleave(groups, dim=1),
                    attn_mask=band[None, None],
                ),
                grad_out_,
            ),
        }

        def raw_fa2():
            scale = HEAD_DIM**-0.5
            window = dict(scale=scale, window_size_left=WINDOW - 1, window_size_right=0)
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q.detach(), k.detach(), v.detach(), None, None, seq, seq, 0.0, False, False, **window
            )
            torch.ops.aten._flash_attention_backward(
                grad_out,
                q.detach(),
                k.detach(),
                v.detach(),
                out,
                lse,
                None,
                None,
                seq,
                seq,
                0.0,
                False,
                rng,
                unused,
                **window,
            )

        steps["torch FA2"] = raw_fa2  # on the (B, S, H, D) storage itself
        if flash_attn_func is not None:
            steps["flash-attn"] = lambda: gradients(
                flash_attn_func(q, k, v, causal=True, window_size=(WINDOW - 1, 0)), grad_out
            )
        ms = layer_medians_ms(say, seq, steps, repeats)
        queued = layer_medians_ms(say, seq, {name: steps[name] for name in ("op", "torch FA2")}, repeats, QUEUED_CALLS)
        if ms is None or queued is None:
            return
        ratio, queued_ratio = ms["op"] / ms["torch FA2"], queued["op"] / queued["torch FA2"]
        ms.setdefault("flash-attn", float("nan"))
        say(
            f"{seq:6d} {ms['op']:9.2f} {ms['sdpa']:9.2f} {ms['torch FA2']:10.2f} {ms['flash-attn']:11.2f} "
            f"{ms['sdpa'] / ms['op']:7.2f}x {ratio:12.3f}{' ' if ratio <= TARGET_OVER_FA2 else '!'} "
            f"{queued['op']:10.2f} {queued['torch FA2']:11.2f} "
            f"{queued_ratio:13.3f}{' ' if queued_ratio <= TARGET_OVER_FA2 else '!'}"
        )

    for seq in seqs:
        one_length(seq)
    say(f"# '!': the op is more than {100 * (TARGET_OVER_FA2 - 1):.0f}% slower than torch's FA2 called directly")


def time_short_lengths(say: Printer, seqs: list[int], repeats: int, head_dims=(HEAD_DIM,), batches=(4,)) -> None:
    """Where torch's FA2 starts to beat SDPA with the mask: the data for the CUDA crossovers
    (``fa2.SHORT_KEYS``). One sliding layer, fwd+bwd, bf16, by head_dim and batch (Gemma-4's
    256 and 4 unless asked; smaller heads and batches do less work a call), each call queued behind
    the last as in a training step; the op against SDPA with the boolean band mask (and the
    padding) and K/V repeated, as transformers calls it. Forms: plain; padded (every row but the
    first, the only one at batch 1, left-padded by a quarter), the op called directly (a layout
    per call, one host sync); padded with one layout for all calls, as the layers of a
    rewritten graph share one."""
    import torch
    import torch.nn.functional as F

    from compile_pass import sliding_window_attention
    from compile_pass.ops import sliding_window_attention_forward

    groups = HEADS // KV_HEADS
    say(
        f"# short lengths: one sliding layer, fwd+bwd, bf16, {QUEUED_CALLS} calls queued per timing; "
        f"median of {repeats}, ms per call; ratio = sdpa / op; 'shared': one varlen layout for every call"
    )
    say(f"{'D':>4} {'B':>2} {'w':>5} {'form':>13} {'S':>6} {'sdpa':>9} {'op':>9} {'ratio':>7}")
    cells = [
        (d, b, w, f)
        for d in head_dims
        for b in batches
        for w in (512, WINDOW)
        for f in ("plain", "padded", "padded shared")
    ]

    def one_cell(head_dim, batch, window, form, seq):
        leaves = layer_inputs(batch, seq, head_dim)
        q, k, v, grad_out = (x.transpose(1, 2) for x in leaves)
        padding = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
        if form != "plain":
            padding[1 if batch > 1 else 0 :, : seq // 4] = False  # left padding in every row but the first (if any)
        mask = causal_band(seq, window)[None, None] & padding[:, None, None, :]
        layout = torch.ops.compile_pass.varlen_layout(padding, None, window - 1, 0, torch.bfloat16, head_dim)

        def sdpa():
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask
            )
            torch.autograd.grad(out, (q, k, v), grad_out)

        def op():
            if form == "padded shared":
                out, _ = sliding_window_attention_forward(
                    q, k, v, window - 1, 0, head_dim**-0.5, padding, None, None, *layout
                )
            else:
                key_padding = padding if form == "padded" else None
                out = sliding_window_attention(q, k, v, window=(window - 1, 0), key_padding=key_padding)
            torch.autograd.grad(out, (q, k, v), grad_out)

        ms = layer_medians_ms(say, seq, {"sdpa": sdpa, "op": op}, repeats, QUEUED_CALLS)
        if ms is None:
            return
        say(
            f"{head_dim:4d} {batch:2d} {window:5d} {form:>13} {seq:6d} {ms['sdpa']:9.3f} {ms['op']:9.3f} "
            f"{ms['sdpa'] / ms['op']:6.2f}x"
        )

    for head_dim, batch, window, form in cells:
        for seq in seqs:
            one_cell(head_dim, batch, window, form, seq)
