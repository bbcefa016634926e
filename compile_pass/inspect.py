"""``python -m compile_pass inspect CONFIG_OR_MODEL_DIR --seq N``: which attention calls the
rules would rewrite, and why, for a model built from its config, offline.
``python -m compile_pass tune CONFIG_OR_MODEL_DIR --seq N``: the same trace, with each call's
kernels measured against SDPA on this machine's GPU (or CPU) and cached for the runs to come.

The model is built on the meta device: shapes only, no weights allocated, so a checkpoint's
config can be inspected on any machine. It is traced with torch.compile(fullgraph=True) and
a backend that only rewrites and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import torch

from . import measure
from .backend import rewrite
from .measure import table as measured
from .report import Report


class ConfigError(ValueError):
    """A path that holds no config this command can read; the message says which and why."""


def load_config(path: str):
    """A config from a model directory (config.json inside) or a config.json file; no downloads."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not os.path.exists(path):
        raise ConfigError(f"no such file or directory: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path} is a directory without a config.json")
        try:
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as error:  # noqa: BLE001 - transformers and its validators raise many kinds
            raise ConfigError(f"{path}: transformers cannot read its config: {_one_line(error)}") from None
    try:
        with open(path) as config_file:
            settings = json.load(config_file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not a readable JSON config: {error}") from None
    if not isinstance(settings, dict) or "model_type" not in settings:
        raise ConfigError(f'{path} has no "model_type": not a transformers config')
    model_type = settings.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{path}: model_type {model_type!r} is unknown to transformers {transformers.__version__}")
    try:
        return transformers.AutoConfig.for_model(model_type, **settings)
    except Exception as error:  # noqa: BLE001 - transformers and its validators raise many kinds
        raise ConfigError(f"{path}: transformers cannot build this config: {_one_line(error)}") from None


def _one_line(error: Exception, limit: int = 300) -> str:
    """An exception's type and message on one line (validators spread theirs over several;
    Dynamo's run to pages), cut at ``limit`` characters."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message if len(message) <= limit else message[:limit] + ' ...'}"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TUNE_SECONDS = 20.0


class _Traced(Exception):
    """Raised by the traced graph instead of running it: one fullgraph trace is the whole job."""


def inspect_config(
    config, seq: int, batch: int = 1, padded: bool = False, packed: int = 1, dtype: torch.dtype = torch.float32
) -> Report:
    """What the rules would do to a causal LM built from ``config``, traced on the meta device
    (no weights allocated, nothing run); ``python -m compile_pass inspect`` prints its table.

    Args:
        config: a transformers config (``compile_pass.inspect.load_config(path)`` reads one
            from a model directory or a config.json, offline).
        seq: the sequence length traced.
        batch: the batch size.
        padded: pass an attention mask (all ones), as a padded batch does.
        packed: above 1, cut each row into that many documents of equal length, passed as a
            padding-free batch passes them (``position_ids`` restarting at each, no mask).
        dtype: the weights' dtype.

    Returns:
        The decisions of every graph traced, merged. Offline the device the model trains on
            is not known: the kernel column says the kernel is chosen there.
    """
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config).to(dtype)
    except ValueError as error:  # no SDPA path (GPT-OSS's sinks): attention spelled out in ops
        if "scaled_dot_product_attention" not in str(error):
            raise
        config._attn_implementation = "eager"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config).to(dtype)
    reports = []

    def report_only(gm, example_inputs):
        reports.append(rewrite(gm))

        def traced(*args):  # the report is all there is to get: nothing runs on the meta device
            raise _Traced

        return traced

    inputs = {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta"), "use_cache": False}
    if padded:
        inputs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long, device="meta")
    if packed > 1:
        inputs["position_ids"] = torch.arange(seq // packed, device="meta").repeat(batch, packed)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=report_only, fullgraph=True)(**inputs)
    except _Traced:
        pass
    finally:
        torch._dynamo.reset()
    merged = Report()
    for report in reports:
        merged.add(report)
    return merged


def _trace_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("path", help="a model directory or a config.json")
    command.add_argument("--seq", type=int, default=4096, help="sequence length to trace (default 4096)")
    command.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    command.add_argument("--padded", action="store_true", help="also pass a (batch, seq) attention_mask")
    command.add_argument(
        "--packed",
        type=int,
        default=1,
        metavar="DOCS",
        help="pack DOCS documents of equal length into each row, padding-free (position_ids, no mask)",
    )
    command.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="the weights' dtype; autocast to a dtype gets that dtype's decisions (the rules cast as autocast "
        "does), but cannot be traced on the meta device itself",
    )


def _tune_device(name: str | None) -> torch.device:
    """The device ``tune`` measures on: a CUDA GPU this machine has, or the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device torch knows (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: measures on a CUDA GPU or the CPU only")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ConfigError(f"--device {device}: this machine has no such CUDA GPU")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compile_pass", description="compile_pass tools")
    commands = parser.add_subparsers(dest="command", required=True)
    _trace_arguments(commands.add_parser("inspect", help=__doc__.splitlines()[0]))
    tune = commands.add_parser(
        "tune",
        help="measure each attention call's kernels against SDPA on this machine's device ahead of a run, "
        "cache the measurements, and print them with the decisions they give",
    )
    _trace_arguments(tune)
    tune.add_argument(
        "--device", default=None, help="the device to measure on (default: cuda where available, else cpu)"
    )
    tune.add_argument("--again", action="store_true", help="measure again, ignoring the cache")
    tune.add_argument(
        "--seconds",
        type=float,
        default=TUNE_SECONDS,
        help=f"seconds each call may spend measuring (default {TUNE_SECONDS:g}: ahead of a run, more rounds than a "
        "compile's budget allows)",
    )
    args = parser.parse_args(argv)
    try:
        for name in ("seq", "batch", "packed"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name} must be a positive integer, got {getattr(args, name)}")
        if args.packed > 1 and (args.padded or args.seq % args.packed):
            raise ConfigError(
                f"--packed {args.packed} needs a --seq it divides, and no --padded (a packed batch has no mask)"
            )
        device = _tune_device(args.device) if args.command == "tune" else None
        if args.command == "tune" and not (math.isfinite(args.seconds) and args.seconds > 0):
            raise ConfigError(f"--seconds must be a positive number of seconds, got {args.seconds:g}")
        config = load_config(args.path)
        try:
            measuring: contextlib.AbstractContextManager = contextlib.nullcontext()
            if device is not None:
                mode = measure.REMEASURE if args.again else measure.MEASURE
                measuring = measure.measuring_on(device, mode, args.seconds)
            asked_before = set(measured.TABLE.asked)
            with measuring:
                report = inspect_config(config, args.seq, args.batch, args.padded, args.packed, DTYPES[args.dtype])
            asked = measured.TABLE.asked - asked_before if device is not None else set()
        except Exception as error:  # noqa: BLE001 - a config transformers accepts but cannot build or run
            raise ConfigError(
                f"{args.path}: a {type(config).__name__} model cannot be built and traced from this config: "
                f"{_one_line(error)}"
            ) from None
    except ConfigError as error:
        print(f"python -m compile_pass {args.command}: {error}", file=sys.stderr)
        return 2
    setup = [f"seq {args.seq}", f"batch {args.batch}"] + ([args.dtype] if args.dtype != "fp32" else [])
    setup += ["padded"] if args.padded else []
    setup += [f"{args.packed} packed documents a row"] if args.packed > 1 else []
    print(f"{type(config).__name__}, {', '.join(setup)}")
    if device is not None:
        from .measure.store import device_name

        entries = measured.TABLE.entries(asked)
        print(f"\nmeasured on {device_name(device)} (forward and backward, median):")
        print(measured.table_text(entries) if entries else "nothing to measure: no call reached a kernel's question")
        print()
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
