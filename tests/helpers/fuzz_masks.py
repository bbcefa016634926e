"""An adversarial differential fuzzer for the rules: random programs that build an attention
mask, compiled through compile_pass's rewrite, run at three sequence lengths and compared
with eager, forward and (for a share) gradients.

A program is Python source built from a seed, so any failure is reproducible from its seed
alone (``python benchmarks/fuzz_soundness.py --seed N --show``). The grammar covers what
users and transformers write, and what an adversary would try:

- index arithmetic over aranges, offsets, large constants (near 2**31, 2**62, 2**63), slices
  with symbolic and negative starts, negative int indices, gathers (some wrapping), cumsum
  and diff, casts to int32 and small dtypes, graph-input positions and padding;
- every comparison and logic op in operator, ``torch.*`` and method spellings;
- views and in-place writes through them (narrow, select, unsqueeze, unfold, diagonal,
  flatten, movedim, .T/.mT, setitem, clamp_, neg_), on positions, on the mask and on the
  padding after the mask is built;
- transformers' ``masking_utils.sdpa_mask`` with and_masks/or_masks, sliding, chunked,
  padding and packed-sequence mask functions, with and without vmap;
- top-k masks: scatter values that round or truncate to 0, reduce=, keyword arguments,
  writes to the zero mask, the validity form, no-op fills;
- additive (float) masks: ``where``/``masked_fill``/product/``log`` spellings of a boolean
  mask with -inf, the dtype's minimum and wrong or non-finite fills, and ``full().triu/tril``
  with writes to the filled tensor first; scaled queries, so large fills matter;
- views of the result that need SDPA's layout (``.view(B, -1)``);
- what the runtime edge needs (issue 20): masks passed in as inputs (``extra["mask"]``: bands,
  with padding or a hidden key, causal, all visible, one entry off, random), written in the
  graph before or between two calls; a key hidden from every row; scales 0, negative, inf,
  nan and small; padded query rows compared like any other;
- key padding read from a cache's first token on (a longer padding's columns from a
  number, a size, the Python-int ``offset``, or a gather that may wrap);
- a packed batch's chunked layer: document ids from the input positions AND chunks of
  position values AND causal over positions, with near misses;
- inputs written through numpy between forward and backward (seeds with gradients, odd
  seeds), which eager's activation-checkpoint recomputation reads again;
- what an adversarial review found beyond the first grammar: several segment-id tensors
  cumsummed from the same input positions (one of them written), a checkpoint body whose
  opaque values share node names with its parent's, two inputs shown by one name
  (``padding`` and ``extra["padding"]``), and Python-int position offsets traced with
  ``dynamic=True`` (up to 2**63 - 8).

- attention spelled out in ops (seed % 9 == 2): eager attention and GPT-OSS's sink column over
  a sliding band (additive, or a boolean one filled in) in several spellings of each step, with
  near misses: a negative, NaN or inverted scale, wrong fills, the band itself hidden, the sink
  sliced off the wrong end or put first, a max over another tensor or the query axis, a
  softmax over the query axis or narrowed to float32, the probabilities used again; scores
  soft-capped (Gemma-2's tanh, several caps and spellings; a cap from the data, a divisor and
  a multiplier that differ, a sine); a sink column per (batch, head, row) (Inkling2's) and its
  broadcast near misses; Granite-SWA's logsumexp scaling, per head or per row, with the sink
  not subtracted, the logsumexp of the unmasked scores, a tanh for the sigmoid.

- the second round (issue 58), from a stream of its own: key padding read from a buffer the
  program creates and fills in place (shifted right as a decoder's ids, copied, filled by a
  boolean index), with near misses (a read before its last write used elsewhere, the buffer or
  a view of it leaving the graph, a write after the mask read it); two-sided windows as
  transformers spells them (``abs(kv - q) < w`` OR the causal band, a negated difference),
  with near misses (an ``abs`` of something that is not ``kv - q``); spelled-out attention over
  a window of packed position values, checked at run time, the positions sometimes out of the
  checked range or near int64's minimum (the fallback then computes the chain).

Every generated program either runs in eager mode (then the compiled run must match it at
every output position, padded query rows included, and raise nothing) or is discarded as
invalid (counted).
"""

from __future__ import annotations

import collections
import random
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import masking_utils

from tests.helpers.models import Capture, packed_window_function

LENGTHS = (16, 11, 23)
# Lengths the measurement takes (64 keys and up, in three buckets: 64, 96, 128), for the mode that
# decides by measuring on this machine (``check(..., lengths=MEASURED_LENGTHS)``).
MEASURED_LENGTHS = (96, 64, 130)
BATCH, HEADS, HEAD_DIM = 2, 2, 8
MIN = torch.finfo(torch.float64).min
SMALL = list(range(-6, 9))
LARGE = [2**31 - 1, 2**31, -(2**31), 2**32, 2**62, -(2**62), 2**63 - 1, -(2**63), 2**63 - 2]
COMPARISONS = [("<", "lt"), ("<=", "le"), (">", "gt"), (">=", "ge"), ("==", "eq"), ("!=", "ne")]


class _Writer:
    """Source lines and fresh variable names."""

    def __init__(self, rng: random.Random, variants: random.Random | None = None, added: random.Random | None = None):
        self.rng = rng
        # Draws of forms added to the grammar later: from their own stream, so that the main
        # one, and every program drawn before they were added, stays as it was.
        self.variants = variants or random.Random(0)
        # The second round's forms (filled buffers, two-sided windows): a stream of their own likewise.
        self.added = added or random.Random(1)
        self.lines: list[str] = []
        self.count = 0
        # Decoding with a cache: the last Lq of L positions query all L keys.
        self.decoding = rng.random() < 0.2
        # Set when a position reads the Python-int ``offset``: traced with dynamic=True.
        self.reads_offset = False
        self.forms: list[str] = []  # other forms used, for the summary

    def let(self, expr: str) -> str:
        self.count += 1
        name = f"t{self.count}"
        self.lines.append(f"{name} = {expr}")
        return name

    def do(self, statement: str) -> None:
        self.lines.append(statement)

    def pick(self, options):
        return self.rng.choice(options)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def constant(self) -> int:
        return self.pick(LARGE) if self.chance(0.12) else self.pick(SMALL)


# -- index arithmetic masks -----------------------------------------------------------------


def _positions(w: _Writer) -> str:
    """A 1-D integer tensor of L positions (or something position-like)."""
    c = w.pick([1, 2, 3, 5, 7])
    source = w.pick(
        [
            "torch.arange(L)",
            "torch.arange(L)",
            "torch.arange(L)",
            f"torch.arange(L) + {w.constant()}",
            f"torch.arange({c}, L + {c})",
            "torch.arange(L, dtype=torch.int32)",
            f"torch.arange(L).to(torch.{w.pick(['int32', 'int16', 'uint8', 'int8', 'int64'])})",
            f"torch.arange(2 * L)[L - {c}:][:L]",
            f"torch.arange(L + {c})[{c}:]",
            f"torch.arange(L + {c})[-L:]",
            "(torch.ones(L, dtype=torch.long).cumsum(0) - 1)",
            "(torch.ones_like(positions[0]).cumsum(-1) - 1)",
            f"positions[{w.pick([0, 1, -1])}]",
            f"torch.arange(L)[torch.arange(L) - {w.pick([0, 1])}]",
            f"torch.arange(L)[(torch.arange(L) + {c}) % L]",
            "torch.diff(torch.arange(L + 1), prepend=torch.zeros(1, dtype=torch.long)).cumsum(0) - 1",
            f"torch.arange(L) * {w.pick([1, 2, 2**30, 2**61])}",
            "torch.arange(L) + offset",
            "torch.arange(L) + offset",
            "torch.arange(L) + offset",
            # Floats: exact small integers, and ones that round (bf16 past 256, fp32 past 2**24).
            "torch.arange(L).float()",
            f"torch.arange(L).to(torch.{w.pick(['float16', 'bfloat16', 'float64'])})",
            f"torch.arange(L, dtype=torch.{w.pick(['float32', 'bfloat16'])}) * {w.pick([1, 3, 200])}",
            "(torch.arange(L) + "
            f"{w.pick([250, 2**24 - 3, 2**11 - 2])}).to(torch.{w.pick(['float32', 'bfloat16', 'float16'])})",
            "(torch.ones(L).cumsum(0) - 1)",
            "torch.tril(torch.ones(L, L)).sum(-1) - 1",
        ]
    )
    w.reads_offset |= "offset" in source
    if any(word in source for word in ("float", "bfloat16", "torch.ones(L)", "torch.tril(torch.ones")):
        w.forms.append("float_positions")
    name = w.let(source)
    if w.chance(0.12):
        _write_positions(w, name)
    return name


def _write_positions(w: _Writer, name: str) -> None:
    w.do(
        w.pick(
            [
                f"torch.narrow({name}, 0, 0, 1).fill_(3)",
                f"{name}.select(0, 1).fill_(7)",
                f"torch.unsqueeze({name}, 0).add_(1)",
                f"torch.clamp_({name}, max=5)",
                f"{name}[1:3] += 2",
                f"{name}.unfold(0, 1, 1).mul_(2)",
                f"torch.neg_({name})",
                f"{name}.add_(0)",
            ]
        )
    )


def _as_query(w: _Writer, p: str) -> str:
    return w.let(
        w.pick([f"{p}[:, None]", f"{p}.unsqueeze(1)", f"{p}.view(-1, 1)", f"{p}.reshape(-1, 1)", f"{p}[..., None]"])
    )


def _as_key(w: _Writer, p: str) -> str:
    return w.let(w.pick([f"{p}[None, :]", f"{p}.unsqueeze(0)", f"{p}[None]", f"{p}.view(1, -1)"]))


def _comparison(w: _Writer, qi: str, ki: str) -> str:
    distance = w.pick(
        [
            f"({ki} - {qi})",
            f"({ki} - {qi})",
            f"({qi} - {ki})",
            ki,
            qi,
            f"({ki} + {qi})",
            f"({ki} - {qi}) * {w.pick([2, 3, 2**30, 2**31, 2**62])}",
            f"({ki} - {qi} + {w.constant()})",
            f"torch.abs({ki} - {qi})",
            f"({ki} - {qi}).abs()",
            f"torch.sub({ki}, {qi})",
        ]
    )
    distance = f"({distance})"
    bound = w.constant()
    symbol, name = w.pick(COMPARISONS)
    return w.pick(
        [
            f"({distance} {symbol} {bound})",
            f"({distance} {symbol} {bound})",
            f"torch.{name}({distance}, {bound})",
            f"{distance}.{name}({bound})",
        ]
    )


def _near_band(w: _Writer, qi: str, ki: str) -> list[str]:
    """The two bounds of a sliding window in the spellings real code uses, with windows
    and offsets that are sometimes off by one or very large."""
    left, right = w.pick([1, 2, 3, 4, 7]), w.pick([0, 0, 0, 1, 2])
    if w.chance(0.1):
        left = w.pick(LARGE)
    lower = w.pick(
        [
            f"({ki} > {qi} - {left + 1})",
            f"({ki} >= {qi} - {left})",
            f"({qi} - {ki} < {left + 1})",
            f"(({ki} - {qi}) >= -{left})",
            f"torch.gt({ki}, {qi} - {left + 1})",
            f"{ki}.ge({qi} - {left})",
            f"(({ki} - {qi}).abs() <= {left})",
            f"(torch.abs({qi} - {ki}) < {left + 1})",
        ]
    )
    upper = w.pick(
        [
            f"({ki} <= {qi} + {right})",
            f"({ki} < {qi} + {right + 1})",
            f"({ki} - {qi} <= {right})",
            f"torch.le({ki}, {qi} + {right})",
            f"{ki}.le({qi} + {right})",
            f"({qi} >= {ki} - {right})",
        ]
    )
    if w.added.random() < 0.15:
        return [_two_sided(w, qi, ki, left, right)]
    return [lower, upper]


def _two_sided(w: _Writer, qi: str, ki: str, left: int, right: int) -> str:
    """A two-sided window as transformers spells one (Gemma-3 trained bidirectionally: an
    ``abs`` OR its causal band; a negated difference), with near misses: an ``abs`` of
    something that is not ``kv - q``."""
    w.forms.append("two_sided")
    width = left + 1
    return w.added.choice(
        [
            f"((torch.abs({ki} - {qi}) < {width}) | (({ki} <= {qi}) & ({ki} > {qi} - {width})))",
            f"((({ki} - {qi}).abs() <= {left}) | (({ki} <= {qi}) & ({ki} > {qi} - {width})))",
            f"(({ki} - {qi}).abs() <= {left})",
            f"((-({qi} - {ki}) <= {right}) & (torch.abs({ki} - {qi}) < {width}))",
            f"(torch.abs({ki} + {qi}) < {width})",  # near misses: not a distance
            f"(torch.abs({ki} - 2 * {qi}) < {width})",
            f"((torch.abs({ki} - {qi}) < {width}) | ({ki} * {qi} > 3))",
        ]
    )


def _logic(w: _Writer, terms: list[str]) -> str:
    expr = terms[0]
    for term in terms[1:]:
        expr = w.pick(
            [
                f"({expr} & {term})",
                f"({expr} & {term})",
                f"({expr} & {term})",
                f"({expr} | {term})",
                f"({expr} ^ {term})",
                f"torch.logical_and({expr}, {term})",
                f"torch.logical_or({expr}, {term})",
                f"{expr}.logical_and({term})",
                f"torch.logical_xor({expr}, {term})",
            ]
        )
    if w.chance(0.1):
        expr = w.pick([f"(~{expr})", f"torch.logical_not({expr})", f"{expr}.logical_not()"])
    return expr


def _write_mask(w: _Writer, mask: str) -> None:
    w.do(
        w.pick(
            [
                f"torch.diagonal({mask}, -{w.pick([1, 3, 5])}).fill_(True)",
                f"{mask}.T.copy_({mask}.clone())",
                f"{mask}.mT.copy_({mask}.clone())",
                f"torch.movedim({mask}, 0, 1).copy_({mask}.clone())",
                f"{mask}[:, 0] = True",
                f"torch.flatten({mask})[:{w.pick([3, 7])}].fill_(True)",
                f"{mask}.masked_fill_({mask}, True)",
                f"{mask}.logical_not_()",
            ]
        )
    )


def _hide_a_key(w: _Writer, mask: str, ki: str) -> str:
    """One key hidden from every row: not padding, a token nobody attends."""
    w.forms.append("hidden_key")
    c = w.pick([0, 2, 5, -1])
    return w.let(w.pick([f"({mask} & ({ki} != {c}))", f"({mask} & (torch.arange(L) != {c} % L)[None, :])"]))


def _padding(w: _Writer, mask: str) -> str:
    key_padding = w.pick(
        [
            "(padding[:, None, None, :] != 0)",
            "padding[:, None, None, :].bool()",
            "padding[:, None, None, :].to(torch.bool)",
            "(padding[0][None, None, None, :] != 0)",
            "(padding[:, None, :, None] != 0)",  # a query padding: not what the op takes
            "(padding[:, None, None, :] > 0)",
            "(padding[:, None, None, :] == 1)",
            '(extra["padding"][:, None, None, :] != 0)',
            '((padding[:, None, None, :] != 0) & (extra["padding"][:, None, None, :] != 0))',
        ]
    )
    if w.chance(0.25):  # the padding of a longer batch, read from a cache's first token on
        key_padding = f"({_shifted_padding(w)}[:, None, None, :] != 0)"
    buffer = None
    if w.added.random() < 0.2:
        key_padding, buffer = _filled_buffer(w)
    combined = w.let(f"({mask} & {key_padding})")
    if buffer is not None and w.added.random() < 0.2:  # written after the mask read it
        w.forms.append("buffer_near_miss")
        w.do(w.added.choice([f"{buffer}[:, 2] = 0", f"{buffer}.fill_(1)", f"{buffer}[0].zero_()"]))
    if w.chance(0.15):
        w.do(w.pick(["padding[:, 1] = 0", "padding.fill_(1)", "padding[0].zero_()", 'extra["long_padding"][:, 6] = 0']))
    return combined


def _filled_buffer(w: _Writer) -> tuple[str, str]:
    """(a key padding read from a buffer the program creates and fills in place, the buffer):
    the padding shifted right as a decoder's ids are, copied, or filled by a boolean index;
    near misses (some draws) read it before its last write for another use, or let it or a
    view of it leave the graph."""
    w.forms.append("filled_buffer")
    r = w.added
    make = r.choice(
        [
            "padding.new_zeros(padding.shape)",
            "torch.zeros_like(padding)",
            "torch.empty_like(padding)",
            "torch.full(padding.shape, 3, dtype=padding.dtype)",
            "padding.new_ones(padding.shape)",
        ]
    )
    buffer = w.let(make)
    fills = r.choice(
        [
            [f"{buffer}[:, 1:] = padding[:, :-1]", f"{buffer}[:, 0] = 1"],
            [
                f"{buffer}[..., 1:] = padding[..., :-1].clone()",
                f"{buffer}[..., 0] = 1",
                f"{buffer}.masked_fill_({buffer} == -100, 0)",
            ],
            [f"{buffer}.copy_(padding)"],
            [f"{buffer}[:, :].copy_(padding)", f"{buffer}[:, -1] = 0"],
            [f"{buffer}.fill_(1)", f"{buffer}[padding == 0] = 0"],
        ]
    )
    near = r.choice(["", "", "", "read_early", "escapes", "view_escapes"])
    early = None
    for index, line in enumerate(fills):
        if near == "read_early" and index == len(fills) - 1:
            early = w.let(f"({buffer} != 0).sum()")
        w.do(line)
    if near:
        w.forms.append("buffer_near_miss")
    if near == "escapes":
        w.do(f'extra["escaped"] = {buffer}')
    if near == "view_escapes":
        w.do(f'extra["escaped"] = {buffer}[:, 1:]')
    padding = f"({buffer}[:, None, None, :] != 0)"
    if early is not None:
        padding = f"({padding} & ({early} >= 0))"
    return padding, buffer


def _shifted_padding(w: _Writer) -> str:
    """L columns of ``extra["long_padding"]`` (L + 5 tokens), from a start that is a number, a
    size, the Python-int ``offset`` or a gather (some wrapping), as a prefill chunk after a
    cache reads its attention_mask."""
    w.forms.append("shifted_padding")
    start = w.pick(["5", "2", "0", "offset % 6", "max(offset, 0) % 6", "long.shape[1] - L", "L - 11"])
    w.reads_offset |= "offset" in start
    long = w.let('extra["long_padding"]')
    read = w.pick(
        [
            f"{long}[:, {start} : {start} + L]",
            f"{long}[:, -L:]",
            f"{long}.narrow(1, {start}, L)",
            f"{long}[:, torch.arange(L) + {start}]",
            f"{long}[:, torch.arange(L) - 1]",  # wraps: reads the last token first
            f"{long}[:, {start}:][:, :L]",
            f"{long}[:, 5:]",
        ]
    )
    return w.let(read.replace("long.shape", f"{long}.shape"))


def _index_mask(w: _Writer) -> str:
    p = _positions(w)
    if w.decoding:  # the query rows' positions, aligned to the last keys or (wrongly) not
        qi = _as_query(w, w.let(w.pick([f"{p}[-Lq:]", f"({p}[:Lq] + (L - Lq))", f"{p}[:Lq]", f"{p}[L - Lq:]"])))
    else:
        qi = _as_query(w, p)
    ki = _as_key(w, _positions(w) if w.chance(0.2) else p)
    if not w.decoding and w.chance(0.1):  # nanoGPT's spelling: a sum or difference of tril'd ones
        w.forms.append("tril_difference")
        ones = w.let(f"torch.ones(L, L, dtype=torch.{w.pick(['float32', 'int64', 'int8'])})")
        first, second = w.pick([0, 0, 1, -1, 2]), w.pick([-1, -3, -4, -7, 1, 0])
        terms = [
            f"(torch.tril({ones}, {first}) {w.pick(['-', '-', '+'])} torch.tril({ones}, "
            f"{second})).{w.pick(['bool()', 'ne(0)'])}"
        ]
    elif w.chance(0.5):
        terms = _near_band(w, qi, ki) + ([_comparison(w, qi, ki)] if w.chance(0.2) else [])
    else:
        terms = [_comparison(w, qi, ki) for _ in range(w.pick([1, 2, 2, 2, 3]))]
    mask = w.let(_logic(w, terms))
    if w.chance(0.12):
        _write_mask(w, mask)
    if w.chance(0.1):
        mask = _hide_a_key(w, mask, ki)
    padded = w.chance(0.3)
    if padded:
        mask = _padding(w, mask)  # (B or 1, 1, L, L)
    if w.chance(0.3):
        shapes = [f"{mask}.expand(B, -1, -1, -1)"] if padded else [f"{mask}.expand(B, 1, Lq, L)", f"{mask}[None, None]"]
        mask = w.let(w.pick(shapes))
    if w.chance(0.15):
        mask = w.let(w.pick([f"{mask}.contiguous()", f"{mask}.clone()", f"{mask}.to(q.device)", f"{mask}.bool()"]))
    return mask


# -- transformers' masking_utils --------------------------------------------------------------


def _masking_utils_mask(w: _Writer) -> str:
    window = w.pick([1, 2, 3, 4, 5, 8])
    # One row of positions expanded over the batch (a (1, S) position_ids), sometimes only for
    # the ids: the window then reads other rows' positions than the ids were computed from.
    rows = w.pick(["positions", "positions", "positions[:1].expand(B, -1)"])
    ids_rows = rows if w.chance(0.8) else w.pick(["positions", "positions[:1].expand(B, -1)"])
    function = w.pick(
        [
            f"mu.sliding_window_causal_mask_function({window})",
            f"mu.and_masks(mu.sliding_window_overlay({window}), mu.causal_mask_function)",
            f"mu.or_masks(mu.causal_mask_function, mu.sliding_window_overlay({window}))",
            f"mu.chunked_causal_mask_function({window}, torch.zeros(B, dtype=torch.long))",
            f"mu.sliding_window_bidirectional_mask_function({window})",
            "mu.causal_mask_function",
            f"mu.and_masks(mu.sliding_window_causal_mask_function({window}), mu.padding_mask_function(padding.bool()))",
            f"mu.and_masks(mu.sliding_window_causal_mask_function({window}), "
            f"mu.packed_sequence_mask_function(mu.find_packed_sequence_indices({ids_rows})))",
            f"packed_window_function({window}, {rows}, {ids_rows})",
        ]
    )
    attention_mask = w.pick(["None", "None", "padding.bool()"])
    vmap = w.pick(["False", "False", "True"])
    return w.let(
        f"mu.sdpa_mask(batch_size=B, q_length=Lq, kv_length=L, q_offset=L - Lq, mask_function={function}, "
        f"attention_mask={attention_mask}, allow_is_causal_skip=False, use_vmap={vmap})"
    )


# -- additive masks ----------------------------------------------------------------------------

# Fills that hide a key in a float64 mask, and fills that do not (or not always).
FILLS = ["float('-inf')", "MIN", "torch.finfo(q.dtype).min"]
WRONG_FILLS = ["torch.finfo(torch.float32).min", "-1e30", "-65504.0", "float('nan')", "-1.0", "float('inf')"]


def _fill(w: _Writer) -> str:
    return w.pick(FILLS) if w.chance(0.6) else w.pick(WRONG_FILLS)


# Copies of a float mask (the same values, a copy or an alias), in their spellings.
COPIES = [
    "{m}.contiguous()",
    "{m}.clone()",
    "{m}.detach()",
    "torch.clone({m})",
    "torch.ops.aten.clone.default({m})",
    "torch.ops.aten.alias.default({m})",
    "{m}.to(q.dtype)",
    "{m}.type_as(q)",
    "{m}.to(q.dtype, copy=True)",
    "torch.ops.aten._to_copy.default({m}, dtype=q.dtype)",
]


def _additive(w: _Writer, mask: str) -> str:
    """A float mask adding 0 where the bool ``mask`` is true and a fill elsewhere, in the
    spellings models use, with right and wrong fills; now and then copied, and the mask or its
    copy sometimes written after."""
    additive = _additive_form(w, mask)
    if w.variants.random() >= 0.3:
        return additive
    if "copied_additive" not in w.forms:
        w.forms.append("copied_additive")
    copied = w.let(w.variants.choice(COPIES).format(m=additive))
    if w.variants.random() < 0.25:
        written = w.variants.choice([additive, copied])
        w.do(
            w.variants.choice(
                [f"{written}[..., 0] = 0.0", f"{written}[0].zero_()", f"{written}.detach()[..., -1] = 0.0"]
            )
        )
    return copied


def _additive_form(w: _Writer, mask: str) -> str:
    fill = _fill(w)
    return w.let(
        w.pick(
            [
                f"torch.zeros_like({mask}, dtype=q.dtype).masked_fill(~{mask}, {fill})",
                f"torch.zeros_like({mask}, dtype=q.dtype).masked_fill({mask}.logical_not(), {fill})",
                f"torch.where({mask}, torch.zeros((), dtype=q.dtype), {fill})",
                f"torch.where(~{mask}, torch.tensor({fill}, dtype=q.dtype), 0.0)",
                f"(~{mask}).to(q.dtype) * {fill}",
                f"{fill} * torch.logical_not({mask}).double()",
                f"{mask}.to(q.dtype).log()",  # 0 / -inf through an op the proof does not know
                f"torch.ones_like({mask}, dtype=q.dtype).masked_fill(~{mask}, {fill})",  # visible keys add 1
            ]
        )
    )


def _additive_band(w: _Writer) -> str:
    """A sliding band over plain positions (sometimes with key padding), as an additive mask."""
    i = w.let("torch.arange(L)")
    qi = _as_query(w, w.let(f"{i}[-Lq:]") if w.decoding else i)
    band = w.let(_logic(w, _near_band(w, qi, _as_key(w, i))))
    if w.chance(0.3):
        band = _padding(w, band)
    return _additive(w, band)


def _filled_band(w: _Writer) -> str:
    """``full(fill).triu(d)`` (causal) or ``.tril(-d)`` (keys older than a window), or both
    added, sometimes after writes to the filled tensor."""
    fill = _fill(w)
    aligned = w.pick(["", " + (L - Lq)"]) if w.decoding else ""
    filled = w.let(f"torch.full((Lq, L), {fill}, dtype=q.dtype)")
    if w.chance(0.25):
        w.do(
            w.pick(
                [
                    f"{filled}[:, :{w.pick([1, 3])}].fill_(0.0)",
                    f"{filled}[0].zero_()",
                    f"torch.diagonal({filled}, {w.pick([1, 2])}).fill_(0.0)",
                    f"{filled}.T[0] = 0.0",
                ]
            )
        )
    upper = w.let(f"{filled}.triu({w.pick([1, 1, 0, 2])}{aligned})")
    if w.chance(0.5):
        return upper
    lower = w.let(f"{filled}.tril(-{w.pick([2, 3, 5])}{aligned})")
    return w.let(w.pick([f"{upper} + {lower}", f"torch.minimum({upper}, {lower})"]))


# -- attention spelled out in ops ----------------------------------------------------------------


def _spelled_attention(w: _Writer) -> str:
    """Attention computed as ops (eager attention; GPT-OSS's with a sink column) over a sliding
    band, additive or a boolean one filled in, in the spellings models use, with near misses
    (each drawn now and then): a negative or odd scale, a wrong fill, the band itself hidden,
    the sink sliced off the wrong end or put first, a max over another tensor or the query
    axis, a softmax over the query axis, a downcast, the probabilities used again. Returns
    the expression of the attention's output."""

    def either(right: list, near_misses: list, p: float = 0.08):
        return w.pick(near_misses) if w.chance(p) else w.pick(right)

    i = w.let("torch.arange(L)")
    qi = _as_query(w, w.let(f"{i}[-Lq:]") if w.decoding else i)
    band = w.let(_logic(w, _near_band(w, qi, _as_key(w, i))))
    if w.added.random() < 0.2:
        band = _packed_positions_band(w)
    if w.chance(0.4):
        band = _padding(w, band)
    key_t = w.pick(["k.transpose(2, 3)", "k.transpose(-1, -2)", "k.mT", "k.permute(0, 1, 3, 2)", "k.transpose(3, 2)"])
    product = w.pick([f"torch.matmul(q, {key_t})", f"(q @ {key_t})", f"q.matmul({key_t})"])
    scaled = w.let(
        either(
            [f"{product} * 0.3", f"0.3 * {product}", f"{product} / 2.0", product, f"torch.mul({product}, 0.25)"],
            [f"{product} * -0.5", f"{product} * float('nan')", f"2.0 / {product}"],
        )
    )
    fill = w.pick(FILLS) if w.chance(0.9) else w.pick(WRONG_FILLS)
    masked = either(
        ["{s} + {a}", "{a} + {s}", "torch.where({b}, {s}, {f})", "{s}.masked_fill(~{b}, {f})"],
        ["{s}.masked_fill({b}, {f})"],  # hides the band itself
    )
    additive = _additive(w, band) if "{a}" in masked else None
    scaled = _softcap(w, scaled)
    masked = w.let(masked.format(s=scaled, a=additive, b=band, f=fill))
    sink = w.chance(0.5)
    logits = masked
    if sink:
        column = w.pick(
            [
                'extra["sinks"].reshape(1, -1, 1, 1).expand(B, -1, Lq, -1)',
                'extra["sinks"].view(1, -1, 1, 1).expand(B, -1, Lq, 1)',
                'extra["sinks"][None, :, None, None].expand(B, -1, Lq, -1)',
            ]
        )
        if w.variants.random() < 0.35:  # a sink per (batch, head, row): Inkling2's form, or near misses
            w.forms.append("row_sinks")
            column = w.variants.choice(
                [
                    'extra["row_sinks"][:, :, -Lq:].unsqueeze(-1)',
                    'extra["row_sinks"][:, :, -Lq:][..., None]',
                    'extra["row_sinks"][:, :, -Lq:].unsqueeze(3)',
                ]
                if w.variants.random() < 0.85
                else [
                    'extra["row_sinks"][:1, :, -Lq:].unsqueeze(-1).expand(B, -1, -1, -1)',  # one row's, broadcast
                    'extra["row_sinks"][:, :, -Lq:, None]',  # not an unsqueeze
                    'extra["row_sinks"][:, :, -Lq:].unsqueeze(-2).transpose(-1, -2)',
                ]
            )
        column = w.let(column)
        logits = w.let(
            either([f"torch.cat([{masked}, {column}], dim=-1)"], [f"torch.cat([{column}, {masked}], dim=3)"])
        )
    if w.chance(0.6):
        logits = w.let(
            either(
                [
                    f"{logits} - {logits}.max(dim=-1, keepdim=True).values",
                    f"{logits} - {logits}.amax(-1, keepdim=True)",
                    f"{logits} - torch.max({logits}, 3, keepdim=True)[0].detach()",
                ],
                [
                    f"{logits} - {masked if sink else scaled}.amax(-1, keepdim=True)",
                    f"{logits} - {logits}.amax(-2, keepdim=True)",
                ],  # not a row max: changes the result
            )
        )
    probs = w.let(
        either(
            [
                f"F.softmax({logits}, dim=-1)",
                f"torch.softmax({logits}, -1)",
                f"{logits}.softmax(dim=3)",
                f"F.softmax({logits}, dim=-1, dtype=q.dtype).to(q.dtype)",
            ],
            [
                f"F.softmax({logits}, dim=-1, dtype=torch.float32).to(q.dtype)",  # a downcast of float64
                f"F.softmax({logits}.float(), dim=-1).double()",
                f"F.softmax({logits}, dim=-2)",
            ],
        )
    )
    if sink:
        probs = w.let(either([f"{probs}[..., :-1]", f"{probs}[:, :, :, :-1]"], [f"{probs}[..., 1:]"]))
    probs = w.let(
        w.pick(
            [
                probs,
                probs,
                f"F.dropout({probs}, p=0.0, training=True)",
                f"F.dropout({probs}, p=0.2, training=False)",
                f"torch.dropout({probs}, 0.0, True)",
            ]
        )
    )
    out = w.pick([f"torch.matmul({probs}, v)", f"({probs} @ v)", f"{probs}.matmul(v)"])
    if w.chance(0.08):
        out = f"({out} + {probs}.sum(-1, keepdim=True))"  # the probabilities used again
    w.forms.append("sinks" if sink else "no_sinks")
    if w.variants.random() < (0.1 if sink else 0.4):
        out = _lse_scaling(w, out, masked, scaled)
    return out


def _packed_positions_band(w: _Writer) -> str:
    """A (B, 1, Lq, L) window over the input positions' values inside each packed sequence (ids
    where the positions do not step by 1), which the rules check at run time; the positions
    sometimes moved out of the checked range, or near int64's minimum, where the window's bound
    wraps and rows see no key: the op's fallback must then compute the chain."""
    w.forms.append("spelled_packed")
    offset = w.added.choice(["0", "0", "2**30", "-(2**63) + 2"])
    p = w.let(f"positions + {offset}")
    ids = w.let(f"(torch.diff({p}, prepend={p}[:, :1] - 1) != 1).cumsum(-1)")
    width = w.added.choice([2, 3, 4])
    rows = "[:, -Lq:]" if w.decoding else ""
    qp, kp = f"{p}{rows}[:, None, :, None]", f"{p}[:, None, None, :]"
    same = f"({ids}{rows}[:, None, :, None] == {ids}[:, None, None, :])"
    return w.let(f"({kp} <= {qp}) & ({kp} > {qp} - {width}) & {same}")


def _softcap(w: _Writer, scaled: str) -> str:
    """The scores soft-capped (Gemma-2's ``tanh(s / cap) * cap``) in its spellings, or a near
    miss: a cap from the data, a divisor and a multiplier that differ, no divisor, a sine, a
    negative or zero cap (drawn now and then); ``scaled`` as it is otherwise."""
    if w.variants.random() >= 0.35:
        return scaled
    w.forms.append("softcap")
    cap = w.variants.choice(["0.5", "2.0", "5.0", "50.0", "100.0"])
    if w.variants.random() < 0.15:
        w.forms.append("softcap_near_miss")
        other = w.variants.choice(["3.0", "0.25"])
        return w.let(
            w.variants.choice(
                [
                    f"torch.tanh({scaled} / (q.abs().amax() + 1)) * (q.abs().amax() + 1)",  # a cap from the data
                    f"torch.tanh({scaled} / {other}) * {cap}",
                    f"torch.tanh({scaled}) * {cap}",
                    f"torch.sin({scaled} / {cap}) * {cap}",
                    f"torch.tanh({scaled} / -{cap}) * -{cap}",
                    f"torch.tanh({scaled} / 0.0) * 0.0",
                ]
            )
        )
    spelling = w.variants.choice(["steps", "steps", "method", "function"])
    if spelling == "steps":  # transformers' Gemma-2 and VaultGemma
        divided = w.let(f"{scaled} / {cap}")
        return w.let(f"torch.tanh({divided}) * {cap}")
    if spelling == "method":
        return w.let(f"{cap} * ({scaled} * (1 / {cap})).tanh()")
    return w.let(f"torch.tanh(torch.div({scaled}, {cap})) * {cap}")


def _lse_scaling(w: _Writer, out: str, masked: str, scaled: str) -> str:
    """Granite-SWA's sinks: the attention scaled by sigmoid(logsumexp(masked scores) - sink), per
    head or per row, in its spellings, or a near miss: the sink not subtracted, the logsumexp
    over the query axis or of the unmasked scores, a tanh for the sigmoid."""
    w.forms.append("lse_sinks")
    sinks = w.variants.choice(
        ['extra["sinks"].view(1, -1, 1)', 'extra["sinks"].reshape(1, -1, 1)', 'extra["sinks"][None, :, None]']
        + ['extra["row_sinks"][:, :, -Lq:]']
    )
    lse = w.let(w.variants.choice([f"torch.logsumexp({masked}, dim=-1)", f"{masked}.logsumexp(-1)"]))
    near_miss = w.variants.random() < 0.15
    if near_miss:
        w.forms.append("lse_near_miss")
        lse = w.let(
            w.variants.choice(
                [f"torch.logsumexp({scaled}, dim=-1)", f"torch.logsumexp({masked}, dim=-1) * 1.0", lse, lse]
            )
        )
    difference = f"({lse} - {sinks})"
    if near_miss and w.variants.random() < 0.5:
        difference = w.variants.choice([f"({sinks} - {lse})", f"({lse} + {sinks})", f"{lse}"])
    scale = w.let(
        w.variants.choice(
            [
                f"{difference}.to(torch.float64).sigmoid()",
                f"torch.sigmoid({difference})",
                f"{difference}.sigmoid()",
            ]
            + ([f"torch.tanh({difference})"] if near_miss else [])
        )
    )
    factor = w.variants.choice([f"{scale}.unsqueeze(-1)", f"{scale}[..., None]", f"{scale}.unsqueeze(-1).to(v.dtype)"])
    return w.variants.choice([f"({out} * {factor})", f"({factor} * {out})"])


# -- packed-sequence segments ------------------------------------------------------------------


def _segment_mask(w: _Writer) -> str:
    """A band and ``seg(q) == seg(kv)`` for segment ids cumsummed from the input positions,
    the key side sometimes another cumsum over the same positions, written or not."""
    difference = w.let("torch.diff(positions, prepend=positions[:, :1] - 1)")
    starts = w.let(w.pick([f"{difference} != 1", "positions == 0"]))
    query_segments = w.let(f"{starts}.cumsum(-1)")
    key_segments = query_segments
    if w.chance(0.5):
        other = w.let(w.pick([f"{difference} != 1", "positions == 0", f"{starts}.clone()"]))
        if w.chance(0.5):
            w.do(f"{other}[:, {w.pick([1, 4, 6])}] = True")
        key_segments = w.let(f"{other}.cumsum(-1)")
    i = w.let("torch.arange(L)")
    qi = _as_query(w, w.let(f"{i}[-Lq:]") if w.decoding else i)
    band = w.let(_logic(w, _near_band(w, qi, _as_key(w, i))))
    rows = "[:, -Lq:]" if w.decoding else ""
    same = w.let(f"{query_segments}{rows}[:, None, :, None] == {key_segments}[:, None, None, :]")
    return w.let(f"{band}[None, None] & {same}")


# -- image blocks ------------------------------------------------------------------------------


def _image_mask(w: _Writer) -> str:
    """A window's lower side AND (its upper side OR the same image block), the ids an input
    (``extra["blocks"]``: an id in two runs, ids below -1) or computed from token types as
    transformers computes them; spelled as the proof reads it and in near misses."""
    if w.chance(0.5):
        ids = w.let('extra["blocks"]')
    else:
        vision = w.let('extra["blocks"] >= 0')
        previous = w.let(f"torch.roll({vision}, shifts=1, dims=-1)")
        w.do(f"{previous}[..., 0] = False")
        starts = w.let(f"{vision} & ~{previous}")
        ids = w.let(f"torch.where({vision}, torch.cumsum({starts}.int(), dim=1) - 1, -1)")
    if w.chance(0.1):
        w.forms.append("written_ids")
        w.do(f"{ids}{w.pick(['[:, 2]', '[0]', '.view(-1)[:3]'])}.fill_({w.pick([-1, 0, 5])})")
    i = w.let("torch.arange(L)")
    qi = _as_query(w, w.let(f"{i}[-Lq:]") if w.decoding else i)
    ki = _as_key(w, i)
    rows = "[:, -Lq:]" if w.decoding else ""
    query_ids = w.let(f"{ids}{rows}[:, :, None]")
    key_ids = w.let(
        w.pick([f"{ids}[:, None, :]", f"{ids}[:, None, :]", f"{ids}.flip(-1)[:, None, :]", f"{ids}[:1, None, :]"])
    )
    sign = w.pick(
        [f"{query_ids} >= 0"] * 3
        + [f"{key_ids} >= 0", f"{query_ids} > -1", f"{query_ids} > 0", f"{query_ids} != -1", "True"]
    )
    same = w.pick([f"{query_ids} == {key_ids}"] * 3 + [f"{key_ids} == {query_ids}", f"{query_ids} <= {key_ids}"])
    block = w.let(f"({sign}) & ({same})" if sign != "True" else same)
    lower = w.let(w.pick([f"{ki} > {qi} - {w.pick([3, 4, 6])}", f"{ki} >= {qi} - 3", f"{qi} - {ki} < 4"]))
    upper = w.let(
        w.pick(
            [
                f"{ki} <= {qi}",
                f"{ki} <= {qi}",
                f"{ki} < {qi} + 2",
                f"{ki} >= {qi}",
                f"({ki} <= {qi}) & ({ki} >= {qi} - 1)",
            ]
        )
    )
    mask = w.pick(
        [
            f"{lower}[None] & ({upper}[None] | {block})",
            f"{lower}[None] & ({upper}[None] | {block})",
            f"({lower} & {upper})[None] | {block}",
            f"{lower}[None] & ({upper}[None] | {block}) & ({ki} <= {qi} + 3)[None]",
        ]
    )
    if w.chance(0.3):
        mask = f"({mask}) & (padding[:, None, :] != 0)"
    return w.let(f"({mask})[:, None]")


# -- chunks and other ids computed in the graph --------------------------------------------------


def _chunk_ids(w: _Writer, positions: str, batched: bool) -> str:
    """Ids of fixed-size chunks of ``positions`` (a (B, L) or (L,) integer tensor) in the
    spellings code uses, and near misses: truncating division, negative or tensor divisors,
    offsets counted from the padding (sometimes in int32 or int8), scaled positions."""
    c = w.pick([1, 2, 3, 4, 4, 8, 8])
    offsets = ["0", "0", "3", "-5", f"{w.constant()}"]
    if batched:
        offsets += [
            "(padding.cumsum(-1) == 0).sum(-1)[:, None]",
            "(padding == 0).sum(-1)[:, None]",
            "(padding == 0).sum(-1, dtype=torch.int32)[:, None]",
            "(padding == 0).sum(-1, dtype=torch.int8)[:, None]",
            'extra["blocks"].sum(-1)[:, None]',
            "positions[:, :1]",
        ]
    offset = w.pick(offsets)
    shifted = positions if offset == "0" else f"({positions} - {offset})"
    return w.let(
        w.pick(
            [
                f"{shifted} // {c}",
                f"{shifted} // {c}",
                f"torch.div({shifted}, {c}, rounding_mode='floor')",
                f"torch.floor_divide({shifted}, {c})",
                f"{shifted}.div({c}, rounding_mode='floor')",
                f"torch.div({shifted}, {c}, rounding_mode='trunc')",
                f"{shifted} // -{c}",
                f"{shifted} // torch.tensor({c})",
                f"({shifted} * 2) // {2 * c}",
                f"({shifted} * 3) // {c}",
                f"({shifted} + {c}) // {c}",
            ]
        )
    )


def _clamped(w: _Writer, qi: str, ki: str) -> str:
    """A window's lower side through a clamp or an elementwise extremum, exact or off."""
    w.forms.append("clamp")
    c, d = w.pick([1, 3, 4, 7]), w.pick([0, 1, -2, 5])
    return w.pick(
        [
            f"(({qi} - {ki}).clamp(min={d}) < {c})",
            f"({ki} >= ({qi} - {c}).clamp(min={d}))",
            f"(torch.clamp({ki} - {qi}, -{c}, {d}) > -{c})",
            f"(torch.clamp_min({qi} - {c}, 0) <= {ki})",
            f"(({qi} - {ki}).clamp(max={c}) < {c})",
            f"(({qi} - {ki}).clamp({c}, {d}) <= {c})",
            f"(torch.maximum({qi} - {ki}, {ki} - {qi}) <= {c})",
            f"(torch.minimum({qi} - {ki}, {ki} - {qi}) <= {c})",
            f"(({qi} - {ki}).clamp(min=torch.tensor({d})) < {c})",
        ]
    )


def _chunk_mask(w: _Writer) -> str:
    """Chunked attention: the ids of the query's and the key's chunk equal, AND a causal or
    sliding band, sometimes AND padding; the ids per batch row ((B, L) offsets) or shared,
    the key side sometimes made another way (another divisor, shifted positions)."""
    if not w.decoding and w.chance(0.25):
        return _packed_chunks(w)
    i = _positions(w)
    batched = w.chance(0.5)
    positions = w.let(f"{i}[None, :].expand(B, -1)" if batched else i)
    query_ids = _chunk_ids(w, positions, batched)
    key_ids = query_ids if w.chance(0.8) else _chunk_ids(w, positions, batched)
    if batched:
        same = w.let(f"{query_ids}[:, None, :, None] == {key_ids}[:, None, None, :]")
    else:
        same = w.let(f"({query_ids}[:, None] == {key_ids}[None, :])[None, None]")
    qi = _as_query(w, w.let(f"{i}[-Lq:]") if w.decoding else i)
    ki = _as_key(w, i)
    band = w.pick(
        [
            lambda: [f"({ki} <= {qi})"],
            lambda: _near_band(w, qi, ki),
            list,
            lambda: [_clamped(w, qi, ki), f"({ki} <= {qi})"],
        ]
    )()
    mask = f"{same}"
    if band:
        mask = f"({same} & {_logic(w, band)}[None, None])"
    if w.decoding:
        mask = w.let(f"{mask}[:, :, -Lq:]")
    if w.chance(0.3):
        mask = _padding(w, mask)
    return w.let(mask)


def _prefill_chunk_mask(w: _Writer) -> str:
    """A sliding band (or a near miss) AND a key padding read from a cache's first token on,
    as a prefill chunk after a cache builds it."""
    i = w.let("torch.arange(L)") if w.chance(0.7) else _positions(w)
    qi = _as_query(w, w.let(f"{i}[-Lq:]") if w.decoding else i)
    ki = _as_key(w, i)
    band = w.let(f"{_logic(w, _near_band(w, qi, ki))}[None, None]")
    return w.let(f"({band} & ({_shifted_padding(w)}[:, None, None, :] != 0))")


def _packed_chunks(w: _Writer) -> str:
    """A packed batch's chunked layer: the same document (ids from the input positions' breaks)
    AND the same chunk of position values AND causal over positions, with near misses (no
    document term, chunks over indices, a second chunk size, a window instead of chunks)."""
    w.forms.append("packed_chunks")
    c = w.pick([2, 3, 4, 8])
    documents = w.let("(torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)")
    pq, pk = w.let("positions[:, None, :, None]"), w.let("positions[:, None, None, :]")
    terms = [
        w.pick([f"({documents}[:, None, :, None] == {documents}[:, None, None, :])", "True"]),
        w.pick(
            [
                f"({pk} // {c} == {pq} // {c})",
                f"({pk} // {c} == {pq} // {c})",
                f"({pk} > {pq} - {c})",
                f"(torch.arange(L) // {c} == torch.arange(L)[:, None] // {c})",
            ]
        ),
        w.pick([f"({pk} <= {pq})", f"({pk} <= {pq})", f"({pk} // {c + 1} == {pq} // {c + 1})"]),
    ]
    return w.let(" & ".join(term for term in terms if term != "True"))


# -- top-k masks -------------------------------------------------------------------------------


def _topk_bias(w: _Writer) -> str:
    bias = w.let("(q @ k.transpose(-1, -2)) * 0.25")
    if w.chance(0.4):
        allowed = w.pick(
            [
                "torch.ones(Lq, L, dtype=torch.bool).tril(L - Lq)",
                "~torch.ones_like(bias_, dtype=torch.bool)".replace("bias_", bias),
                "torch.ones_like(bias_, dtype=torch.bool)".replace("bias_", bias),
            ]
        )
        bias = w.let(f"{bias}.masked_fill(~({allowed}), MIN)")
    keep = w.pick([3, 5])
    topk = w.pick(
        [
            f"torch.topk({bias}, {keep}, dim=-1, largest=True, sorted=False)",
            f"torch.topk(input={bias}, k={keep})",
            f"{bias}.topk({keep}, -1, True, False)",
            f"torch.topk({bias}, {keep}, dim=-2)",
            f"torch.topk({bias}, {keep}, largest=False)",
            f"torch.topk({bias}.detach(), {keep}, dim=-1)",
        ]
    )
    result = w.let(topk)
    values, indices = w.let(f"{result}[0]"), w.let(f"{result}[1]")
    if w.chance(0.5):
        dtype = w.pick(["", ", dtype=torch.float32", ", dtype=torch.int64", ", dtype=torch.float16"])
        zeros = w.let(w.pick([f"torch.zeros_like({bias}{dtype})", f"{bias}.new_zeros({bias}.shape)"]))
        if w.chance(0.1):
            w.do(f"{zeros}[..., 0] = 5")
        value = w.pick(["1.0", "1.0", "1", "1e-50", "0.5", "-1.0", "0", "True", "1e5"])
        scatter = w.pick(
            [
                f"{zeros}.scatter(-1, {indices}, {value})",
                f"{zeros}.scatter(-1, {indices}, value={value})",
                f"{zeros}.scatter(dim=-1, index={indices}, value={value})",
                f"{zeros}.scatter(-1, {indices}, {value}, reduce='{w.pick(['add', 'multiply'])}')",
                f"{zeros}.scatter(-2, {indices}, {value})",
            ]
        )
        active = w.let(scatter)
        drop = w.let(
            w.pick([f"{active} == 0", f"{active} == 0.0", f"{active} != 0", f"{active} == 1", f"0 == {active}"])
        )
        return w.let(f"{bias}.masked_fill({drop}, MIN)")
    source = w.pick(["True", f"{values} != MIN", f"{values} > MIN"])
    keep_mask = w.let(f"torch.zeros_like({bias}, dtype=torch.bool).scatter(-1, {indices}, {source})")
    return w.let(f"{bias}.masked_fill(~{keep_mask}, MIN)")


# -- masks passed in as inputs ---------------------------------------------------------------

# What ``extra["mask"]`` holds, a (B, 1, L, L) bool built by ``_mask_input``: bands, bands with
# padding or a hidden key, plain causal, all visible, and masks that are no band.
MASK_INPUTS = [
    "band",
    "band",
    "band_padding",
    "band_hidden_key",
    "causal",
    "all_visible",
    "one_entry_off",
    "random",
    "bidirectional",
]


def _mask_input(length: int, pattern: str) -> torch.Tensor:
    i = torch.arange(length)
    distance = i[None, :] - i[:, None]
    band = (distance <= 0) & (distance >= -3)
    mask = {
        "band": band,
        "band_padding": band,
        "band_hidden_key": band & (i != length // 2)[None, :],
        "causal": distance <= 0,
        "all_visible": torch.ones(length, length, dtype=torch.bool),
        "one_entry_off": band.clone(),
        "random": torch.rand(length, length, generator=torch.Generator().manual_seed(length)) > 0.5,
        "bidirectional": (distance >= -2) & (distance <= 1),
    }[pattern]
    mask = mask[None, None].repeat(BATCH, 1, 1, 1)
    if pattern == "band_padding":
        mask[1, ..., length - 3 :] = False  # right padding of row 1
        mask[0, ..., :2] = False  # left padding of row 0
    if pattern == "one_entry_off":
        mask[0, 0, length - 1, 1] = True
    return mask


def _mask_from_input(w: _Writer) -> str:
    """``extra["mask"]``, read as it is, through a view, or written in the graph first."""
    mask = w.let('extra["mask"]')
    if w.decoding:
        mask = w.let(f"{mask}[:, :, -Lq:]")
    if w.chance(0.2):
        w.do(
            w.pick(
                [
                    f"{mask}[..., 0, :] = True",
                    f"{mask}[:, :, :, 1].fill_(False)",
                    f"torch.diagonal({mask}, 0, 2, 3).fill_(True)",
                    f"{mask}.logical_not_()",
                ]
            )
        )
    return mask


# -- programs ------------------------------------------------------------------------------------


def generate(seed: int) -> str:
    """The source of ``program(x, padding, positions, extra, offset)`` for ``seed``, and
    the values ``OFFSET`` (the int passed as ``offset``) and ``DYNAMIC`` (whether the program
    reads ``offset``, so is compiled with ``dynamic=True``)."""
    w = _Writer(random.Random(seed), random.Random(-1 - seed), random.Random(1_000_003 + seed))
    kind = w.pick(
        ["index"] * 6
        + ["masking_utils"] * 2
        + ["topk"] * 2
        + ["segments", "filled", "additive", "mask_input", "mask_input"]
    )
    builders = {
        "index": _index_mask,
        "masking_utils": _masking_utils_mask,
        "topk": _topk_bias,
        "segments": _segment_mask,
        "filled": _filled_band,
        "additive": _additive_band,
        "mask_input": _mask_from_input,
    }
    if seed % 9 == 4:  # chosen by the seed, so that other seeds' programs stay as they were
        kind = "images"
    if seed % 9 == 7:
        kind = "chunks"
    if seed % 9 == 1:
        kind = "prefill_chunk"
    builders["images"] = _image_mask
    builders["chunks"] = _chunk_mask
    builders["prefill_chunk"] = _prefill_chunk_mask
    if seed % 9 == 2:
        kind = "spelled"
    builders["spelled"] = _spelled_attention
    mask_pattern = w.pick(MASK_INPUTS)
    mask = builders[kind](w)
    checkpointed = w.chance(0.08)
    if checkpointed and kind in ("index", "segments", "masking_utils") and w.chance(0.7):
        # An opaque value of the body against one of the parent made by the same ops.
        mask = w.let(f"{mask} & (outer[None, :] == (torch.arange(L) % {w.pick([2, 3])})[None, :])")
    if kind in ("index", "segments") and w.chance(0.25):
        mask = _additive(w, mask)
        kind += " additive"
    scale_value = w.pick(["0.3", "0.3", "0.3", "0.0", "-0.5", "float('inf')", "float('nan')", "1e-3"])
    call = w.pick(
        [
            f"F.scaled_dot_product_attention(q, k, v, attn_mask={mask})",
            f"F.scaled_dot_product_attention(q, k, v, {mask})",
            f"F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask={mask}, scale={scale_value})",
            f"F.scaled_dot_product_attention(q, k, v, attn_mask={mask}, dropout_p=0.0, is_causal=False)",
        ]
    )
    if "scale=" in call and scale_value not in ("0.3", "1e-3"):
        w.forms.append("odd_scale")
    if kind == "spelled":
        call = mask  # the attention itself, spelled out
    elif w.chance(0.15):  # two calls on one mask, the mask sometimes written between them
        w.forms.append("two_calls")
        between = w.pick(["", f"{mask}[..., -1, 0] = True; ", f"{mask}.fill_(True); "]) if kind == "mask_input" else ""
        w.do(f"first = {call}; {between}".rstrip("; "))
        call = f"(first + {call})"
    rows = f"[:, :, -{w.pick([1, 3])}:]" if w.decoding else ""
    scale = w.pick(["", " * 1e5"]) if "additive" in kind.split() or kind in ("filled", "spelled") else ""
    setup = [f"q, k, v = x[0]{rows}{scale}, x[1], x[2]", "B, Lq, L = q.shape[0], q.shape[2], k.shape[2]"]
    if w.reads_offset and w.chance(0.5):
        setup.append("offset = max(offset, 0)")  # a guard: nonnegative, still not a size
    if w.chance(0.2):  # a view that needs the result stored as SDPA stores it
        call = f"{call}.view(B, -1).view(B, -1, Lq, q.shape[-1])"
    lines = [*setup, *w.lines, f"return {call}"]
    forms = [kind, *(["decoding"] if w.decoding else []), *(["checkpointed"] if checkpointed else [])]
    forms += ["dynamic"] if w.reads_offset else []
    forms += ["extra_padding"] if any('extra["padding"]' in line for line in w.lines) else []
    forms += w.forms
    header = f"# seed {seed}: {' '.join(forms)}\n"
    header += f"OFFSET, DYNAMIC = {w.pick([0, 3, 2**31 - 5, 2**62, 2**63 - 8])}, {w.reads_offset}\n"
    header += f"MASK_INPUT = {mask_pattern!r}\n"
    signature = "x, padding, positions, extra, offset"
    if not checkpointed:
        return header + f"def program({signature}):\n    " + "\n    ".join(lines) + "\n"
    body = "\n        ".join(lines)
    return header + (
        f"def program({signature}):\n"
        f"    outer = torch.arange(x.shape[3]) % {w.pick([2, 3])}\n"
        f"    def body({signature}, outer):\n        {body}\n"
        f"    return torch.utils.checkpoint.checkpoint(body, {signature}, outer, use_reentrant=False)\n"
    )


def _inputs(length: int, seed: int, mask_pattern: str = "band"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=torch.float64)
    padding = torch.ones(BATCH, length, dtype=torch.long)
    padding[0, : length // 4] = 0  # left padding
    padding[1, length - length // 5 :] = 0  # right padding
    positions = torch.arange(length).repeat(BATCH, 1)
    positions[1, length // 2 :] -= length // 2  # two packed sequences in row 1
    # A second padding, passed as extra["padding"]: holes, none where ``padding`` has one.
    holes = torch.ones(BATCH, length, dtype=torch.long)
    holes[0, length // 2] = 0
    holes[1, [1, length // 3]] = 0
    # Image block ids: two images in row 0 (one id in two runs), one in row 1, ids below -1.
    blocks = torch.full((BATCH, length), -1)
    blocks[0, 2:6] = 0
    blocks[0, length - 5 : length - 2] = 0
    blocks[0, 7:9] = 3
    blocks[1, length // 3 : length // 3 + 6] = 1
    blocks[1, 0] = -2
    # A padding 5 tokens longer (a cache's tokens first): left padding in row 0, holes in row 1.
    long_padding = torch.ones(BATCH, length + 5, dtype=torch.long)
    long_padding[0, : length // 3 + 3] = 0
    long_padding[1, 4::3] = 0
    extra = {
        "padding": holes,
        "mask": _mask_input(length, mask_pattern),
        "blocks": blocks,
        "long_padding": long_padding,
    }
    extra["sinks"] = torch.randn(HEADS, generator=gen, dtype=torch.float64)  # one per head, spelled-out attention's
    extra["row_sinks"] = torch.randn(BATCH, HEADS, length, generator=gen, dtype=torch.float64)  # one per row
    return x, padding, positions, extra


def _run(fn, inputs, grads: bool, offset: int, written: bool = False):
    """Output and (optionally) the gradient of x, on fresh copies: programs may write their
    inputs. ``written``: every integer input is written between forward and backward."""
    x, padding, positions, extra = inputs
    x, padding, positions = (t.clone() for t in (x, padding, positions))
    extra = {name: t.clone() for name, t in extra.items()}
    x.requires_grad_(grads)
    out = fn(x, padding, positions, extra, offset)
    if not grads:
        return out.detach(), None
    if written:
        _write_inputs(padding, positions, extra)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    return out.detach(), grad


def _write_inputs(padding, positions, extra) -> None:
    """Writes every integer and bool input in place through numpy, which torch's version
    counter does not see, as a caller might between forward and backward: eager's backward
    (an activation checkpoint's recomputation) then reads the new values where it reads the
    inputs again, and the program must read what eager reads."""
    for tensor in (padding, extra["padding"], extra["long_padding"]):
        tensor.numpy()[:] = 1 - tensor.numpy()
    positions.numpy()[:] = positions.numpy()[:, ::-1]
    extra["blocks"].numpy()[:] = extra["blocks"].numpy() + 1
    extra["mask"].numpy()[:] = ~extra["mask"].numpy()


@dataclass
class Outcome:
    seed: int
    status: str  # "ok", "invalid" (eager raises), "dynamo" (Dynamo alone fails), "mismatch", "exception"
    decisions: list = field(default_factory=list)
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "exception")


def check(seed: int, *, grads: bool | None = None, lengths: tuple[int, ...] = LENGTHS) -> Outcome:
    """Compile program ``seed`` with compile_pass's rewrite, run it at three lengths with
    dynamic shapes, and compare with eager: whatever kernel each call is routed to (by the
    static tables, or measured on this machine where the settings say so), the results are
    eager's."""
    source = generate(seed)
    namespace = {
        "torch": torch,
        "F": F,
        "mu": masking_utils,
        "MIN": MIN,
        "packed_window_function": packed_window_function,
    }
    exec(source, namespace)  # noqa: S102 - generated from the grammar above
    program, offset, dynamic = namespace["program"], namespace["OFFSET"], namespace["DYNAMIC"]
    pattern = namespace["MASK_INPUT"]
    grads = (seed % 3 == 0) if grads is None else grads
    written = grads and seed % 2 == 1  # inputs written between forward and backward
    try:
        expected = [_run(program, _inputs(length, seed, pattern), grads, offset, written) for length in lengths]
    except Exception as error:  # noqa: BLE001 - a program eager rejects is not a test case
        return Outcome(seed, "invalid", detail=f"{type(error).__name__}: {error}"[:200])
    torch._dynamo.reset()
    capture = Capture()
    # A Python int is a SymInt only under dynamic=True.
    compiled = torch.compile(program, backend=capture, dynamic=True if dynamic else None)
    try:
        for length, (out, grad) in zip(lengths, expected, strict=True):
            inputs = _inputs(length, seed, pattern)
            torch._dynamo.maybe_mark_dynamic(inputs[0], 3)
            for tensor in (*inputs[1:3], inputs[3]["padding"], inputs[3]["blocks"], inputs[3]["long_padding"]):
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
            for dim in (2, 3):
                torch._dynamo.maybe_mark_dynamic(inputs[3]["mask"], dim)
            torch._dynamo.maybe_mark_dynamic(inputs[3]["row_sinks"], 2)
            actual, actual_grad = _run(compiled, inputs, grads, offset, written)
            torch.testing.assert_close(actual, out, atol=1e-9, rtol=1e-9, equal_nan=True, msg=f"output at L={length}")
            if grads:
                torch.testing.assert_close(
                    actual_grad, grad, atol=1e-9, rtol=1e-9, equal_nan=True, msg=f"grad at L={length}"
                )
    except AssertionError as error:
        if written and _differs_without_the_pass(program, seed, offset, dynamic, pattern, expected, lengths):
            return Outcome(seed, "dynamo", _decisions(capture), "Dynamo alone differs after the write")
        return Outcome(seed, "mismatch", _decisions(capture), str(error)[:2000])
    except Exception as error:  # noqa: BLE001 - sorted below: ours, or Dynamo's alone
        if _fails_without_the_pass(program, seed, offset, dynamic, pattern, grads, lengths):
            return Outcome(seed, "dynamo", _decisions(capture), f"{type(error).__name__}"[:200])
        return Outcome(seed, "exception", _decisions(capture), traceback.format_exc()[-3000:])
    decisions = _decisions(capture)
    internal = [d for d in decisions if "internal error" in d[2]]
    if internal:
        return Outcome(seed, "exception", decisions, f"{internal}")
    return Outcome(seed, "ok", decisions)


def _decisions(capture: Capture) -> list[tuple[str, bool, str]]:
    return [(d.rule, d.rewritten, d.verdict) for report in capture.reports for d in report]


def _fails_without_the_pass(program, seed, offset, dynamic, pattern, grads, lengths=LENGTHS) -> bool:
    """Whether Dynamo itself (no rewrite at all) fails on the program, gradient included."""
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="eager", dynamic=True if dynamic else None)
    try:
        for length in lengths:
            _run(compiled, _inputs(length, seed, pattern), grads, offset)
    except Exception:  # noqa: BLE001
        return True
    return False


def _differs_without_the_pass(program, seed, offset, dynamic, pattern, expected, lengths=LENGTHS) -> bool:
    """Whether Dynamo itself (no rewrite) gives other gradients than eager once the inputs are
    written between forward and backward (AOTAutograd may read an input again in the backward)."""
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="eager", dynamic=True if dynamic else None)
    for length, (_, grad) in zip(lengths, expected, strict=True):
        _, actual = _run(compiled, _inputs(length, seed, pattern), True, offset, written=True)
        if not torch.allclose(actual, grad, atol=1e-9, rtol=1e-9, equal_nan=True):
            return True
    return False


def summarize(outcomes: list[Outcome]) -> str:
    """Counts by status, and decisions by rule (rewritten, kept)."""
    statuses = collections.Counter(o.status for o in outcomes)
    by_rule: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for outcome in outcomes:
        for rule, rewritten, _ in outcome.decisions:
            by_rule[rule]["rewritten" if rewritten else "kept"] += 1
    lines = [f"programs {len(outcomes)}: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))]
    for rule in sorted(by_rule):
        lines.append(f"  {rule}: rewritten {by_rule[rule]['rewritten']}, kept {by_rule[rule]['kept']}")
    # Programs by the grammar's forms (a seed's first line), and how many had a call rewritten.
    forms: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for outcome in outcomes:
        for form in generate(outcome.seed).splitlines()[0].split(": ", 1)[1].split():
            forms[form]["programs"] += 1
            forms[form]["rewritten"] += any(rewritten for _, rewritten, _ in outcome.decisions)
    lines.append(
        "  forms: " + ", ".join(f"{form} {c['rewritten']}/{c['programs']}" for form, c in sorted(forms.items()))
    )
    false_rewrites = sum(1 for o in outcomes if o.status == "mismatch" and any(r for _, r, _ in o.decisions))
    lines.append(f"false rewrites {false_rewrites}, exceptions {statuses['exception']}")
    return "\n".join(lines)
