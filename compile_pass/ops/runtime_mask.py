"""Attention whose mask is a graph input: the band is read at run time, from the mask as it is
at that graph call.

Under FSDP2, regional compilation, graph breaks or ``generate()`` with a static cache, the
mask is built in one graph (or in eager code) and reaches the attention layers' graphs as an
input, where no proof can see how it was built. Nothing about such a tensor's contents is
trusted past the graph call that reads it: torch does not move ``tensor._version`` for every
write (``.data``, ``untyped_storage()``, dlpack and numpy views, ``set_``, another thread), so
no cache keyed by identity and version can be sound. Instead:

- ``mask_facts(mask)`` verifies the mask exactly against the band its own entries imply
  (``check_mask``: four byte reductions over the mask and one host sync). The rule inserts it
  once per mask input at the top of the graph that calls SDPA (a checkpoint body checks on
  each run), where the write analysis shows the graph never writes that input, and every
  rewritten call consumes it;
- ``mask_input_attention_forward(q, k, v, mask, facts, key_padding, scale, enable_gqa)``
  decides per call, on the host, from those facts (a CPU tensor: no sync):
  band, and a kernel here faster than what SDPA runs for it -> the sliding-window op (with
  no left bound: packed documents or padded rows on the CPU, the document kernel); plain
  causal with Sq == Sk -> SDPA ``is_causal=True``; every key visible -> SDPA, no mask;
  anything else -> SDPA with the mask. The decision is an output the backward reads, so both
  take the same path. The op keeps no reference to the mask: where SDPA with the mask ran,
  it returns a copy for the backward (SDPA keeps a float copy there too), so a mask written
  between forward and backward changes nothing, as in eager.

For attention spelled out in ops (``chain=True``: the spelled_attention rule's packed rows,
soft-capped or not), every path but the band is the chain itself (``chain.py``): SDPA has no
cap, and gives a row that sees no key zeros or NaN, or a mean whose gradient its backends
disagree on, where the chain gives what its mask and fill make of it.

Optional sinks (one logit per query head, ``sinks.py``) are applied around whichever path
ran, from its logsumexp, as the window op applies them: the band path and aten's fused CPU
kernel (every SDPA path on the CPU) return one. SDPA elsewhere does not, so a call with sinks
that would run it raises (``sinks_refused`` says where, at graph time, for the rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import policy
from ..kernels.contract import CallFacts, runs_unmasked
from ..kernels.layout import check_scale, check_sinks, check_softcap, empty_like_heads_last, new_logsumexp
from ..registration import define_op
from ..window import UNBOUNDED
from . import chain as spelled_chain
from . import sdpa
from .sinks import apply_sinks, sink_gradients
from .window_attention import backward_fake, sliding_window_attention_backward, sliding_window_attention_forward


@dataclass(frozen=True)
class MaskFacts:
    """A (batch, 1, Sq, Sk) bool mask equals FA2's window (left, right) over its own Sq and Sk
    (query i aligned with key i + Sk - Sq), AND ``key_padding[b, kv]`` when given."""

    left: int
    right: int
    key_padding: torch.Tensor | None  # (batch, Sk) bool, a tensor of its own


def check_mask(mask: torch.Tensor) -> MaskFacts | None:
    """The facts of a (batch, 1, Sq, Sk) bool mask, read off its entries and verified exactly:
    the extreme visible distances give the window (lo, hi), the keys any row sees give the
    padding, and the mask must equal that band AND that padding everywhere (a key column no
    row sees is then exactly a key no row attends, whatever the reason). None when it does
    not, when the window leaves out the aligned diagonal (not an FA2 window), or when a byte
    of the mask is neither 0 nor 1 (written through another dtype).

    Why counting suffices: every visible entry lies inside the band (lo and hi are the
    extremes of the visible distances) and inside the padding (a column is padding only if no
    row sees it), so the mask equals band AND padding exactly when it has as many visible
    entries as band AND padding has. Every pass over the mask is a byte reduction (no copy
    of its size); one host sync."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or 0 in mask.shape:
        return None
    batch, _, seq_q, seq_k = mask.shape
    as_bytes = mask[:, 0].view(torch.uint8)  # (B, Sq, Sk); argmax and amax are not defined on bool
    device = mask.device
    first, last, seen = _first_and_last(as_bytes)
    aligned = torch.arange(seq_q, device=device) + (seq_k - seq_q)  # the key row i is aligned with
    far = seq_q + seq_k
    lowest = torch.where(seen, first - aligned, far).amin()
    highest = torch.where(seen, last - aligned, -far).amax()
    padding = as_bytes.amax(dim=1)  # (B, Sk): keys some row sees
    # Visible entries of band AND padding: per row, the padding's count over the band's keys.
    before = torch.zeros(batch, seq_k + 1, dtype=torch.int64, device=device)
    before[:, 1:] = padding.cumsum(dim=1)
    start = (aligned + lowest).clamp(0, seq_k)
    stop = (aligned + highest + 1).clamp(0, seq_k)
    expected = (before[:, stop] - before[:, start]).clamp(min=0).sum()
    largest_byte, lowest, highest, visible, expected = torch.stack(
        [as_bytes.amax().long(), lowest, highest, torch.count_nonzero(as_bytes), expected]
    ).tolist()  # the one host sync
    if largest_byte > 1 or lowest > 0 or highest < 0 or visible != expected:
        return None
    # Sides that reach past every key are unbounded (FA2's -1).
    left = UNBOUNDED if lowest <= -(seq_k - 1) else -lowest
    right = UNBOUNDED if highest >= seq_q - 1 else highest
    padding = padding.bool()
    return MaskFacts(left, right, None if bool(padding.all()) else padding)


def _first_and_last(as_bytes: torch.Tensor, width: int = 64):
    """(first, last, seen): per row of a (B, Sq, Sk) 0/1 uint8 tensor, the first and last key
    it sees and whether it sees one. Rows are cut into blocks of ``width`` keys: a vectorised
    max finds the blocks that hold a 1, an argmax over the few blocks the outer ones, one over
    ``width`` keys within them; a tail of fewer than ``width`` keys is read as it is."""
    seq_k = as_bytes.shape[-1]
    whole = seq_k - seq_k % width
    found = []  # (first, last, seen) of the blocked part and of the tail, in key order
    if whole:
        blocks = as_bytes[..., :whole].unflatten(-1, (whole // width, width))  # (B, Sq, blocks, width)
        holds = blocks.amax(dim=-1)  # (B, Sq, blocks)
        first_block = holds.argmax(dim=-1)
        last_block = holds.shape[-1] - 1 - holds.flip(-1).argmax(dim=-1)

        def within(block):
            keys = blocks.gather(-2, block[..., None, None].expand(*block.shape, 1, width)).squeeze(-2)
            return keys, block * width

        keys, offset = within(first_block)
        first = offset + keys.argmax(dim=-1)
        keys, offset = within(last_block)
        last = offset + (width - 1 - keys.flip(-1).argmax(dim=-1))
        found.append((first, last, holds.amax(dim=-1).bool()))
    if whole < seq_k:
        tail = as_bytes[..., whole:]
        first = whole + tail.argmax(dim=-1)
        last = seq_k - 1 - tail.flip(-1).argmax(dim=-1)
        found.append((first, last, tail.amax(dim=-1).bool()))
    if len(found) == 1:
        return found[0]
    (first_a, last_a, seen_a), (first_b, last_b, seen_b) = found
    return torch.where(seen_a, first_a, first_b), torch.where(seen_b, last_b, last_a), seen_a | seen_b


FACTS_SIZE = 4  # [is a band, left, right, has key padding]


def _mask_facts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(facts, key_padding) of a (batch, 1, Sq, Sk) bool mask as it is now: ``facts`` a CPU
    int64 [is a band, left, right, has key padding], ``key_padding`` (batch, Sk) bool, a new
    tensor (all True without padding)."""
    facts = check_mask(mask)
    batch, seq_k = mask.shape[0], mask.shape[-1]
    if facts is None or facts.key_padding is None:
        padding = torch.ones(batch, seq_k, dtype=torch.bool, device=mask.device)
    else:
        padding = facts.key_padding
    if facts is None:
        return torch.zeros(FACTS_SIZE, dtype=torch.int64), padding
    known = [1, facts.left, facts.right, int(facts.key_padding is not None)]
    return torch.tensor(known, dtype=torch.int64), padding


def _facts_fake(mask):
    batch, seq_k = mask.shape[0], mask.shape[-1]
    return torch.empty(FACTS_SIZE, dtype=torch.int64, device="cpu"), mask.new_empty((batch, seq_k), dtype=torch.bool)


mask_facts = define_op("mask_facts(Tensor mask) -> (Tensor, Tensor)", _mask_facts, _facts_fake)


def _position_facts(
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    low: int,
    high: int,
    left: int,
    right: int,
    key_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(facts, key_padding) for a mask proven to be the window (left, right) inside packed
    sequences, AND ``key_padding != 0`` where given, wherever every position lies in
    [low, high) (``Band.assumes``): ``facts`` says whether they do now (one reduction and one
    host sync); the padding returned is a bool tensor of its own (all True without one),
    shaped like the segment ids."""
    inside = bool(((positions >= low) & (positions < high)).all())
    facts = torch.tensor([int(inside), left, right, int(key_padding is not None)], dtype=torch.int64)
    if key_padding is None:
        return facts, torch.ones(segment_ids.shape, dtype=torch.bool, device=segment_ids.device)
    return facts, key_padding != 0


def _position_facts_fake(positions, segment_ids, low, high, left, right, key_padding=None):
    return torch.empty(FACTS_SIZE, dtype=torch.int64, device="cpu"), segment_ids.new_empty(
        segment_ids.shape, dtype=torch.bool
    )


position_facts = define_op(
    "position_facts(Tensor positions, Tensor segment_ids, SymInt low, SymInt high, SymInt left, SymInt right, "
    "Tensor? key_padding=None) -> (Tensor, Tensor)",
    _position_facts,
    _position_facts_fake,
)


# -- the op ------------------------------------------------------------------------------------

SDPA_WITH_MASK, BAND, CAUSAL, NO_MASK, CHAIN = range(5)
PATH_NAMES = {
    SDPA_WITH_MASK: "sdpa with the mask",
    BAND: "band",
    CAUSAL: "sdpa causal",
    NO_MASK: "sdpa without a mask",
    CHAIN: "the chain of ops",
}
# Each forward call records the path it took in the profiler, under this prefix and its name:
# what ran, for users (a trace) and tests (``torch.profiler.profile``).
PATH_RECORD = "compile_pass::mask_input "


def decide(
    query, key, mask, facts: torch.Tensor, key_padding: torch.Tensor, segment_ids=None, softcap=0.0, chain=False
):
    """(path, left, right, key_padding or None) for one call, from its mask's facts; with
    segment ids, the band holds inside packed sequences only. A chain's call (attention spelled
    out in ops, soft-capped where ``softcap``) takes the band or computes the chain itself."""
    is_band, left, right, has_padding = facts.tolist()  # a CPU tensor: no device sync
    known = MaskFacts(left, right, key_padding if has_padding else None) if is_band else None
    path, *rest = _path(query, key, mask, known, segment_ids is not None, softcap, chain)
    return (path, *rest) if path == BAND or not chain else (CHAIN, 0, 0, None)


def _path(query, key, mask, facts: MaskFacts | None, packed: bool, softcap=0.0, chain=False):
    batch, _, seq_q, _ = query.shape
    seq_k = key.shape[2]
    if facts is None or mask.dim() != 4 or tuple(mask.shape[1:]) != (1, seq_q, seq_k):
        return SDPA_WITH_MASK, 0, 0, None
    padding = facts.key_padding
    if padding is not None and tuple(padding.shape) != (batch, seq_k):
        return SDPA_WITH_MASK, 0, 0, None
    # A side reaching past every key is unbounded.
    left = UNBOUNDED if facts.left >= seq_k - 1 else facts.left
    right = UNBOUNDED if facts.right >= seq_q - 1 else facts.right
    if left == UNBOUNDED:
        return _full_layer_path(query, key, left, right, padding, packed, softcap, chain)
    band = _band_facts(query, key, left, right, padding, packed, softcap, chain)
    if not policy.POLICY.choose(band, run_time=True).fast:
        return SDPA_WITH_MASK, 0, 0, None
    return BAND, left, right, padding


def _full_layer_path(query, key, left: int, right: int, padding, packed: bool, softcap=0.0, chain=False):
    """The path of a band with no left bound (a full-attention layer), by the call's lengths and
    the masks it turned out to have: the band where the policy has a kernel faster than what SDPA
    runs for it (packed documents or padded rows on the CPU: one fused call per document, or
    one over the batch where every row is one document); else SDPA's own ``is_causal`` for a
    plain causal mask with Sq == Sk, SDPA without a mask where every key is visible, and SDPA
    with the mask for the rest."""
    unmasked = runs_unmasked(left, right, query.shape[2] == key.shape[2], padding is not None or packed)
    facts = _band_facts(query, key, left, right, padding, packed, softcap, chain)._replace(
        sdpa_unmasked=unmasked and not chain
    )
    if policy.POLICY.choose(facts, run_time=True).fast:
        return BAND, left, right, padding
    if unmasked:
        return (NO_MASK if right == UNBOUNDED else CAUSAL), 0, 0, None
    return SDPA_WITH_MASK, 0, 0, None


def _band_facts(query, key, left: int, right: int, padding, packed: bool, softcap=0.0, chain=False) -> CallFacts:
    """The facts of the window op's call on the band path, as that call gives them
    (``AttentionCall.facts``): a measurement made for one answers the other. A chain's call is
    weighed against the chain (``CallFacts.spelled``)."""
    return CallFacts(
        query.device,
        query.dtype,
        query.shape[-1],
        query.shape[2] == key.shape[2],
        padding is not None,
        packed,
        False,
        key.shape[2],
        left,
        right,
        softcap=bool(softcap),
        spelled=chain,
        batch=query.shape[0],
        heads=query.shape[1],
        kv_heads=key.shape[1],
        queries=query.shape[2],
    )


def _mask_input_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    facts: torch.Tensor,
    key_padding: torch.Tensor,
    scale: float,
    enable_gqa: bool,
    segment_ids: torch.Tensor | None = None,
    keep_mask: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    chain: bool = False,
    fill: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, logsumexp, decision, saved mask). ``facts`` and ``key_padding`` are
    ``mask_facts(mask)``. ``decision`` is a CPU int64 (path, left, right, has padding, whether
    SDPA's fused CPU kernel ran, the
    mask's 4 sizes); the saved mask is the mask's entries, flat, where SDPA with the mask ran
    (the backward needs them) or ``keep_mask`` is set, and empty on every other path.
    ``keep_mask`` is for calls in an activation-checkpoint body: its recomputation in the
    backward may take another path (the mask written in between), and torch's checkpoint
    refuses saved tensors whose shapes differ from the forward's; the copy lives only while
    the body's backward runs. ``out`` is stored heads-last on every path. The logsumexp is
    the plain one (without the sinks), and zeros where SDPA ran without returning one.

    ``chain``: the call is attention spelled out in ops, its scores soft-capped where ``softcap``
    (FA2's): off the band path the op computes that chain (``chain.py``), the float mask added to
    the scores or, for a bool mask, the hidden scores replaced by ``fill``. No sinks then."""
    _check_inputs(query, scale, sinks, softcap, chain)
    path, left, right, padding = decide(query, key, mask, facts, key_padding, segment_ids, softcap, chain)
    kept = path in (SDPA_WITH_MASK, CHAIN) or keep_mask
    saved_mask = mask.clone(memory_format=torch.contiguous_format).view(-1) if kept else mask.new_empty(0)
    fused = False  # SDPA's fused CPU kernel ran, whose backward the backward calls
    with torch.profiler.record_function(PATH_RECORD + PATH_NAMES[path]):
        if path == BAND:
            out, logsumexp = sliding_window_attention_forward(
                query, key, value, left, right, scale, padding, segment_ids, None, None, None, None, softcap
            )
        elif path == CHAIN:
            out = spelled_chain.forward(query, key, value, mask, scale, softcap, fill)
            logsumexp = new_logsumexp(query).zero_()  # not read: the chain's backward runs it again
        else:
            sdpa_mask = mask if path == SDPA_WITH_MASK else None
            out, logsumexp, fused = sdpa.forward(query, key, value, sdpa_mask, path == CAUSAL, scale, enable_gqa)
    if sinks is not None and path not in (BAND, CHAIN) and not fused:
        raise RuntimeError(
            f"mask_input_attention_forward: sinks need a logsumexp, and SDPA ({PATH_NAMES[path]}) on "
            f"{query.device.type} ran without aten's fused CPU kernel, which alone returns one here"
        )
    apply_sinks(out, logsumexp, sinks)
    decision = [path, left, right, int(padding is not None), int(fused), *mask.shape]
    return out, logsumexp, torch.tensor(decision, dtype=torch.int64), saved_mask


def _check_inputs(query, scale: float, sinks, softcap: float, chain: bool) -> None:
    """The forward op's checks, which its fake makes too."""
    check_scale(scale)
    check_sinks(query, sinks)
    check_softcap(softcap)
    torch._check_value(
        chain or not softcap, lambda: "a softcap is a chain's (chain=True): SDPA's fallback paths have none"
    )
    torch._check_value(not (chain and sinks is not None), lambda: "a chain's call takes no sinks")


def sinks_refused(device: torch.device) -> str | None:
    """Why a call with sinks on this device may fail at run time, or None: SDPA's fallback
    paths apply sinks from aten's fused CPU kernel's logsumexp, which SDPA returns nowhere else."""
    if device.type == "cpu":
        return None
    return f"sinks need a logsumexp from SDPA's fallback paths, which SDPA on {device.type} does not return"


def _path_dependent_size():
    """A size known only at run time (the saved mask's: empty unless SDPA with the mask ran).
    Made directly on the shape environment, as torch's own device-mesh ops do: the public
    ``new_dynamic_size`` refuses where Dynamo does not capture data-dependent shapes (any
    compile without fullgraph=True), although this size never reaches Python code."""
    shape_env = torch.library.get_ctx()._shape_env
    if shape_env is None:  # a fake mode without symbolic sizes: nothing to trace
        raise torch._subclasses.fake_tensor.DynamicOutputShapeException(mask_input_attention_forward)
    size = shape_env.create_unbacked_symint()
    torch.fx.experimental.symbolic_shapes._constrain_range_for_size(size)
    return size


def _forward_fake(
    query,
    key,
    value,
    mask,
    facts,
    key_padding,
    scale,
    enable_gqa,
    segment_ids=None,
    keep_mask=False,
    sinks=None,
    softcap=0.0,
    chain=False,
    fill=None,
):
    _check_inputs(query, scale, sinks, softcap, chain)
    decision = torch.empty(5 + mask.dim(), dtype=torch.int64, device="cpu")
    saved_mask = mask.new_empty(mask.numel() if keep_mask else _path_dependent_size())

    return empty_like_heads_last(query), new_logsumexp(query), decision, saved_mask


def _mask_input_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    saved_mask: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    decision: torch.Tensor,
    key_padding: torch.Tensor,
    scale: float,
    enable_gqa: bool,
    segment_ids: torch.Tensor | None = None,
    softcap: float = 0.0,
    fill: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    path, left, right, has_padding, fused, *mask_shape = decision.tolist()  # a CPU tensor: no device sync
    if path == BAND:
        padding = key_padding if has_padding else None
        return sliding_window_attention_backward(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            left,
            right,
            scale,
            padding,
            segment_ids,
            None,
            None,
            None,
            softcap,
        )
    mask = saved_mask.view(mask_shape) if path in (SDPA_WITH_MASK, CHAIN) else None
    if path == CHAIN:
        return spelled_chain.backward(grad_out, query, key, value, mask, scale, softcap, fill)
    return sdpa.backward(
        grad_out, query, key, value, mask, path == CAUSAL, out, logsumexp, scale, enable_gqa, bool(fused)
    )


def _setup_context(ctx, inputs, output):
    query, key, value, _, _, key_padding, scale, enable_gqa, segment_ids, _, sinks, softcap, _, fill = inputs
    out, logsumexp, decision, saved_mask = output
    # Not the mask: the caller may write it before the backward (SDPA keeps a copy too).
    ctx.save_for_backward(query, key, value, saved_mask, out, logsumexp, decision, key_padding, segment_ids, sinks)
    ctx.scale, ctx.enable_gqa, ctx.softcap, ctx.fill = scale, enable_gqa, softcap, fill
    ctx.mark_non_differentiable(logsumexp, decision, saved_mask)


def _backward(ctx, grad_out, _logsumexp, _decision, _saved_mask):
    query, key, value, saved_mask, out, logsumexp, decision, key_padding, segment_ids, sinks = ctx.saved_tensors
    # The backward op is the paths' own: it takes the rescaled gradient.
    grad_out, grad_sinks = sink_gradients(grad_out, out, logsumexp, sinks)
    grads = mask_input_attention_backward(
        grad_out,
        query,
        key,
        value,
        saved_mask,
        out,
        logsumexp,
        decision,
        key_padding,
        ctx.scale,
        ctx.enable_gqa,
        segment_ids,
        ctx.softcap,
        ctx.fill,
    )
    return (*grads, None, None, None, None, None, None, None, grad_sinks, None, None, None)


mask_input_attention_backward = define_op(
    "mask_input_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor saved_mask, "
    "Tensor out, Tensor logsumexp, Tensor decision, Tensor key_padding, float scale, bool enable_gqa, "
    "Tensor? segment_ids=None, float softcap=0.0, float? fill=None) -> (Tensor, Tensor, Tensor)",
    _mask_input_attention_backward,
    backward_fake,
)
mask_input_attention_forward = define_op(
    "mask_input_attention_forward(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor facts, "
    "Tensor key_padding, float scale, bool enable_gqa, Tensor? segment_ids=None, bool keep_mask=False, "
    "Tensor? sinks=None, float softcap=0.0, bool chain=False, float? fill=None) -> (Tensor, Tensor, Tensor, Tensor)",
    _mask_input_attention_forward,
    _forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)
