"""A rule's ``replace`` that fails at any of its edits leaves every graph exactly as it was: the
call is kept with the reason and a warning, and the program computes what eager does.

The failure is injected at the k-th edit a ``replace`` makes (a node created, a node's uses
moved, a node's arguments set), for k = 1, 2, ... until a run makes every edit without one."""

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass import graphs
from compile_pass.backend import RULES
from tests.helpers.small_graphs import qkv

W = 4


class InjectedFault(RuntimeError):
    pass


class FaultAtEdit:
    """Counts the graph edits made inside the rules' ``replace`` and raises at the k-th, before
    it changes anything (a failure between two edits)."""

    def __init__(self, monkeypatch):
        self.k, self.count, self.fired, self.replacing = 0, 0, False, False
        for rule in RULES.values():
            monkeypatch.setattr(rule, "replace", self._replacing(rule.replace))
        monkeypatch.setattr(torch.fx.Graph, "create_node", self._edit(torch.fx.Graph.create_node))
        monkeypatch.setattr(torch.fx.Node, "replace_all_uses_with", self._edit(torch.fx.Node.replace_all_uses_with))
        setattr_ = torch.fx.Node.__setattr__
        edit_call = self._edit(setattr_)
        monkeypatch.setattr(
            torch.fx.Node,
            "__setattr__",
            lambda node, name, value: (edit_call if name in ("args", "kwargs") else setattr_)(node, name, value),
        )

    def arm(self, k):
        self.k, self.count, self.fired = k, 0, False

    def _replacing(self, replace):
        def wrapped(plan, context):
            self.replacing, self.count = True, 0
            try:
                return replace(plan, context)
            finally:
                self.replacing = False

        return wrapped

    def _edit(self, function):
        def wrapped(*args, **kwargs):
            if self.replacing:
                self.count += 1
                if self.count == self.k:
                    self.fired = True
                    raise InjectedFault(f"edit {self.k}")
            return function(*args, **kwargs)

        return wrapped


class Recording:
    """A backend: each graph's code (root and checkpoint bodies) before and after the rewrite."""

    def __init__(self, **switches):
        self.before, self.after, self.reports = [], [], []
        self.switches = switches

    def __call__(self, gm, example_inputs):
        self.before.append(_code(gm))
        self.reports.append(compile_pass.rewrite(gm, **self.switches))
        self.after.append(_code(gm))
        return gm.forward


def _code(gm):
    return [scope.module.graph.python_code("self").src for scope in graphs.scopes(gm)]


def _band(seq):
    i = torch.arange(seq)
    return (i[None, :] > i[:, None] - W) & (i[None, :] <= i[:, None])


def _sliding(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2]))


def _padded_sliding_in_a_checkpoint(q, k, v, padding):
    mask = _band(q.shape[2])[None, None] & (padding[:, None, None, :] != 0)
    attend = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    return torch.utils.checkpoint.checkpoint(attend, q, k, v, mask, use_reentrant=False)


def _packed(q, k, v, positions):
    first = positions[:, :1] - 1
    ids = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    pq, pk = positions[:, None, :, None], positions[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (pk <= pq) & (pk > pq - W))


def _sliding_under_autocast(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _sliding(q, k, v).float()


def _mask_input(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _causal(q, k, v):
    seq = q.shape[2]
    i = torch.arange(seq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=i[None, :] <= i[:, None])


def _topk(q, k, v):
    bias = q @ k.transpose(-1, -2)
    keep = torch.zeros_like(bias).scatter(-1, torch.topk(bias, k=3).indices, 1.0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(keep == 0, -1e9))


def _returns_its_mask(q, k, v, padding):
    """A graph that builds a mask and returns it (a graph break before the attention), under
    context parallel."""
    return q * k * v, _band(q.shape[2])[None, None] & (padding[:, None, None, :] != 0)


def _spelled_with_sinks(q, k, v, sinks, padding):
    """GPT-OSS's eager attention over a padded band: the op, its sinks and their run-time check."""
    visible = _band(q.shape[2])[None, None] & (padding[:, None, None, :] != 0)
    scores = q @ k.transpose(2, 3) * 0.5 + torch.where(
        visible, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min
    )
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)], dim=-1)
    return F.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1] @ v


def _inputs(case):
    q, k, v = qkv(batch=2)
    if case in (_padded_sliding_in_a_checkpoint, _returns_its_mask):
        return q, k, v, torch.tensor([[0] * 5 + [1] * 11, [1] * 16])
    if case is _spelled_with_sinks:
        return (
            q,
            k,
            v,
            torch.tensor([0.5, -1.0], dtype=q.dtype).requires_grad_(),
            torch.tensor([[0] * 5 + [1] * 11, [1] * 16]),
        )
    if case is _packed:
        return q, k, v, torch.cat([torch.arange(10), torch.arange(6)]).repeat(2, 1)
    if case is _mask_input:
        return q, k, v, _band(16).expand(2, 1, 16, 16).clone()
    if case is _sliding_under_autocast:
        return tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    return q, k, v


CASES = {
    "sliding": (_sliding, "rewritten: window (3, 0)"),
    "padding in a checkpoint body": (_padded_sliding_in_a_checkpoint, "rewritten: window (3, 0), key padding"),
    "packed (checked positions)": (_packed, "rewritten: window (3, 0), packed"),
    "autocast casts": (_sliding_under_autocast, "rewritten: window (3, 0)"),
    "mask input": (_mask_input, "rewritten: mask from input"),
    "causal": (_causal, "rewritten: "),
    "top-k": (_topk, "rewritten: top-k"),
    "mask certificate": (_returns_its_mask, "rewritten: masks certified"),
    "spelled out with sinks": (
        _spelled_with_sinks,
        "rewritten: attention spelled out in ops: window (3, 0) (additive mask), key padding",
    ),
}
SWITCHES = {"mask certificate": {"context_parallel": True}}  # and compiled with dynamic sizes


def _forward_and_grads(fn, inputs):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    floats = [t for t in inputs if t.requires_grad]
    return (*outs, *torch.autograd.grad(outs[0].float().nan_to_num().sum(), floats))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_failure_at_any_edit_leaves_every_graph_as_it_was(case, monkeypatch, caplog):
    fn, rewritten = CASES[case]
    fault = FaultAtEdit(monkeypatch)
    inputs = _inputs(fn)
    expected = _forward_and_grads(fn, inputs)
    for k in itertools.count(1):
        torch._dynamo.reset()
        recording = Recording(**SWITCHES.get(case, {}))
        fault.arm(k)
        with caplog.at_level(logging.WARNING, logger="compile_pass"):
            compiled = torch.compile(fn, backend=recording, fullgraph=True, dynamic=case in SWITCHES or None)
            results = _forward_and_grads(compiled, inputs)
        for ours, eager in zip(results, expected, strict=True):
            torch.testing.assert_close(ours, eager, atol=1e-6 if case == "autocast casts" else 1e-12, rtol=0)
        verdicts = [d.full_verdict for report in recording.reports for d in report]
        if not fault.fired:
            break
        assert recording.after == recording.before, f"edit {k} left a changed graph"
        assert f"InjectedFault: edit {k}" in caplog.text
        assert any(f"internal error: InjectedFault: edit {k}" in v for v in verdicts), verdicts
        assert not any(v.startswith("rewritten") for v in verdicts), verdicts
        caplog.clear()
    assert k > 1, "the rewrite made no edit"
    assert any(v.startswith(rewritten) for v in verdicts), verdicts
    assert recording.after != recording.before
