"""The ``global`` section: a global layer (head_dim 512, causal; plain, padded, packed) on the
wide-head Triton kernel and ffpa-attn's against SDPA and FlexAttention (the data for
``wide_head.CROSSOVERS`` and ``ffpa.CROSSOVERS``), then a soft-capped layer (Gemma-2's cap)
against eager attention and FlexAttention with the cap; under each shape, the tiles the
wide-head kernels picked on this GPU."""

from __future__ import annotations

from .common import HEADS, KV_HEADS, Printer, layer_medians_ms

GLOBAL_HEAD_DIM = 512
# FlexAttention's tiles that compile at head_dim 512 on an H100 (NeMo-Automodel's Gemma-4 path;
# shared/REFERENCE.md, section 10), forward and backward, with BlockMask blocks of 32 x 32.
FLEX_TILES = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_M1=32, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=32, num_stages=1, num_warps=4)
FLEX_BLOCK = (32, 32)
PACKED_DOCUMENTS = 4


def global_masks(form: str, seq: int, device: str):
    """One form of a global layer's causal mask, batch 1: (key_padding, segment_ids, SDPA's
    boolean mask or None for ``is_causal``, Flex's mask_mod, the (query, key) pairs it shows).
    ``padded``: the first quarter of the row is padding (left padding); ``packed``: the row
    holds PACKED_DOCUMENTS documents of equal length."""
    import torch

    positions = torch.arange(seq, device=device)
    if form == "causal":
        return None, None, None, lambda b, h, q, kv: kv <= q, seq * (seq + 1) // 2
    if form == "padded":
        pad = seq // 4
        key_padding = (positions >= pad)[None]
        valid = key_padding[0]
        mask = (positions[None, :] <= positions[:, None]) & valid[None, :]
        return key_padding, None, mask, lambda b, h, q, kv: (kv <= q) & valid[kv], (seq - pad) * (seq - pad + 1) // 2
    length = -(-seq // PACKED_DOCUMENTS)
    documents = positions // length
    mask = (positions[None, :] <= positions[:, None]) & (documents[None, :] == documents[:, None])
    lengths = torch.bincount(documents).tolist()
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return None, documents[None], mask, lambda b, h, q, kv: (kv <= q) & (documents[kv] == documents[q]), pairs


def global_layers(
    say: Printer, seqs: list[int], repeats: int, device: str = "cuda", heads: int = HEADS, kv_heads: int = KV_HEADS
) -> None:
    """A global layer (head_dim 512, GQA, causal; plain, padded and packed), fwd+bwd: the
    wide-head Triton kernel (kernels/wide_head/__init__.py, called directly as the op's kernel), and
    ffpa-attn's (kernels/ffpa.py, likewise) where it loads, against what transformers runs, SDPA
    with K/V repeated to the query heads (it passes ``enable_gqa`` only up to head_dim 256,
    and SDPA then picks its memory-efficient kernel), and against
    FlexAttention compiled with 32 x 32 tiles. Time, TFLOP/s and peak memory side by side.

    TFLOP/s counts the useful work: 14 x pairs x D x H FLOPs, where pairs are the (query, key)
    pairs the mask shows: the forward's two matmuls (Q K^T, P V) and the backward's five (Q K^T
    again, dO V^T, P^T dO, dS^T Q, dS K), each 2 x pairs x D x H. For a causal row, pairs ~
    S^2 / 2: 7 x S^2 x D x H, shared/REFERENCE.md's 3.5 x 2 x S^2 x D x H."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compile_pass.kernels import ffpa, wide_head
    from compile_pass.kernels.contract import AttentionCall

    groups = heads // kv_heads
    on_gpu = device == "cuda"
    # Compiled on the GPU; eager (its reference path) in a CPU dry run, which proves the calls only.
    flex = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention
    if not on_gpu:
        say("# (dry run: Flex eager and forward only, as the CPU has no Flex backward)")
    ffpa_missing = ffpa.cannot_run(torch.device(device), torch.bfloat16, GLOBAL_HEAD_DIM)
    if ffpa_missing:
        say(f"# ffpa-attn not timed: {ffpa_missing}")
    ffpa_columns = "" if ffpa_missing else f" | {'ffpa ms':>9} {'TF/s':>6} {'GiB':>6} {'sdpa/ffpa':>9}"
    say(
        f"# global layer, fwd+bwd, bf16, batch 1, {heads} heads, {kv_heads} kv heads, head_dim {GLOBAL_HEAD_DIM}, "
        "causal "
        f"(padded: a quarter of the row left-padded; packed: {PACKED_DOCUMENTS} documents); interleaved median of "
        f"{repeats}, ms; TFLOP/s = 14 x visible pairs x D x H / time; peak GiB of one call"
    )
    say(
        f"{'form':>7} {'S':>6} | {'kernel ms':>9} {'TF/s':>6} {'GiB':>6} | {'sdpa backend':>20} {'ms':>8} {'TF/s':>6} "
        f"{'GiB':>6} | {'flex32 ms':>9} {'TF/s':>6} {'GiB':>6} | {'sdpa/kernel':>11} {'flex/kernel':>11}{ffpa_columns}"
    )

    def one_case(form, seq):
        gen = torch.Generator(device=device).manual_seed(seq)

        def storage(h):
            return torch.randn(1, seq, h, GLOBAL_HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)

        q, k, v = (storage(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad_out = storage(heads)
        q_, k_, v_, grad_out_ = (x.transpose(1, 2) for x in (q, k, v, grad_out))
        key_padding, segment_ids, mask, mask_mod, pairs = global_masks(form, seq, device)
        # Compiled on the GPU: built eagerly, a 32k mask holds S^2 intermediates.
        block_mask = create_block_mask(
            mask_mod, 1, None, seq, seq, device=device, BLOCK_SIZE=FLEX_BLOCK, _compile=on_gpu
        )
        scale = GLOBAL_HEAD_DIM**-0.5
        call = AttentionCall(q_.detach(), k_.detach(), v_.detach(), -1, 0, scale, key_padding, segment_ids)

        def step_of(chosen):  # the op's kernel called as the op calls it, forward and backward
            def step():
                plan = chosen.plan(call)
                out, lse = chosen.forward(call, plan)
                chosen.backward(call, plan, grad_out_, out, lse)

            return step

        def repeated_kv():
            return k_.repeat_interleave(groups, dim=1), v_.repeat_interleave(groups, dim=1)

        def sdpa():
            k_full, v_full = repeated_kv()
            out = F.scaled_dot_product_attention(
                q_,
                k_full,
                v_full,
                attn_mask=None if mask is None else mask[None, None],
                is_causal=mask is None,
                scale=scale,
            )
            torch.autograd.grad(out, (q, k, v), grad_out_)

        def flex_step():
            if not on_gpu:  # Flex has no backward on the CPU: the dry run calls its forward only
                return flex(
                    q_.detach(),
                    k_.detach(),
                    v_.detach(),
                    block_mask=block_mask,
                    scale=scale,
                    enable_gqa=True,
                    kernel_options=FLEX_TILES,
                )
            out = flex(q_, k_, v_, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=FLEX_TILES)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        k_full, _ = repeated_kv()
        backend = torch._fused_sdp_choice(
            q_, k_full, k_full, None if mask is None else mask[None, None], 0.0, mask is None, scale=scale
        )
        backend = torch.nn.attention.SDPBackend(backend).name
        del k_full
        steps = {"kernel": step_of(wide_head.WIDE_HEAD), "sdpa": sdpa, "flex": flex_step}
        if not ffpa_missing:
            steps["ffpa"] = step_of(ffpa.FFPA_ATTN)
        peaks = {}
        try:
            for name, step in steps.items():
                step()  # compiles Flex; the kernels' first launch
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        except torch.cuda.OutOfMemoryError:
            say(f"{form:>7} {seq:6d} out of memory")
            torch.cuda.empty_cache()
            return
        ms = layer_medians_ms(say, seq, steps, repeats)
        if ms is None:
            return
        flops = 14 * pairs * GLOBAL_HEAD_DIM * heads
        tflops = {name: flops / (value * 1e-3) / 1e12 for name, value in ms.items()}
        say(
            f"{form:>7} {seq:6d} | {ms['kernel']:9.2f} {tflops['kernel']:6.1f} {peaks['kernel']:6.2f} | {backend:>20} "
            f"{ms['sdpa']:8.2f} {tflops['sdpa']:6.1f} {peaks['sdpa']:6.2f} | {ms['flex']:9.2f} {tflops['flex']:6.1f} "
            f"{peaks['flex']:6.2f} | {ms['sdpa'] / ms['kernel']:10.2f}x {ms['flex'] / ms['kernel']:10.2f}x"
            + (
                ""
                if ffpa_missing
                else f" | {ms['ffpa']:9.2f} {tflops['ffpa']:6.1f} {peaks['ffpa']:6.2f} {ms['sdpa'] / ms['ffpa']:8.2f}x"
            )
        )
        say(tile_picks(call))

    for form in ("causal", "padded", "packed"):
        for seq in seqs:
            one_case(form, seq)


def tile_picks(call) -> str:
    """The tiles each wide-head kernel ran at for this call: the pick the kernel measured on this
    device (``wide_head_tiles.picks``), or, where nothing was measured (interpreted), the first
    config that fits."""
    from compile_pass.kernels import wide_head
    from compile_pass.kernels.wide_head import tiles as wide_head_tiles

    picks = wide_head_tiles.picks()
    masked = call.key_padding is not None or call.segment_ids is not None
    first = wide_head.WIDE_HEAD.candidates(call.query.device, call.query.dtype, call.query.shape[-1], masked)[0]
    ran = {name: picks.get(wide_head.tune_key(name, call)) for name in ("forward", "dV", "dK", "dQ")}
    how = "measured on this device" if all(ran.values()) else "not all measured: the first config that fits ran"
    cells = ", ".join(f"{name} {tuple(tiles or first)}" for name, tiles in ran.items())
    return f"#   tiles (stationary, streamed, d_chunk, warps, stages), {how}: {cells}"


SOFTCAP = 50.0  # Gemma-2's attention cap
SOFTCAP_HEAD_DIMS = (128, 256)


def softcap_layers(
    say: Printer, seqs: list[int], repeats: int, device: str = "cuda", heads: int = HEADS, kv_heads: int = KV_HEADS
) -> None:
    """A soft-capped causal layer (Gemma-2's: ``cap * tanh(scores / cap)``, cap 50) at head_dim
    128 and 256, fwd+bwd, bf16: the wide-head Triton kernel (called as the op calls it) against
    what transformers runs for such models (eager attention: K/V repeated, the S^2 scores, tanh,
    the causal mask, softmax in fp32), against FlexAttention with the cap as its score_mod, and
    beside torch's FA2 on the same layer without the cap (SDPA ``is_causal``: no torch kernel
    caps), which says what the cap costs. Time and peak memory side by side; the tiles picked."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compile_pass.kernels import wide_head
    from compile_pass.kernels.contract import AttentionCall

    groups = heads // kv_heads
    on_gpu = device == "cuda"
    flex = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention
    say(
        f"# soft-capped causal layer (cap {SOFTCAP:g}), fwd+bwd, bf16, batch 1, {heads} heads, {kv_heads} kv heads; "
        f"interleaved median of {repeats}, ms; peak GiB of one call; 'sdpa, no cap': the layer without the cap"
    )
    say(
        f"{'D':>4} {'S':>6} | {'kernel ms':>9} {'GiB':>6} | {'eager ms':>9} {'GiB':>6} | {'flex ms':>9} {'GiB':>6} | "
        f"{'sdpa, no cap':>12} | {'eager/kernel':>12} {'flex/kernel':>11} {'kernel/no cap':>13}"
    )

    def one_case(head_dim, seq):
        gen = torch.Generator(device=device).manual_seed(seq)

        def storage(h, head_dim=head_dim, seq=seq, gen=gen):
            return torch.randn(1, seq, h, head_dim, device=device, dtype=torch.bfloat16, generator=gen)

        q, k, v = (storage(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad_out = storage(heads)
        q_, k_, v_, grad_out_ = (x.transpose(1, 2) for x in (q, k, v, grad_out))
        scale = head_dim**-0.5
        call = AttentionCall(q_.detach(), k_.detach(), v_.detach(), -1, 0, scale, softcap=SOFTCAP)
        block_mask = create_block_mask(lambda b, h, i, j: j <= i, 1, None, seq, seq, device=device, _compile=on_gpu)

        def kernel_step(call=call):
            plan = wide_head.WIDE_HEAD.plan(call)
            out, lse = wide_head.WIDE_HEAD.forward(call, plan)
            wide_head.WIDE_HEAD.backward(call, plan, grad_out_, out, lse)

        def eager(seq=seq, q_=q_, k_=k_, v_=v_, grad_out_=grad_out_, q=q, k=k, v=v):
            scores = q_ @ k_.repeat_interleave(groups, dim=1).mT * scale
            scores = torch.tanh(scores / SOFTCAP) * SOFTCAP
            causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores.float(), dim=-1).to(q_.dtype)
            out = probs @ v_.repeat_interleave(groups, dim=1)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        def capped(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        def flex_step(q_=q_, k_=k_, v_=v_, grad_out_=grad_out_, q=q, k=k, v=v, block_mask=block_mask):
            if not on_gpu:  # Flex has no backward on the CPU: the dry run calls its forward only
                return flex(q_.detach(), k_.detach(), v_.detach(), capped, block_mask, scale=scale, enable_gqa=True)
            out = flex(q_, k_, v_, capped, block_mask, scale=scale, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        def uncapped(q_=q_, k_=k_, v_=v_, grad_out_=grad_out_, q=q, k=k, v=v):
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        steps = {"kernel": kernel_step, "eager": eager, "flex": flex_step, "no cap": uncapped}
        peaks = {}
        for name, step in steps.items():
            try:
                step()  # compiles Flex; the kernels' first launch (which measures their tiles)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            except torch.cuda.OutOfMemoryError:
                peaks[name] = float("nan")
                torch.cuda.empty_cache()
        ms = layer_medians_ms(say, seq, {name: steps[name] for name in steps if peaks[name] == peaks[name]}, repeats)
        if ms is None:
            return
        ms = {name: ms.get(name, float("nan")) for name in steps}  # nan: out of memory
        say(
            f"{head_dim:4d} {seq:6d} | {ms['kernel']:9.2f} {peaks['kernel']:6.2f} | {ms['eager']:9.2f} "
            f"{peaks['eager']:6.2f} | {ms['flex']:9.2f} {peaks['flex']:6.2f} | {ms['no cap']:12.2f} | "
            f"{ms['eager'] / ms['kernel']:11.2f}x {ms['flex'] / ms['kernel']:10.2f}x "
            f"{ms['kernel'] / ms['no cap']:12.2f}x"
        )
        say(tile_picks(call))

    for head_dim in SOFTCAP_HEAD_DIMS:
        for seq in seqs:
            one_case(head_dim, seq)
