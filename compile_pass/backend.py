"""Ways in: ``rewrite(gm)``, ``torch.compile(backend=compile_pass.backend)`` (also by the name
"compile_pass"), and ``with compile_pass.enable():`` for the default inductor backend."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomGraphPassCallable, get_custom_graph_passes

from . import graphs, measure, subclasses
from .graphs import describe
from .parallel.shard_layout import CONTIGUOUS, LAYOUTS, group_name
from .proof import MaskEvaluator
from .report import ATTENTION, DISABLE_VARIABLE, TOPK, Decision, Report, call_site, logger
from .rules import (
    causal_mask,
    mask_certificate,
    mask_input,
    sharded_attention,
    sliding_window,
    spelled_attention,
    topk_mask,
)
from .rules.base import Context, Kept, Rule, Site

# Rule name -> rule module (the contract: ``rules/base.py``). Rules are tried in this order;
# the first to rewrite a node wins.
RULES: dict[str, Rule] = {
    rule.NAME: rule
    for rule in (
        sharded_attention,
        sliding_window,
        causal_mask,
        mask_input,
        spelled_attention,
        topk_mask,
        mask_certificate,
    )
}
"""The rule switches, in the order the rules are tried; each is on unless switched off by name
(``options={"causal_mask": False}``, ``enable(topk_mask=False)``, ``rewrite(gm, sliding_window=False)``):

- ``sharded_attention``: under the setting ``context_parallel``, every attention call attends
  across the shards of the sequence (and is then the only attention rule);
- ``sliding_window``: an SDPA call whose mask is proven a sliding band (with key padding, packed
  documents, chunks or image blocks) becomes the sliding-window op;
- ``causal_mask``: an SDPA call whose mask is proven plain causal (or shows every key) runs SDPA's
  own causal kernel with no mask (or no mask at all);
- ``mask_input``: an SDPA call whose mask is a graph input (FSDP2, regional compilation, graph
  breaks) reads the mask's band at run time, once per graph call;
- ``spelled_attention``: attention spelled out in ops (eager attention, GPT-OSS's sinks) becomes
  the same op;
- ``topk_mask``: top-k masks take the detached scatter form;
- ``mask_certificate``: under ``context_parallel``, a graph that returns masks it built files
  what it proved of them, for the graphs that attend with them.
"""

CONTEXT_PARALLEL, CONTEXT_PARALLEL_LAYOUT = sharded_attention.SETTING, sharded_attention.LAYOUT_SETTING
MEASURE = "measure"

# A checked option's value: a rule switch or setting (True or False), a process group's name,
# or a layout's name.
Switch = bool | str

# Options that are not rule switches, with their defaults; rules read them from their Context.
SETTINGS = {
    # Rewrite even where the op's kernel on that device and dtype is not known to be as fast
    # as SDPA (the sliding-window op's matmul/softmax fallback on a GPU without flash-attn).
    "slow_kernels": False,
    # The graph runs on one contiguous shard of the sequence per rank of a process group (True:
    # the default group; or a ProcessGroup, or one dimension of a DeviceMesh, held by its
    # name): every attention call must be rewritten to attend across the shards
    # (rules/sharded_attention.py), or the compile fails.
    CONTEXT_PARALLEL: False,
    # Which positions each rank holds: "contiguous" (rank r the r-th of P equal shards) or
    # "head-tail" (chunks r and 2P - 1 - r of 2P: equal causal work on every rank).
    CONTEXT_PARALLEL_LAYOUT: CONTIGUOUS,
    # How kernels are chosen (measure/__init__.py): "measure" (time them against SDPA on this device
    # where nothing measured covers a call, and cache it), "static" (the tables this project
    # measured only), "remeasure" (measure again, ignoring the cache); None: COMPILE_PASS_MEASURE,
    # else "measure".
    MEASURE: None,
}
"""The settings and their defaults, given as the rule switches are (``options=``, or keywords of
``enable()`` and ``rewrite()``):

- ``slow_kernels`` (``False``): rewrite even where no kernel of the op is measured at least as fast
  as SDPA on that device, dtype and size;
- ``context_parallel`` (``False``): the graph runs on one shard of the sequence per rank:
  ``True`` for the default process group, a ``ProcessGroup``, or one dimension of a
  ``DeviceMesh``; every attention call must then be sharded, or the compile raises
  ``ContextParallelError``;
- ``context_parallel_layout`` (``"contiguous"``): which positions each rank holds,
  ``"contiguous"`` or ``"head-tail"`` (equal causal work on every rank);
- ``measure`` (``None``: ``COMPILE_PASS_MEASURE``, else ``"measure"``): how a kernel is chosen:
  ``"measure"`` times each kernel that computes a call exactly against SDPA on this device where
  nothing measured covers the call (checked against SDPA first, cached); ``"static"`` uses the
  tables this project measured only; ``"remeasure"`` measures again, ignoring the cache.
"""


# Dynamo's setting for tracing an activation-checkpointed forward that writes Python state
# (transformers' Gemma-4 stores each layer type's K/V for later layers since 5.24). It is the
# user's to set: eager's recomputation replays such writes and the compiled backward does not
# (docs/training.md, "Gradient checkpointing").
CHECKPOINT_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"
_checkpoint_breaks_told = False


class ContextParallelError(RuntimeError):
    """A graph compiled with ``context_parallel`` has an attention call the rules cannot shard:
    run as it is, it would attend within each shard only. The message names each call and why."""


def disabled() -> bool:
    """``COMPILE_PASS_DISABLE=1`` turns every rule off."""
    return os.environ.get(DISABLE_VARIABLE, "") == "1"


def _inductor_options() -> set[str]:
    from torch._inductor import config

    return set(config.get_config_copy())


def _unknown_option(key: str, way_in: str, inductor_takes_rest: bool) -> str:
    """The message for a key that is not a rule switch (nor, where allowed, an inductor option)."""
    switches, settings = ", ".join(sorted(RULES)), ", ".join(sorted(SETTINGS))
    inductor = _inductor_options()
    if not inductor_takes_rest and key.replace("-", "_") in inductor:
        return (
            f"{way_in} got {key!r}, an inductor config option, not a compile_pass rule switch; "
            f"rule switches are {switches}; settings are {settings}. Give inductor options to "
            f'torch.compile(model, backend="compile_pass", options={{{key!r}: ...}}) '
            f"or set torch._inductor.config.{key.replace('-', '_')}"
        )
    close = difflib.get_close_matches(key, [*RULES, *SETTINGS, *(inductor if inductor_takes_rest else ())], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    rest = (
        "; every other key must be an inductor config option (torch._inductor.list_options())"
        if inductor_takes_rest
        else ""
    )
    return (
        f"{way_in} got unknown option {key!r}{hint}. Rule switches are {switches} (True or False); "
        f"settings are {settings} (True or False; context_parallel also a ProcessGroup or a DeviceMesh dimension, "
        f"context_parallel_layout {' or '.join(map(repr, LAYOUTS))}, measure {' or '.join(map(repr, measure.MODES))})"
        f"{rest}"
    )


def validate_options(
    options: Mapping[str, Any] | None, way_in: str, *, inductor_takes_rest: bool
) -> tuple[dict[str, Switch], dict[str, Any]]:
    """(rule switches and settings, inductor options) from the keys given to a way in, or one
    ValueError that names the valid keys. Every way in checks its keys here, before anything
    is rewritten or compiled: ``backend(options=...)`` passes the keys that are neither rule
    switches nor settings on to inductor, ``enable()`` and ``rewrite()`` take only those two."""
    switches: dict[str, Switch] = {}
    rest: dict[str, Any] = {}
    for key, value in dict(options or {}).items():
        if key == CONTEXT_PARALLEL:  # a process group is named by its name: graphs and cache keys hold a string
            try:
                switches[key] = group_name(value)
            except ValueError as error:
                raise ValueError(f"{way_in}: {error}") from None
        elif key == CONTEXT_PARALLEL_LAYOUT:
            if value not in LAYOUTS:
                raise ValueError(
                    f"{way_in}: setting {key!r} takes one of {', '.join(map(repr, LAYOUTS))}, got {value!r}"
                )
            switches[key] = value
        elif key == MEASURE:
            if value is not None and value not in measure.MODES:
                raise ValueError(
                    f"{way_in}: setting {key!r} takes one of {', '.join(map(repr, measure.MODES))}, got {value!r}"
                )
            switches[key] = value
        elif key in RULES or key in SETTINGS:
            if not isinstance(value, bool):
                kind = "rule switch" if key in RULES else "setting"
                raise ValueError(f"{way_in}: {kind} {key!r} takes True or False, got {value!r}")
            switches[key] = value
        elif inductor_takes_rest and key.replace("-", "_") in _inductor_options():
            rest[key.replace("-", "_")] = value
        else:
            raise ValueError(_unknown_option(key, way_in, inductor_takes_rest))
    return switches, rest


def _active_rules(switches: Mapping[str, Any], way_in: str) -> list[str]:
    validate_options(switches, way_in, inductor_takes_rest=False)
    sharded = switches.get(CONTEXT_PARALLEL, False) is not False
    if sharded and (disabled() or not switches.get(sharded_attention.NAME, True)):
        why = f"{DISABLE_VARIABLE}=1" if disabled() else f"{sharded_attention.NAME}=False"
        raise ContextParallelError(f"{way_in}: context_parallel needs the {sharded_attention.NAME} rule, off by {why}")
    if disabled():
        return []
    rules = [name for name in RULES if switches.get(name, True)]
    if sharded:  # an attention call is the sharded rule's alone: any other rewrite attends within the shard
        attention = set(sharded_attention.TARGETS)
        rules = [name for name in rules if name == sharded_attention.NAME or not attention & set(RULES[name].TARGETS)]
    return rules


def _settings(switches: Mapping[str, Any]) -> dict[str, Any]:
    settings = {name: switches.get(name, default) for name, default in SETTINGS.items()}
    settings[CONTEXT_PARALLEL] = group_name(settings[CONTEXT_PARALLEL])
    return settings


def rewrite(gm: torch.fx.GraphModule, **switches: Any) -> Report:
    """Apply the rules to a Dynamo GraphModule in place, for a backend of your own.

    Args:
        gm: the torch-level graph Dynamo hands a backend (with its node metadata: the report
            names modules and source lines from it).
        **switches: rule switches by name (``rewrite(gm, sliding_window=False)``, see ``RULES``)
            and settings (``slow_kernels=True``, see ``SETTINGS``); nothing else.

    Returns:
        The report of this one graph: a decision for every attention call and top-k mask, also
            logged at INFO through the ``compile_pass`` logger.

    Raises:
        ValueError: an unknown key, or a value of the wrong kind, before anything is rewritten.
        ContextParallelError: under ``context_parallel``, an attention call the rules cannot shard.
    """
    active = _active_rules(switches, "compile_pass.rewrite()")
    measure.settings_from_environment()  # a COMPILE_PASS_MEASURE* value that cannot be read raises here
    _tell_checkpoint_breaks()
    report = Report(graphs=1, disabled=disabled(), rules=active, one_graph=True)
    if not active:
        report.log()
        return report
    scope_list = list(graphs.scopes(gm))
    # Each graph as it was: restored if the rewritten graphs fail their check, so that a rule's
    # mistake there keeps every call instead of breaking the compile.
    originals = [graphs.Snapshot(scope.module.graph) for scope in scope_list]
    bodies = frozenset(scope.module.graph for scope in scope_list if scope.callers)
    context = Context(
        MaskEvaluator(graphs.placeholder_operands(scope_list).get),
        _settings(switches),
        bodies,
        subclasses.subclass_values(scope_list),
        subclasses.computed_from_subclass(scope_list),
    )
    by_target = _rules_by_target(active)
    maybe_dead: set[torch.fx.Node] = set()
    graph_list = [scope.module.graph for scope in scope_list]
    try:
        with measure.compiling(cast(str | None, context.settings[MEASURE]), graphs.marked_dynamic_symbols(gm)):
            _decide_all(scope_list, by_target, context, graph_list, report, maybe_dead)
        if report.rewritten():
            _clean_and_check(scope_list, maybe_dead | set(context.evaluator.visited()), context)
    except Exception as error:  # noqa: BLE001 - a rewrite must never break the compile
        # The rewritten graphs failed their check, or a failed edit could not be undone in place.
        reason = f"internal error: the rewritten graph failed its check ({type(error).__name__}: {error}); restored"
        logger.warning("compile_pass: %s", reason, exc_info=True)
        for scope, original in zip(scope_list, originals, strict=True):
            scope.module.graph = original.restored()
            scope.module.recompile()
        report = Report(
            [dataclasses.replace(d, rewritten=False, reason=reason) if d.rewritten else d for d in report],
            graphs=1,
            disabled=report.disabled,
            rules=active,
            one_graph=True,
        )
    report.log()
    if context.settings[CONTEXT_PARALLEL] is not False:
        _require_context_parallel(report)
    return report


def _decide_all(
    scope_list: list[graphs.Scope],
    by_target: dict,
    context: Context,
    graph_list: list[torch.fx.Graph],
    report: Report,
    maybe_dead: set[torch.fx.Node],
) -> None:
    """Every node some active rule looks at, offered to its rules: decisions into ``report``,
    nodes the rewrites may have left dead into ``maybe_dead``."""
    for scope in scope_list:
        for node in list(scope.module.graph.nodes):
            rules = (
                by_target.get((node.op, node.target)) if node.op in ("call_function", "call_method", "output") else None
            )
            if rules:
                decision, dead = _decide(node, scope.name, rules, context, graph_list)
                if decision is not None:
                    report.append(decision)
                    maybe_dead |= dead


def _tell_checkpoint_breaks() -> None:
    """Warn, once per process, where Dynamo has broken a graph at an activation-checkpointed
    call because its forward writes Python state: such calls run eagerly, unrewritten."""
    from torch._dynamo.utils import counters

    global _checkpoint_breaks_told
    if _checkpoint_breaks_told or not any(CHECKPOINT_SIDE_EFFECTS in str(reason) for reason in counters["graph_break"]):
        return
    _checkpoint_breaks_told = True
    logger.warning(
        "compile_pass: activation-checkpointed calls left the compiled graph and run eagerly, unrewritten: their "
        "forward writes Python state, which Dynamo does not replay in the recomputation. Set "
        "torch._dynamo.config.%s = True before compiling to compile them (docs/training.md: Gradient checkpointing)",
        CHECKPOINT_SIDE_EFFECTS,
    )


def _clean_and_check(scope_list: list, maybe_dead: set[torch.fx.Node], context: Context) -> None:
    """Erase what the rewrites left unused (bodies first: a body input left unused frees its
    operand in the parent), then lint and recompile every graph."""
    for scope in reversed(scope_list):
        graphs.erase_if_dead(scope.module.graph, maybe_dead, context.calls)
        graphs.drop_unused_placeholders(scope)
    for scope in scope_list:
        graphs.erase_if_dead(scope.module.graph, maybe_dead, context.calls)
        scope.module.graph.lint()
        scope.module.recompile()


def _require_context_parallel(report: Report) -> None:
    local = [d for d in report if d.kind == ATTENTION and not (d.rewritten and d.rule == sharded_attention.NAME)]
    if local:
        lines = "\n".join(f"  {d.name} ({d.source}): {d.full_verdict}" for d in local)
        raise ContextParallelError(
            f"context_parallel: {len(local)} attention call(s) would attend within each shard only:\n{lines}"
        )


def _rules_by_target(active: list[str]) -> dict:
    """(node.op, node.target) -> the active rules that look at it, in rule order."""
    by_target: dict = {}
    for name in active:
        for target in RULES[name].TARGETS:
            by_target.setdefault(target, []).append(RULES[name])
    return by_target


def _decide(
    node: torch.fx.Node, graph: str, rules: list[Rule], context: Context, graph_list: list[torch.fx.Graph]
) -> tuple[Decision | None, set[torch.fx.Node]]:
    """(the decision for one node or None, nodes its rewrite may have left dead). The first
    rule to rewrite the node wins; if none does, every rule's reason is kept. A top-k that
    builds no attention mask (an MoE router's) is no decision: it is logged at DEBUG."""
    kind = rules[0].TARGETS[(node.op, node.target)]
    where = call_site(node)
    site_fields = (where.module, where.layer_type, where.source)
    declared = where.layer_index
    call = context.calls.read(node)
    if call is None:
        reason = f"arguments of {describe(node)} not understood"
        return Decision(
            rules[0].NAME, graph, node.name, False, reason, *site_fields, kind, declared_layer=declared
        ), set()
    site = Site(node, call)
    kept: list[tuple[str, str]] = []
    unreported = False
    for rule in rules:
        outcome = _apply(rule, site, context, graph_list)
        if outcome is None:
            continue
        if isinstance(outcome, Kept):
            if outcome.reported:
                kept.append((rule.NAME, outcome.reason))
            else:
                unreported = True
                logger.debug(
                    "%s: %s (%s) kept, no decision: %s", rule.NAME, where.module or node.name, node.name, outcome.reason
                )
            continue
        reason, dead, kernel = outcome
        decision = Decision(
            rule.NAME, graph, node.name, True, reason, *site_fields, kind, kernel=kernel, declared_layer=declared
        )
        return decision, dead
    if not kept:
        if kind == TOPK and not unreported:  # an MoE router's top-k, say: its indices reach no scatter
            logger.debug("topk %s (%s) builds no mask", where.module or node.name, node.name)
        return None, set()
    (first_rule, reason), others = kept[0], tuple(kept[1:])
    return Decision(
        first_rule, graph, node.name, False, reason, *site_fields, kind, others, declared_layer=declared
    ), set()


def _apply(
    rule: Rule, site: Site, context: Context, graph_list: list[torch.fx.Graph]
) -> Kept | tuple[str, set[torch.fx.Node], str] | None:
    """One rule on one node: None when it is not the rule's pattern, Kept, or (reason,
    maybe-dead nodes, the kernel the new op runs or "") once rewritten. A rule never breaks the
    user's compile: an unexpected exception becomes a kept decision and a warning, with every
    graph exactly as before the rule's ``replace`` (its edits undone in place: later rules see
    the same nodes)."""
    edits = None
    try:
        if not rule.matches(site, context):
            return None
        plan = rule.check(site, context)
        if isinstance(plan, Kept):
            return plan
        edits = graphs.EditLog(graph_list)
        return plan.reason, rule.replace(plan, context) | {site.node}, getattr(plan, "kernel", "")
    except Exception as error:  # noqa: BLE001 - any failure inside a rule must keep the graph
        if edits is not None:
            edits.undo()  # raises only where a rule broke the contract: the driver restores all
        reason = f"internal error: {type(error).__name__}: {error}"
        logger.warning("compile_pass rule %s on %s: %s", rule.NAME, site.node.name, reason, exc_info=True)
        return Kept(reason)


def backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """The backend: ``torch.compile(model, backend=compile_pass.backend)``, or by its name,
    ``backend="compile_pass"`` (an entry point of the package). It rewrites each graph Dynamo
    hands it, then compiles it with inductor.

    Args:
        gm: the graph Dynamo traced.
        example_inputs: its example inputs, passed on to inductor.
        mode: inductor's mode (``"max-autotune"``, ...), as ``torch.compile(mode=...)`` gives it.
        options: rule switches (``{"sliding_window": False}``, see ``RULES``) and settings
            (``{"slow_kernels": True}``, see ``SETTINGS``); every other key must be an inductor
            config option, as with the default backend.

    Returns:
        The compiled callable inductor returns.

    Raises:
        ValueError: an unknown option, checked before anything is rewritten or compiled (Dynamo
            reports it as ``BackendCompilerFailed``, whose ``inner_exception`` it is).
        RuntimeError: inductor found no C++ compiler; the message says what to install.
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    way_in = 'torch.compile(backend="compile_pass", options=...)'
    switches, inductor_options = validate_options(options, way_in, inductor_takes_rest=True)
    rewrite(gm, **switches)
    config_patches = {**(list_mode_options(mode) if mode else {}), **inductor_options}
    # The caches key on the rewritten graph, which names the ops but not what they do: the
    # package's source joins the key through a pass that only carries it (a user's own
    # post-grad passes run first, as before).
    from torch._inductor import config

    user_passes = config_patches.get("post_grad_custom_pre_pass", config.post_grad_custom_pre_pass)
    config_patches["post_grad_custom_pre_pass"] = (*get_custom_graph_passes(user_passes), SourceKey(switches))
    try:
        # compile_fx returns a path or weights only when asked for ahead-of-time code; never here.
        return cast(Callable[..., Any], compile_fx(gm, example_inputs, config_patches=config_patches))
    except Exception as error:
        if _no_compiler(error):
            raise RuntimeError(f"{NO_COMPILER_ADVICE} ({_no_compiler(error)})") from error
        raise


NO_COMPILER_ADVICE = (
    "inductor found no working C++ compiler, which it needs to compile kernels for the CPU: install one "
    "(Debian/Ubuntu: apt-get install g++; conda: conda install -c conda-forge gxx) or point the CXX variable "
    "at one. compile_pass.rewrite(gm) also works from a backend of your own without inductor"
)


def _no_compiler(error: BaseException) -> BaseException | None:
    """inductor's missing-compiler error, where ``error`` is it or wraps it (InductorError)."""
    from torch._inductor.exc import InvalidCxxCompiler

    for cause in (error, getattr(error, "inner_exception", None), error.__cause__):
        if isinstance(cause, InvalidCxxCompiler):
            return cause
    return None


def _source_key(rules: Iterable[str], settings: dict[str, Any]) -> str:
    """A digest of the active rule set, the settings and every source file of this package."""
    digest = hashlib.sha256(repr((tuple(rules), sorted(settings.items()))).encode())
    for path in sorted(_package_sources()):
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()


class SourceKey(CustomGraphPass):
    """Changes nothing; its uuid brings the package into inductor's cache key where the
    backend way in has already rewritten the graph."""

    def __init__(self, switches: Mapping[str, Any]):
        self.key = _source_key(_active_rules(switches, "compile_pass.backend"), _settings(switches))

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


class RewritePass(CustomGraphPass):
    """The rules as inductor's pre-grad custom pass. Its uuid names the active rule set
    and this package's source, so toggling a rule never reuses a stale compiled graph."""

    def __init__(self, **switches: Any):
        self.rules = tuple(_active_rules(switches, "compile_pass.enable()"))
        self.settings = _settings(switches)

    def __call__(self, graph: torch.fx.Graph) -> None:
        # Inductor runs pre-grad passes on subgraphs before their parent. A checkpoint
        # body alone cannot see where its mask comes from; the parent's run rewrites it.
        # Dynamo marks the placeholders of the graphs it outputs (not of bodies) with a grapharg.
        is_dynamo_output = all("grapharg" in node.meta for node in graph.find_nodes(op="placeholder"))
        module = graph.owning_module  # inductor passes a GraphModule's own graph
        if is_dynamo_output and module is not None:  # with no rule active too: the report counts the graph
            rewrite(module, **{name: name in self.rules for name in RULES}, **self.settings)

    def uuid(self) -> str:
        # Inductor looks its caches up before this pass runs, by this key: it must hold all that
        # changes a decision (every COMPILE_PASS_* setting, the measured verdicts the pass would
        # read), so that a changed setting or a new measurement compiles afresh.
        settings = sorted((name, value) for name, value in os.environ.items() if name.startswith("COMPILE_PASS_"))
        decisions = {**self.settings, "environment": settings, "verdicts": measure.verdicts_digest()}
        return _source_key(self.rules, decisions)


def _package_sources() -> list[str]:
    root = os.path.dirname(os.path.abspath(__file__))
    return [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names if name.endswith(".py")]


@contextlib.contextmanager
def enable(**switches: Any) -> Iterator[None]:
    """Run the rules inside the default inductor backend, for compilations in this block.

    ``with compile_pass.enable(): torch.compile(model)(inputs)``. The rules run as inductor's
    ``pre_grad_custom_pass``, beside any pass set there before, which is restored on exit. The
    pass's cache key names the rule set and the package's source, so toggling a rule never
    reuses a stale compiled graph; a graph inductor takes from its caches is not rewritten again
    (and adds nothing to ``decisions()``).

    Args:
        **switches: rule switches by name (``enable(topk_mask=False)``, see ``RULES``) and
            settings (see ``SETTINGS``); inductor options belong to ``torch.compile`` here.

    Raises:
        ValueError: an unknown key, at once.
    """
    from torch._inductor import config

    previous = config.pre_grad_custom_pass
    passes: tuple[CustomGraphPassCallable, ...] = (*get_custom_graph_passes(previous), RewritePass(**switches))
    config.pre_grad_custom_pass = passes if len(passes) > 1 else passes[0]
    try:
        yield
    finally:
        config.pre_grad_custom_pass = previous
