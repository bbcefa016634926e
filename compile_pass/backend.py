"""Ways in: ``rewrite(gm)``, ``torch.compile(backend=compile_pass.backend)`` (also by the name
"compile_pass"), and ``with compile_pass.enable():`` for the default inductor backend."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes

from . import graphs
from .proof import MaskEvaluator
from .report import Decision, Report, logger
from .ops import mask_input as mask_input_op
from .rules import causal_mask, mask_input, sliding_window, topk_mask

# Rule name -> module with apply(node, evaluator) -> (rewritten, reason, maybe_dead) | None.
# Rules are tried in this order; the first to rewrite a node wins.
RULES = {rule.NAME: rule for rule in (sliding_window, causal_mask, mask_input, topk_mask)}
DISABLE_VARIABLE = "COMPILE_PASS_DISABLE"


def disabled() -> bool:
    """``COMPILE_PASS_DISABLE=1`` turns every rule off."""
    return os.environ.get(DISABLE_VARIABLE, "") == "1"


def _active_rules(switches: dict[str, bool]) -> list[str]:
    unknown = set(switches) - set(RULES)
    if unknown:
        raise ValueError(f"unknown compile_pass rules {sorted(unknown)}; known: {sorted(RULES)}")
    if disabled():
        return []
    return [name for name in RULES if switches.get(name, True)]


def rewrite(gm: torch.fx.GraphModule, **switches: bool) -> Report:
    """Apply the rules to a Dynamo GraphModule in place; returns every decision made.

    ``switches`` turn rules off by name, e.g. ``rewrite(gm, sliding_window=False)``.
    ``report.attested_outputs`` lists the graph's outputs proven to be band masks, for
    ``attesting`` to mark when the compiled graph runs (the ``mask_input`` rule).
    """
    report = Report()
    report.attested_outputs = []
    active = _active_rules(switches)
    if not active:
        return report
    scope_list = list(graphs.scopes(gm))
    evaluator = MaskEvaluator(graphs.placeholder_operands(scope_list).get)
    if mask_input.NAME in active:
        report.attested_outputs = _attested_outputs(gm, evaluator)
    maybe_dead: set[torch.fx.Node] = set()
    for scope in scope_list:
        for node in list(scope.module.graph.nodes):
            kept = None  # the first rule's reason, reported if no rule rewrites the node
            for name in active:
                outcome = _apply(name, node, evaluator)
                if outcome is None:
                    continue
                rewritten, reason, dead = outcome
                decision = Decision(name, scope.name, node.name, rewritten, reason)
                if rewritten:
                    report.append(decision)
                    maybe_dead |= dead
                    kept = None
                    break
                kept = kept or decision
            if kept is not None:
                report.append(kept)
    if report.rewritten():
        maybe_dead |= set(evaluator.visited())
        # Bodies first: a body input left unused frees its operand in the parent.
        for scope in reversed(scope_list):
            graphs.erase_if_dead(scope.module.graph, maybe_dead)
            graphs.drop_unused_placeholders(scope)
        for scope in scope_list:
            graphs.erase_if_dead(scope.module.graph, maybe_dead)
            scope.module.graph.lint()
            scope.module.recompile()
    report.log()
    return report


def _apply(name: str, node: torch.fx.Node, evaluator: MaskEvaluator):
    """One rule on one node. A rule never breaks the user's compile: an unexpected exception
    becomes a kept decision and a warning. Rules change the graph only after everything that
    can fail has run, so the node is left as it was."""
    try:
        return RULES[name].apply(node, evaluator)
    except Exception as error:  # noqa: BLE001 - any failure inside a rule must keep the graph
        reason = f"internal error: {type(error).__name__}: {error}"
        logger.warning("compile_pass rule %s on %s: %s", name, node.name, reason, exc_info=True)
        return False, reason, set()


def _attested_outputs(gm: torch.fx.GraphModule, evaluator: MaskEvaluator):
    try:
        return mask_input.attested_outputs(gm.graph, evaluator)
    except Exception:  # noqa: BLE001 - a rule never breaks a compile; nothing is attested
        logger.warning("compile_pass could not read the graph's output masks", exc_info=True)
        return []


def attesting(compiled, report: Report):
    """``compiled`` (a graph's compiled callable, called by Dynamo with the graph's inputs),
    attesting the output masks ``rewrite`` proved each time it runs, so graphs that receive
    them as inputs can use their band."""
    attestations = getattr(report, "attested_outputs", [])
    if not attestations:
        return compiled

    def run(*inputs):
        paddings = {a.padding_input: inputs[a.padding_input] for a in attestations if a.padding_input is not None}
        outputs = compiled(*inputs)
        for attestation in attestations:
            padding = paddings.get(attestation.padding_input)
            band = attestation.band
            if padding is not None:
                if band.key_padding_row0 and padding.shape[0] != 1:
                    continue
                # A copy: the mask was built from the input as it is now, whatever is written later.
                padding = padding.clone() if padding.dtype == torch.bool else padding != 0
            facts = mask_input_op.MaskFacts(band.left, band.right, padding, "proven")
            mask_input_op.attest(outputs[attestation.output], facts)
        return outputs

    return run


def _split_options(options: dict[str, Any] | None) -> tuple[dict[str, bool], dict[str, Any]]:
    """Rule switches (keys named after rules) and the rest, which goes to inductor."""
    options = dict(options or {})
    switches = {name: bool(options.pop(name)) for name in list(options) if name in RULES}
    return switches, options


def backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options=None):
    """``torch.compile(model, backend=compile_pass.backend, mode=..., options=...)``.

    ``options`` may switch rules off (``{"sliding_window": False}``); every other key is an
    inductor config option, as with the default backend.
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    switches, inductor_options = _split_options(options)
    report = rewrite(gm, **switches)
    config_patches = {**(list_mode_options(mode) if mode else {}), **inductor_options}
    return attesting(compile_fx(gm, example_inputs, config_patches=config_patches), report)


class RewritePass(CustomGraphPass):
    """The rules as inductor's pre-grad custom pass. Its uuid names the active rule set
    and this package's source, so toggling a rule never reuses a stale compiled graph."""

    def __init__(self, **switches: bool):
        self.rules = tuple(_active_rules(switches))

    def __call__(self, graph: torch.fx.Graph) -> None:
        # Inductor runs pre-grad passes on subgraphs before their parent. A checkpoint
        # body alone cannot see where its mask comes from; the parent's run rewrites it.
        # Dynamo marks the placeholders of the graphs it outputs (not of bodies) with a grapharg.
        is_dynamo_output = all("grapharg" in node.meta for node in graph.find_nodes(op="placeholder"))
        if self.rules and is_dynamo_output:
            rewrite(graph.owning_module, **{name: name in self.rules for name in RULES})

    def uuid(self) -> str:
        digest = hashlib.sha256(",".join(self.rules).encode())
        for path in sorted(_package_sources()):
            with open(path, "rb") as source:
                digest.update(source.read())
        return digest.hexdigest()


def _package_sources() -> list[str]:
    root = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if name.endswith(".py")
    ]


@contextlib.contextmanager
def enable(**switches: bool):
    """Run the rules inside the default inductor backend for compilations in this block.

    ``with compile_pass.enable(): torch.compile(model)(inputs)``; the previous
    ``pre_grad_custom_pass`` setting is kept alongside and restored on exit.
    """
    from torch._inductor import config

    previous = config.pre_grad_custom_pass
    passes = (*get_custom_graph_passes(previous), RewritePass(**switches))
    config.pre_grad_custom_pass = passes if len(passes) > 1 else passes[0]
    try:
        yield
    finally:
        config.pre_grad_custom_pass = previous
