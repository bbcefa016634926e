"""The ``packed`` section: a full-attention layer over packed documents and over a padded row,
the op (torch's FA2 varlen) against SDPA with the block-diagonal mask and SDPA's
``is_causal``: the data for a GPU crossover of such calls, which keep SDPA until measured."""

from __future__ import annotations

from .common import HEADS, KV_HEADS, Printer, layer_medians_ms

# The packed section: documents a row, and head_dims (FA2's range) of a full-attention layer.
PACKED_COUNTS = (1, 4, 8, 16)
PACKED_HEAD_DIMS = (128, 256)


def packed_full_layers(
    say: Printer,
    seqs: list[int],
    repeats: int,
    device: str = "cuda",
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dims=PACKED_HEAD_DIMS,
) -> None:
    """A full-attention layer over packed documents and padded rows, fwd+bwd, bf16, batch 1:
    the op (on a GPU torch's FA2 varlen, one sequence per document: the policy keeps SDPA for
    such calls until this measures them, and the op, called directly, runs its first exact
    kernel) against what transformers runs, SDPA with the block-diagonal causal mask (or the
    padded one) and K/V repeated, and against SDPA's ``is_causal`` on the same row unpacked
    (the least an unpacked row costs). Forms: N documents of equal length (N = 1: the batch
    turned out unpacked, the op's one causal call), and a row whose first quarter is padding.
    Time and peak memory side by side; the ratios are SDPA's time over the op's: the data for a
    GPU crossover of such calls (none yet: ``fa2.no_left_bound_unmeasured``)."""
    import torch
    import torch.nn.functional as F

    from compile_pass import sliding_window_attention

    groups = heads // kv_heads
    say(
        f"# packed full-attention layer, fwd+bwd, bf16, batch 1, {heads} heads, {kv_heads} kv heads, causal; "
        f"interleaved median of {repeats}, ms; peak GiB of one call; ratio = sdpa / op"
    )
    say(
        f"{'D':>4} {'form':>9} {'S':>6} {'sdpa mask':>10} {'GiB':>6} {'is_causal':>10} {'op':>9} {'GiB':>6} "
        f"{'mask/op':>8} {'causal/op':>9}"
    )

    def one_case(head_dim, form, seq):
        gen = torch.Generator(device=device).manual_seed(seq)

        def storage(count):
            return torch.randn(1, seq, count, head_dim, device=device, dtype=torch.bfloat16, generator=gen)

        q, k, v = (storage(h).transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad_out = storage(heads).transpose(1, 2)
        positions = torch.arange(seq, device=device)
        causal = positions[None, :] <= positions[:, None]
        if form == "padded":
            valid = positions >= seq // 4
            mask, masks = causal & valid[None, :], {"key_padding": valid[None]}
        else:
            ids = positions * int(form.split()[0]) // seq
            mask, masks = causal & (ids[None, :] == ids[:, None]), {"segment_ids": ids[None]}

        def sdpa(**how):
            def step():
                out = F.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), **how
                )
                torch.autograd.grad(out, (q, k, v), grad_out)

            return step

        def op():
            out = sliding_window_attention(q, k, v, window=(-1, 0), **masks)
            torch.autograd.grad(out, (q, k, v), grad_out)

        steps = {"mask": sdpa(attn_mask=mask[None, None]), "causal": sdpa(is_causal=True), "op": op}
        ms = layer_medians_ms(say, seq, steps, repeats)
        if ms is None:
            return
        peaks = {}
        for name in ("mask", "op"):
            torch.cuda.reset_peak_memory_stats()
            steps[name]()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        say(
            f"{head_dim:4d} {form:>9} {seq:6d} {ms['mask']:10.2f} {peaks['mask']:6.2f} {ms['causal']:10.2f} "
            f"{ms['op']:9.2f} {peaks['op']:6.2f} {ms['mask'] / ms['op']:7.2f}x {ms['causal'] / ms['op']:8.2f}x"
        )

    forms = [f"{count} docs" for count in PACKED_COUNTS] + ["padded"]
    for head_dim in head_dims:
        for form in forms:
            for seq in seqs:
                one_case(head_dim, form, seq)  # its tensors freed before the next
