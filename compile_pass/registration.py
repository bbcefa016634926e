"""How the project's opaque ops are registered: ``torch.library.Library`` directly.

``torch.library.custom_op`` costs about 17 us more per call than a dispatcher kernel
(``benchmarks/bench_registration.py``): its Python wrappers around the kernel (a metadata
object, dynamo's disable guard, the outputs' aliasing check) run on every call, and on short
sequences the attention op's fixed cost per call decides whether it is as fast as SDPA.
Registered here, one call is the dispatcher, one Python ``Autograd`` kernel that runs an
``autograd.Function`` only where a gradient is wanted, and the kernel itself. custom_op also
checked on every call that no output aliases an input; ``torch.library.opcheck`` checks it
in the tests for the ops a test can call alone (the sliding-window and mask-input ops). The
context-parallel ops return only tensors they allocate (``torch.cat``, new buffers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch._C import DispatchKey, DispatchKeySet, _after_autograd_keyset, _any_requires_grad, _AutoDispatchBelowAutograd

NAMESPACE = "compile_pass"
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")

# Where the keys left past autograd are exactly one dense backend's, the dispatcher would call
# the op's one kernel with nothing in between, and the autograd kernel calls it itself: a
# redispatch from Python costs as much again as the first crossing into Python (about 7 us at
# the attention op's 11 arguments). Any other key (a Python mode, a subclass, fake tensors,
# functionalization, tensors on two devices) redispatches.
_DIRECT_KEYSETS = frozenset(DispatchKeySet(key).raw_repr() for key in (DispatchKey.CPU, DispatchKey.CUDA))
# What ``_AutoDispatchBelowAutograd`` leaves out of dispatch (c10's autograd_dispatch_keyset).
_AUTOGRAD_KEYS = (
    DispatchKeySet(DispatchKey.AutogradFunctionality)
    | DispatchKeySet(DispatchKey.AutogradOther)
    | DispatchKeySet(DispatchKey.AutogradNestedTensor)
)


@contextlib.contextmanager
def autograd_recorded():
    """Autograd recorded again inside an op's kernel. The dispatcher runs a kernel below
    autograd (``_AutoDispatchBelowAutograd``: no op in it records a graph, whatever the grad
    mode), so a backward kernel that differentiates a recomputation (a library that offers its
    backward only through autograd) needs the autograd keys back for that stretch."""
    excluded = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def define_op(
    schema: str,
    kernel: Callable,
    fake: Callable,
    *,
    setup_context: Callable | None = None,
    backward: Callable | None = None,
) -> torch._ops.OpOverload:
    """Defines ``compile_pass::<schema>`` with ``kernel`` for every device, ``fake`` for
    tracing, and autograd: ``setup_context(ctx, inputs, output)`` and ``backward(ctx,
    *grads)`` as ``register_autograd`` takes them, or none (a gradient through it raises)."""
    if (setup_context is None) != (backward is None):
        raise ValueError("define_op takes setup_context and backward together, or neither")
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=LIBRARY)
    LIBRARY.impl(name, _autograd_kernel(op, kernel, setup_context, backward), "Autograd", with_keyset=True)
    return op


def _autograd_kernel(
    op: torch._ops.OpOverload, kernel: Callable, setup_context: Callable | None, backward: Callable | None
) -> Callable:
    # The dispatcher leaves out trailing arguments equal to their defaults; setup_context
    # reads every input.
    defaults = tuple(argument.default_value for argument in op._schema.arguments)

    def below_autograd(keyset, args):
        rest = keyset & _after_autograd_keyset
        with _AutoDispatchBelowAutograd():
            if rest.raw_repr() in _DIRECT_KEYSETS:
                return kernel(*args)
            return op.redispatch(rest, *args)

    def forward(ctx, keyset, *args):
        output = below_autograd(keyset, args)
        setup_context(ctx, (*args, *defaults[len(args) :]), output)
        return output

    def backward_with_keyset(ctx, *grads):
        return (None, *backward(ctx, *grads))

    # Named after the op, so that a grad_fn says which op made a tensor.
    Function = type(
        op._opname,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_with_keyset)},
    )

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and _any_requires_grad(*args):
            if backward is None:
                raise RuntimeError(f"{op} has no derivative: it is called only where no gradient flows through it")
            return Function.apply(keyset, *args)
        return below_autograd(keyset, args)

    return autograd_kernel
