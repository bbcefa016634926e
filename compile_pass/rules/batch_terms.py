"""The band's batch terms as the sliding-window op's per-batch operands.

A proven band may AND key padding or segment ids (packed documents) into the window, or OR
image block ids. The op takes each as a (batch, keys) tensor; this module finds which tensor
of the graph holds them (``segment_sources``, ``batch_tensor_problem``), how it is read as
(batch, keys) (``padding_read_of``: a prefill chunk after a cache reads the padding shifted,
by a ``SizeSum`` of the graph's sizes), and puts the reads and the private copies the op saves
for its backward into the graph (``read_in_graph``, ``shared_copy``, ``layout_of``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from ..graphs import checkpoint_calls, example_value, fake_result
from ..proof import Band, MaskEvaluator, SegmentIds, as_sympy, input_name
from ..proof.engine import POS, Formula, nonnegative, right_aligned, shape_env_of
from ..sizes import same_size
from .attention import insert_before, own_copy

PRIVATE_COPY = torch.ops.compile_pass.private_copy.default
SEGMENT_PAIRS = torch.ops.compile_pass.segment_pairs.default
LAYOUT = torch.ops.compile_pass.varlen_layout.default


def padding_read_of(band: Band, key) -> tuple | str:
    """The calls that read the key padding ``P`` as (batch, Sk): none where key j's padding is
    P[b, j]; where it is P[b, j + o] (a prefill chunk after a cache, o the cache's first
    token), Sk columns of P from o: the last Sk (o + Sk is P's length), or from o computed from
    the graph's size inputs. Sk must be a number. A reason where they cannot be read so."""
    assert band.key_padding is not None, "a band without key padding has nothing to read"
    offset, keys, padding = band.key_padding_offset, key.shape[-2], band.key_padding.node
    length = example_value(padding).shape[-1]
    if offset == 0 and same_size(length, keys):
        return ()
    if not isinstance(keys, int):
        return f"the padding is read shifted by {offset} for a symbolic number of keys"
    if sympy.expand(offset + keys - as_sympy(length)) == 0:
        return ((torch.narrow, (1, -keys, keys)),)  # a negative start counts from the end
    start = SizeSum.of(offset, padding.graph)
    # The columns the mask reads exist (the proof takes slice starts it shows >= 0 and gathers
    # it shows inside P, and the mask's shape pins the stop); narrow would count a negative
    # start from the end, so o >= 0 is checked all the same.
    if start is None or not nonnegative(offset, shape_env_of(padding)):
        return f"the padding is read shifted by {offset}, which is not a sum of the graph's sizes known to be >= 0"
    return ((torch.narrow, (1, start, keys)),)


@dataclass(frozen=True)
class SizeSum:
    """``constant + sum(coefficient * size)``: a size the graph computes from its SymInt
    inputs (Dynamo lifts each size symbol as one), given to a read as an argument."""

    constant: int
    terms: tuple[tuple[int, torch.fx.Node], ...] = ()

    @classmethod
    def of(cls, expr: sympy.Expr, graph: torch.fx.Graph) -> SizeSum | None:
        sizes = {
            as_sympy(node): node
            for node in graph.find_nodes(op="placeholder")
            if isinstance(example_value(node), torch.SymInt)
        }
        constant, terms = 0, []
        for term in sympy.Add.make_args(sympy.expand(expr)):
            coefficient, symbol = term.as_coeff_Mul()
            if term.is_Integer:
                constant += int(term)
            elif coefficient.is_Integer and symbol in sizes:
                terms.append((int(coefficient), sizes[symbol]))
            else:
                return None
        return cls(constant, tuple(terms))

    def example(self):
        return sum((coefficient * example_value(node) for coefficient, node in self.terms), self.constant)

    def insert_before(self, node: torch.fx.Node) -> torch.fx.Node | int:
        """The sum as nodes before ``node`` (SymInt arithmetic, as Dynamo records it)."""
        total: torch.fx.Node | int = self.constant
        for coefficient, size in self.terms:
            term = size if coefficient == 1 else insert_before(node, operator.mul, size, coefficient)
            total = insert_before(node, operator.add, term, total) if total != 0 else term
        return total


def segment_sources(band: Band, evaluator: MaskEvaluator, node: torch.fx.Node, query, key) -> tuple | str:
    """(tensor, read) for each set of the band's segment ids, the first usable tensor of each
    (``_segment_tensors``); two sets must come from one graph (the op gets them as one). Why
    not, where no tensor serves."""
    usable_sets = []
    for ids in band.segments:
        found = [
            (candidate, read, batch_tensor_problem(candidate, ids.row0, read, node, query, key))
            for candidate, read in _segment_tensors(ids, evaluator, node, query.shape[0])
        ]
        usable = [(candidate, read) for candidate, read, problem in found if problem is None]
        if not usable:
            return (found[0][2] if found else None) or "no tensor of the graph holds those ids by (batch, position)"
        usable_sets.append(usable)
    if len(usable_sets) < 2:
        return tuple(usable[0] for usable in usable_sets)
    pairs = [(a, b) for a in usable_sets[0] for b in usable_sets[1] if a[0].graph is b[0].graph]
    return pairs[0] if pairs else "its two sets of segment ids are held in different graphs"


def joined_ids(*ids: torch.Tensor, reads: list, private: bool) -> torch.Tensor:
    """The op's one set of segment ids from the example values of each set's tensor
    (``Plan.segments``): two sets joined (``segment_pairs``, a new tensor), one set in a
    private copy, or as it is (``private=False``)."""
    first, *other = (read_through(tensor, read) for tensor, read in zip(ids, reads, strict=True))
    if other:
        return SEGMENT_PAIRS(first, *other)
    return PRIVATE_COPY(first) if private else first


def _segment_tensors(segments: SegmentIds, evaluator: MaskEvaluator, node: torch.fx.Node, batch) -> Iterator[tuple]:
    """Tensors holding the segment ids, each with the calls that read them as (batch, S) (none:
    the tensor is that already): the atom's own tensor (read at (b, kv) or (0, kv)); or nodes
    the proof evaluated whose formula, right-aligned to (batch, heads, q, kv), is the ids at
    (b, kv) and reads no other position (transformers' ``(kv_idx - offset[batch_idx]) // c``),
    one row expanded to a static batch where the ids do not depend on the row. The proof's
    invariant makes their elements the ids exactly; they must not have wrapped, and must
    exist where the op at ``node`` is called (``defined_before``)."""
    if segments.atom is not None:
        yield segments.atom.node, ()
        return
    ids = segments.at(POS[0], POS[3])
    for candidate in evaluator.visited():
        formula = evaluator.evaluate(candidate)
        if not (
            isinstance(formula, Formula) and 1 <= formula.ndim <= 4 and formula.wraps is None and not formula.is_bool
        ):
            continue
        value = example_value(candidate)
        if value.is_floating_point() or torch._C._functorch.is_batchedtensor(value):  # a vmap body's
            continue
        if right_aligned(formula, 4) == ids and defined_before(candidate, node):
            # A batch dimension is kept; any other leading dimension reads position 0.
            leading = (slice(None),) if formula.ndim == 4 else (None,)
            read: list[tuple] = [(operator.getitem, (leading + (0,) * (min(formula.ndim, 3) - 1) + (slice(None),),))]
            rows = value.shape[0] if formula.ndim == 4 else 1
            if POS[0] not in ids.free_symbols and isinstance(batch, int) and same_size(rows, 1) and batch != 1:
                read.append((torch.Tensor.expand, (batch, -1)))
            yield candidate, tuple(read)


def batch_tensor_problem(tensor: torch.fx.Node, row0: bool, read: tuple, node: torch.fx.Node, query, key) -> str | None:
    """Why the op at ``node`` cannot take ``tensor`` (read through ``read``) as a per-batch
    (batch, keys) operand, else None."""
    if tensor.graph is not node.graph and not called_from(node.graph, tensor.graph):
        return f"{input_name(tensor)} is in a graph two levels up"
    shape = fake_result(lambda t: read_through(t, read), tensor).shape if read else example_value(tensor).shape
    if row0 and not same_size(shape[0], 1):
        return f"reads row 0 of {input_name(tensor)} for every batch row"
    if not (len(shape) == 2 and same_size(shape[0], query.shape[0]) and same_size(shape[1], key.shape[-2])):
        return f"{input_name(tensor)} is not (batch, keys)"
    if example_value(tensor).device != query.device:
        return f"{input_name(tensor)} is on {example_value(tensor).device}"
    return None


def defined_before(tensor: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``tensor`` is computed before ``node`` runs: earlier in its graph, or, for a node in an
    activation-checkpoint body, earlier in the calling graph than the body's first call (where
    ``own_copy`` puts its copy). The proof's memo holds nodes of every graph, in any order."""
    if tensor.graph is node.graph:
        return tensor < node
    callers = checkpoint_calls(tensor.graph, node.graph)
    return bool(callers) and tensor < callers[0]


def read_through(ids: torch.Tensor, calls: tuple) -> torch.Tensor:
    """``ids`` (an example value) read through ``calls``, each (function, arguments)."""
    for function, arguments in calls:
        ids = function(ids, *(a.example() if isinstance(a, SizeSum) else a for a in arguments))
    return ids


def read_in_graph(tensor: torch.fx.Node, calls: tuple, node: torch.fx.Node) -> torch.fx.Node:
    """``read_through(tensor, calls)`` as nodes just after ``tensor``, in its graph, for the op at
    ``node``: a node that reads so already (an earlier rewrite's) where it runs before."""
    for function, arguments in calls:
        existing = [
            user
            for user in tensor.users
            if user.target is function and user.args == (tensor, *arguments) and defined_before(user, node)
        ]
        if existing:
            tensor = existing[0]
            continue
        after = tensor.next
        while after.op == "placeholder":  # a body's inputs (and the sizes) stay first
            after = after.next
        arguments = tuple(a.insert_before(after) if isinstance(a, SizeSum) else a for a in arguments)
        tensor = insert_before(after, function, tensor, *arguments)
    return tensor


def given(*tensors) -> tuple:
    """The tensors that are not None (an op's optional trailing operands)."""
    return tuple(t for t in tensors if t is not None)


def batch_operands(
    padding, segment_ids, block_ids=None, layout=(None, None), sinks=None, softcap=0.0, keyless_mean=0.0
) -> tuple:
    """The op's optional trailing operands, up to the last one given (None before it; a float
    0.0 where a later one is given)."""
    tensors = (padding, segment_ids, block_ids, *layout, sinks)
    operands = (*tensors, softcap or None, keyless_mean or None)
    given = [index for index, operand in enumerate(operands) if operand is not None]
    kept = operands[: given[-1] + 1] if given else ()
    return tuple(0.0 if operand is None and index >= len(tensors) else operand for index, operand in enumerate(kept))


PRIVATE = "compile_pass_private"  # meta key of the copies the rule made for its ops


def shared_copy(tensor: torch.fx.Node, node: torch.fx.Node, function, *args) -> torch.fx.Node:
    """``own_copy``, shared with the calls before ``node`` in its graph that read the same
    tensor so: a copy this rule made (never the program's own node, which the program may
    write), which no one writes, so every op that reads it reads the same values."""
    if tensor.graph is node.graph:
        for user in tensor.users:
            if user.meta.get(PRIVATE) and user.target is function and user.args == (tensor, *args) and user < node:
                return user
    copy = own_copy(tensor, node, function, *args)
    copy.meta[PRIVATE] = True
    return copy


def layout_of(padding, segments, left: int, right: int, dtype, head_dim: int, node: torch.fx.Node) -> tuple:
    """The (pieces, sizes) nodes of the varlen layout of ``padding`` or ``segments`` (the
    rule's private copies) under the window: one ``LAYOUT`` call per graph for the calls that
    share them, before the first of them."""
    arguments = (padding, segments, left, right, dtype, head_dim)
    source = padding if padding is not None else segments
    layout = next((u for u in source.users if u.target is LAYOUT and u.args == arguments and u < node), None)
    if layout is None:
        layout = insert_before(node, LAYOUT, *arguments)
    return tuple(insert_before(node, operator.getitem, layout, index) for index in (0, 1))


def called_from(body: torch.fx.Graph, graph: torch.fx.Graph) -> bool:
    return bool(checkpoint_calls(graph, body))
