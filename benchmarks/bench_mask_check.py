"""What the exact check of a mask input costs, next to the attention it lets run as a band.

Where a mask reaches the attention layers as a graph input (FSDP2, regional compilation,
graph breaks, a static cache), each graph call checks it once (``compile_pass::mask_facts``)
before its rewritten calls read the facts. This times, in one process, on one mask:

- ``check``: ``mask_facts(mask)`` on a (1, 1, S, S) sliding-window mask (window 512, no
  padding), the median of ``--repeats`` calls;
- ``op layer``: one sliding layer as the rule runs it (``mask_input_attention_forward`` on the
  band path, forward + backward), with bench_model.py's sizes (8 query heads, 4 KV heads,
  head_dim 64, fp32, batch 1);
- ``sdpa layer``: the same layer as SDPA with the mask, forward + backward.

``check / op`` is the check's cost relative to the layer it serves: under regional
compilation or FSDP2 every layer is a graph call of its own, so a step pays one check per
layer; in one whole-model graph, one check per mask per step.

    python benchmarks/bench_mask_check.py                 # S = 2048 4096 8192
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The package next to this script, not whichever checkout an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from measure import median_seconds  # noqa: E402

from compile_pass.ops.runtime_mask import mask_facts, mask_input_attention_forward  # noqa: E402

WINDOW, HEADS, KV_HEADS, HEAD_DIM = 512, 8, 4, 64
# mask_facts' reads of the whole (B, Sq, Sk) bool mask (check_mask): the largest byte, the
# largest byte of each 64-key block, the keys each column's rows see, and the count of
# visible entries; the rest reads (B, Sq, 64) or smaller.
PASSES = 4


def sliding_mask(seq: int) -> torch.Tensor:
    i = torch.arange(seq)
    distance = i[None, :] - i[:, None]
    return ((distance <= 0) & (distance > -WINDOW))[None, None].contiguous()


def layer_inputs(seq: int):
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, seq, KV_HEADS, HEAD_DIM, generator=gen).transpose(1, 2).requires_grad_() for _ in range(2))
    return q, k, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"# {torch.get_num_threads()} threads, torch {torch.__version__}; window {WINDOW}, {HEADS}/{KV_HEADS} heads, "
        f"head_dim {HEAD_DIM}, fp32, batch 1; median of {args.repeats}; load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"{'S':>6} {'check ms':>9} {'op layer ms':>12} {'sdpa layer ms':>14} {'check / op':>11} {'check / sdpa':>13} "
        f"{'MiB moved':>10}"
    )
    for seq in args.seqs:
        print(length_row(seq, args.repeats))


def length_row(seq: int, repeats: int) -> str:
    """One length's row: the check, and a layer's forward and backward through the op and SDPA."""
    scale = HEAD_DIM**-0.5
    mask = sliding_mask(seq)
    facts, padding = mask_facts(mask)
    assert facts.tolist()[:3] == [1, WINDOW - 1, 0], facts  # the check reads the band
    q, k, v = layer_inputs(seq)

    def op_layer():
        out = mask_input_attention_forward(q, k, v, mask, facts, padding, scale, True)[0]
        torch.autograd.grad(out.sum(), (q, k, v))

    def sdpa_layer():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        torch.autograd.grad(out.sum(), (q, k, v))

    def check_mask():
        mask_facts(mask)

    for warm in (op_layer, sdpa_layer, check_mask):
        warm()
    check = median_seconds(check_mask, repeats)
    op = median_seconds(op_layer, repeats)
    sdpa = median_seconds(sdpa_layer, repeats)
    moved = PASSES * mask.numel() / 2**20
    return (
        f"{seq:>6} {check * 1e3:>9.1f} {op * 1e3:>12.1f} {sdpa * 1e3:>14.1f} {check / op:>10.1%} "
        f"{check / sdpa:>12.1%} {moved:>10.0f}"
    )


if __name__ == "__main__":
    main()
