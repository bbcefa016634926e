"""Which values of a Dynamo graph may be tensor subclasses when the compiled graph runs.

The ops compile_pass inserts take plain tensors, and the proof reads a mask's ops with torch's
meaning for plain tensors. Dynamo traces a subclass without ``__torch_dispatch__`` on plain
fake tensors (only the placeholder's ``grapharg`` keeps the user's type), so the graph alone
does not say where one flows. Two questions, two walks from the inputs the caller passed as
subclasses:

- ``computed_from_subclass``: every node computed from such an input, by any path. A mask
  must not be one: its proof reads the ops that built it, and a subclass may give them
  another meaning (a ``__torch_dispatch__`` subclass runs its own code for each op).
- ``subclass_values``: the nodes whose *value* may be a subclass instance at run time.
  Query, key and value need only that: SDPA and the op meet the very same tensors, so
  whatever computed them, the result is the same where they are plain. The walk stops at a
  node whose value is provably plain (``_plain_result``):

  * The input's type has no ``__torch_dispatch__`` of its own (a ``__torch_function__``
    subclass, or an ``nn.Parameter`` subclass such as bitsandbytes' ``Params4bit`` and
    ``Int8Params``): its tensors are ordinary ones below ``__torch_function__``. Dynamo
    (torch >= 2.13) inlines the subclass's ``__torch_function__`` into the graph
    (``variables/torch_function.py: dispatch_torch_function``) and then runs the compiled
    graph with subclass ``__torch_function__`` disabled (``OutputGraph``'s
    ``torch_function_subclass_inlined`` wrapper); where the type keeps torch's disabled
    ``__torch_function__`` (a Parameter's), results come back unconverted anyway. Either
    way a call that makes a new tensor object makes a plain one. A call that may hand back
    an operand as it is (``x.contiguous()``, ``x.to(x.dtype)``, an in-place op) passes the
    subclass object on, so only calls known to make a new object stop the walk
    (``_makes_new_tensor``). An activation-checkpoint body runs again in the backward,
    outside Dynamo's wrapper: there the values that reach the op are made by the same calls
    on the same operands in SDPA's graph and in the rewritten one, and where an input
    object's ``__torch_function__`` meets the op, it meets SDPA's backward in the same place
    (a subclass that gives attention another meaning there has already given it one in the
    forward, where Dynamo traced it into the graph).
  * A ``__torch_dispatch__`` wrapper subclass that Dynamo traces (torchao's ``NF4Tensor``,
    ``TwoTensor``): Dynamo computes each node's fake value by running the subclass's
    dispatch on fake tensors, and AOTAutograd traces that same dispatch, so the fake value's
    type is the run-time type: a plain ``FakeTensor`` is a plain tensor, and a fake subclass
    (its ops carry it on) is not.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

from .graphs import Scope, checkpoint_operands, example_value

Origins = dict[torch.fx.Node, torch.fx.Node]

# Calls whose result is always a tensor object made by the call, never an operand handed back
# as it is (by any of their overloads). Views count: a view is a new object over the same
# storage, and its Python type is torch.Tensor where no __torch_function__ converts it.
_NEW_TENSOR_FUNCTIONS = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.neg,
        operator.matmul,
        operator.getitem,
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.cat,
        torch.stack,
        torch.transpose,
        torch.reshape,
        torch.permute,
        torch.unsqueeze,
        F.linear,
        torch._C._nn.linear,
    }
)
_NEW_TENSOR_METHODS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "matmul",
        "view",
        "reshape",
        "transpose",
        "permute",
        "unsqueeze",
        "expand",
        "clone",
    }
)


def user_value(placeholder: torch.fx.Node) -> Any:
    """What the caller passed for a graph input, as Dynamo recorded it (its fake value where
    the graph did not come from Dynamo)."""
    grapharg = placeholder.meta.get("grapharg")
    return grapharg.example if grapharg is not None else example_value(placeholder)


def computed_from_subclass(scope_list: list[Scope]) -> Origins:
    """Node -> the subclass input it is computed from, for every node computed from one."""
    return _walk(scope_list, lambda node, origin: False)


def subclass_values(scope_list: list[Scope]) -> Origins:
    """Node -> the subclass input it comes from, for every node whose value may be a subclass
    instance at run time."""
    return _walk(scope_list, _plain_result)


def _walk(scope_list: list[Scope], plain: Callable[[torch.fx.Node, torch.fx.Node], bool]) -> Origins:
    """Forward from the subclass inputs; ``plain(node, origin)`` stops the walk at a
    node. Conservative: a checkpoint call is reached where any operand is, and a body's
    placeholder where any call's operand is."""
    reached: Origins = {}
    for scope in scope_list:  # parents before the bodies they call
        for position, node in enumerate(scope.module.graph.find_nodes(op="placeholder")):
            if not scope.callers and _subclass_input(node):
                reached[node] = node
            for caller in scope.callers:
                operand = checkpoint_operands(caller)[position]
                if operand in reached and node not in reached:
                    reached[node] = reached[operand]
        for node in scope.module.graph.nodes:
            # every subclass that reaches the node must leave its value plain, not only the first
            origins = [reached[i] for i in node.all_input_nodes if i in reached]
            if node.op != "placeholder" and origins and not all(plain(node, origin) for origin in origins):
                reached[node] = origins[0]
    return reached


def _subclass_input(placeholder: torch.fx.Node) -> bool:
    value = user_value(placeholder)
    return isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter, FakeTensor)


def _plain_result(node: torch.fx.Node, origin: torch.fx.Node) -> bool:
    """Whether ``node``'s value is a plain tensor at run time though an operand may be a
    subclass instance from ``origin`` (the module docstring says why each case is sound)."""
    kind = type(user_value(origin))
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or type(value) is not FakeTensor:
        return False  # not one tensor, or a fake subclass: the subclass carries itself on
    if is_traceable_wrapper_subclass_type(kind):
        return True
    return kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__ and _makes_new_tensor(node)


def _makes_new_tensor(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _NEW_TENSOR_METHODS
    if node.op != "call_function" or "out" in node.kwargs:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        # An operator's schema says where a result may be an operand: Tensor(a) or Tensor(a!).
        returns = node.target._schema.returns
        return bool(returns) and all(r.alias_info is None and isinstance(r.type, torch.TensorType) for r in returns)
    if node.target is operator.getitem:  # indexing a tensor makes a view; a tuple's item is what the call made
        return isinstance(example_value(node.args[0]), torch.Tensor)
    return node.target in _NEW_TENSOR_FUNCTIONS
