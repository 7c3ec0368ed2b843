"""``stalwart checkpoints <dir>`` (inspect, verify) and ``stalwart export`` (one weights file).

``stalwart checkpoints DIR [--verify]`` lists every checkpoint under a ``--save`` directory (and its
``non_persistent/`` tier): iteration, complete or not, saved world size, size on disk, which one
the tracker names, and leftover ``*.tmp-*`` directories of crashed saves; the exit code is 1
when the tracker is broken or names a checkpoint that is missing or incomplete. ``--verify``
also runs every check a resume runs (`stalwart.checkpoint.integrity.check_checkpoint`: marker,
DCP metadata and shard sizes, metadata/common/rank state files) and checks every file against
the checkpoint's checksum manifest; the exit code is 1 when a resume would refuse the tracked
checkpoint, so an operator or a pre-launch hook can test a directory before spending a job on
it. A checkpoint without a manifest (an older stalwart) is verified without checksums, with a
warning.

``stalwart checkpoints convert --trust-pickle PATH`` rewrites checkpoints of an older stalwart
(``common.pt``/``rank_*.pt`` pickles, refused by a resume because reading a pickle can run code)
into the JSON state files, for checkpoints whose writer you trust.

Nothing here runs code from the directory it reads: state files are JSON and DCP metadata goes
through the restricted unpickler; unreadable side files (``metadata.json``,
``exit_reason.json``) are reported as such, never a traceback.

``stalwart export --load DIR [--iteration N] --out FILE [--dtype bf16]`` writes the model weights
of one checkpoint as a single ``torch.save`` file, ``{"model": state_dict, "model_config": {...},
"iteration": N, "source": path}``: whatever the number of ranks that saved it (DCP reshards),
no optimizer state, loadable with ``torch.load(FILE, weights_only=True)`` into
``stalwart.models.GPT(GPTConfig(**model_config))``. ``--out FILE.safetensors`` (or ``--format
safetensors``) writes the same state dict as safetensors, its metadata holding ``model_config``
(JSON), ``iteration`` and ``source``. ``--format hf --out DIR`` writes a Hugging Face layout of
a GPT-2- or Llama-architecture checkpoint: ``config.json`` and ``model.safetensors`` under
``GPT2LMHeadModel`` or ``LlamaForCausalLM`` names (`stalwart.models.hf_export`), for
``from_pretrained(DIR)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from stalwart.atomic_file import Sync, write_atomic
from stalwart.cli.arg_types import OneOf, switch, values
from stalwart.cli.args import OneLineErrorParser
from stalwart.regular_file import open_regular

EXIT_OK = 0
EXIT_NOT_LOADABLE = 1
EXIT_USAGE = 2
_DTYPES = ("fp32", "bf16", "fp16")
EXPORT_FORMATS = ("auto", "torch", "safetensors", "hf")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # a file removed meanwhile, a dangling link
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _describe_tier(root: str, verify: bool) -> tuple[list[str], str | None]:
    """Lines describing one checkpoint root, and why a resume would refuse its tracked
    checkpoint (None: loadable, or nothing to load). Without ``verify``: a broken tracker, or
    a tracked checkpoint that is missing or incomplete; with it, also every check a resume
    applies (`stalwart.checkpoint.integrity.check_checkpoint`) and the checksums."""
    from stalwart.checkpoint import CheckpointError, layout

    try:
        tracker = layout.read_tracker(root)
        lines = [f"{root}: tracker names {tracker if tracker is not None else 'nothing'}"]
        newest_problem = None
    except CheckpointError as exc:
        tracker, lines = None, [f"{root}: BROKEN tracker: {exc}"]
        newest_problem = str(exc)  # a resume refuses it
    try:
        entries = os.listdir(root)
    except OSError as exc:
        return [f"{root}: unreadable directory: {exc.strerror or exc}"], None
    names = sorted(n for n in entries if layout.parse_iteration_dir_name(n) is not None)
    if tracker is not None and layout.iteration_dir_name(tracker) not in names:
        newest_problem = f"the tracked checkpoint {layout.iteration_dir_name(tracker)} is missing"
        lines.append(f"  BROKEN: {newest_problem}")
    for name in names:
        line, problem = _describe_checkpoint(os.path.join(root, name), verify)
        iteration = layout.parse_iteration_dir_name(name)
        lines.append(line + (" <- tracker" if iteration == tracker else ""))
        if iteration == tracker:
            newest_problem = problem
    lines += [f"  leftover partial save: {p}" for p in sorted(layout.list_tmp_dirs(root))]
    return lines, newest_problem


def _describe_checkpoint(path: str, verify: bool) -> tuple[str, str | None]:
    """One checkpoint's line and why a resume would refuse it (without ``verify``: only a
    missing marker, the listing reads no shard)."""
    from stalwart.checkpoint import layout
    from stalwart.checkpoint.integrity import check_checkpoint

    complete = layout.is_complete(path)
    state = "complete" if complete else "INCOMPLETE"
    problem = None if complete else "its completeness marker is missing (the save did not finish)"
    if verify:
        result = check_checkpoint(path, checksums=True)
        problem = result.problem
        state += ", verified" if problem is None else f", BROKEN: {problem}"
        if result.note is not None and problem is None:
            state += " (no checksums)"
            print(f"stalwart checkpoints: warning: {path}: {result.note}", file=sys.stderr)
    facts = _metadata(path)
    world = facts.get("world_size")
    world = world if isinstance(world, int) and not isinstance(world, bool) else "?"
    mib = _dir_bytes(path) / 2**20
    name = os.path.basename(path)
    return f"  {name}  {state}  saved by {world} rank(s)  {mib:.1f} MiB", problem


def _metadata(path: str) -> dict[str, Any]:
    from stalwart.checkpoint import layout

    try:
        with open_regular(os.path.join(path, layout.METADATA_FILENAME)) as f:
            data = json.loads(f.read(1 << 20))
            return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def build_checkpoints_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart checkpoints",
        description="List the checkpoints of a --save directory (and of its non-persistent "
        "tier) with their state, size and the last exit reason. Exit code 1 when the "
        "checkpoint the tracker names is missing or incomplete (with --verify: when a resume "
        "would refuse it). 'stalwart checkpoints convert' "
        "rewrites pickle checkpoints of an older stalwart.",
    )
    p.add_argument("save_dir", help="a --save directory")
    switch(p, "--verify", "apply every check a resume applies, and every file's checksum")
    return p


def build_convert_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart checkpoints convert",
        description="Rewrite pickle checkpoints of an older stalwart as JSON state.",
    )
    p.add_argument("path", help="a --save directory or one iter_* checkpoint")
    switch(p, "--trust-pickle", "required: the pickles are read unrestricted (they can run code)")
    return p


def build_export_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="stalwart export",
        description="Write one checkpoint's model weights: a torch.save file, a safetensors "
        "file (--out *.safetensors), or a Hugging Face GPT2LMHeadModel / LlamaForCausalLM "
        "directory (--format hf).",
    )
    p.add_argument("--load", required=True, metavar="DIR", help="a --save directory (required)")
    p.add_argument(
        "--iteration",
        type=int,
        help="the checkpoint to export (default: the one the tracker names)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="output file, written atomically; with --format hf a directory (required)",
    )
    values(
        p,
        (
            "--format",
            OneOf(EXPORT_FORMATS, "FORMAT"),
            "auto",
            "auto: safetensors for --out *.safetensors, else torch; hf: config.json + "
            "model.safetensors that transformers' LlamaForCausalLM loads (Llama presets)",
        ),
        ("--dtype", OneOf(_DTYPES, "DTYPE"), "fp32", "dtype of the weights"),
    )
    return p


def main_checkpoints(argv: list[str] | None = None) -> int:
    """``stalwart checkpoints``: 0 listed (and the tracked checkpoint verified), 1 the tracked
    checkpoint is broken, 2 no such directory or bad usage."""
    if argv and argv[0] == "convert":
        return _main_convert(argv[1:])
    try:
        args = build_checkpoints_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    problem = _not_a_directory("SAVE_DIR", args.save_dir)
    if problem is not None:
        print(f"stalwart checkpoints: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from stalwart.checkpoint import layout

    roots = [args.save_dir]
    tier = os.path.join(args.save_dir, layout.NON_PERSISTENT_SUBDIR)
    if os.path.isdir(tier):
        roots.append(tier)
    broken = False
    for root in roots:
        lines, problem = _describe_tier(root, args.verify)
        print("\n".join(lines))
        broken = broken or problem is not None
    print(_last_exit(args.save_dir))
    return EXIT_NOT_LOADABLE if broken else EXIT_OK


def _not_a_directory(name: str, value: str) -> str | None:
    """Why ``value`` (the argument ``name``) is not an existing directory; None when it is."""
    if not value.strip():
        return f"{name} is empty (it takes a --save directory)"
    if os.path.isdir(value):
        return None
    what = "is not a directory" if os.path.exists(value) else "does not exist"
    return f"{name} {value!r} {what} (it takes a --save directory)"


def _main_convert(argv: list[str]) -> int:
    """``stalwart checkpoints convert --trust-pickle PATH``: 0 converted (or nothing to do)."""
    try:
        args = build_convert_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    from stalwart.checkpoint import CheckpointError
    from stalwart.checkpoint.convert import convert_path

    if not args.path.strip():
        print("stalwart checkpoints convert: error: PATH is empty", file=sys.stderr)
        return EXIT_USAGE
    try:
        done = convert_path(args.path, trust_pickle=args.trust_pickle)
    except (ValueError, OSError, CheckpointError) as exc:
        print(f"stalwart checkpoints convert: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(f"converted {d}" for d in done) or f"nothing to convert in {args.path}")
    return EXIT_OK


def _last_exit(save_dir: str) -> str:
    """Why the last run stopped, from ``exit_reason.json`` (written by rank 0 at every exit)."""
    from stalwart.reliability.exit import read_exit_reason

    record, problem = read_exit_reason(save_dir)
    if record is None:
        return f"last exit: unknown ({problem})"
    return (
        f"last exit: {record.get('reason')} at iteration {record.get('iteration')} "
        f"(exit code {record.get('exit_code')}): {record.get('detail')}"
    )


def _load_model(load: str, iteration: int | None) -> tuple[Any, dict, int, str]:
    """The model of checkpoint ``iteration`` (default: the tracked one) of ``load``: (model, its
    config as saved, iteration, checkpoint path). ``ValueError`` naming ``--load`` otherwise."""
    from stalwart.checkpoint import CheckpointManager, layout
    from stalwart.checkpoint.safe_state import read_state_file
    from stalwart.models import GPT, GPTConfig

    if iteration is None:
        iteration = layout.read_tracker(load)
        if iteration is None:
            raise ValueError(f"--load {load}: no {layout.TRACKER_FILENAME}; pass --iteration")
    path = os.path.join(load, layout.iteration_dir_name(iteration))
    from stalwart.checkpoint.integrity import check_checkpoint

    problem = check_checkpoint(path, checksums=False).problem  # what the load below checks
    if problem is not None:
        raise ValueError(f"--load {load}: checkpoint {path} is not loadable: {problem}")
    common = read_state_file(os.path.join(path, layout.COMMON_FILENAME))
    config = common.get("config") if isinstance(common, dict) else None
    model_config = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model_config, dict):
        raise ValueError(f"--load {load}: {path}/{layout.COMMON_FILENAME} has no model config")
    try:
        model = GPT(GPTConfig(**model_config))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--load {load}: the model config of {path} is unusable: {exc}") from None
    CheckpointManager(None, load).load(model, None, load_optim=False, iteration=iteration)
    return model, model_config, iteration, path


def _atomic(out: str, write: Any) -> None:
    """``write(tmp)`` then rename onto ``out``: never a half-written file under the final name."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_atomic(out, write, sync=Sync.NONE)


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError:  # optional dependency
        raise ValueError(
            "--out *.safetensors and --format hf need the 'safetensors' package: "
            "pip install 'stalwart[safetensors]'"
        ) from None
    return save_file


def _write_hf(out: str, config: Any, state: dict, dtype: str, path: str, save: Any) -> None:
    """``--format hf``: ``config.json`` + ``model.safetensors`` of ``GPT2LMHeadModel`` or
    ``LlamaForCausalLM`` (`stalwart.models.hf_export.hf_config_and_state`)."""
    from stalwart.models.hf_export import hf_config_and_state

    try:
        hf_config, hf_state = hf_config_and_state(config, state)
    except ValueError as exc:
        raise ValueError(f"--format hf: checkpoint {path}: {exc}") from None
    hf_config["torch_dtype"] = dtype
    os.makedirs(out, exist_ok=True)
    weights = os.path.join(out, "model.safetensors")
    _atomic(weights, lambda tmp: save(hf_state, tmp, metadata={"format": "pt"}))
    text = json.dumps(hf_config, indent=2) + "\n"
    _atomic(os.path.join(out, "config.json"), lambda tmp: Path(tmp).write_text(text))


def _export(load: str, iteration: int | None, out: str, dtype: str, fmt: str) -> str:
    import torch

    fmt = ("safetensors" if out.endswith(".safetensors") else "torch") if fmt == "auto" else fmt
    save: Any = _safetensors_save() if fmt in ("safetensors", "hf") else None
    model, model_config, iteration, path = _load_model(load, iteration)
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    state = {k: v.detach().to(cast).contiguous() for k, v in model.state_dict().items()}
    meta = {"model_config": model_config, "iteration": iteration, "source": os.path.abspath(path)}
    if fmt == "torch":
        _atomic(out, lambda tmp: torch.save({"model": state, **meta}, tmp))
    elif fmt == "safetensors":
        text = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in meta.items()}
        _atomic(out, lambda tmp: save(state, tmp, metadata={"format": "pt", **text}))
    else:
        _write_hf(out, model.config, state, str(cast).split(".")[1], path, save)
    num = sum(v.numel() for v in state.values())
    return f"exported iteration {iteration} ({num:,} values, {dtype}, {fmt}) from {path} to {out}"


def main_export(argv: list[str] | None = None) -> int:
    """``stalwart export``: 0 written; 2 bad usage or a checkpoint that cannot be loaded."""
    try:
        args = build_export_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    from stalwart.checkpoint import CheckpointError

    if args.iteration is not None and args.iteration < 0:
        print(
            f"stalwart export: error: --iteration must be >= 0, got {args.iteration}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from stalwart.config.paths import check_output_dir, check_output_file

    problem = _not_a_directory("--load", args.load)
    try:
        if problem is not None:
            raise ValueError(problem)
        if args.format == "hf":
            check_output_dir("--out", args.out)  # a directory: config.json + model.safetensors
        else:
            check_output_file("--out", args.out)  # before the model is built and loaded
        print(_export(args.load, args.iteration, args.out, args.dtype, args.format))
    except (ValueError, OSError, CheckpointError) as exc:
        print(f"stalwart export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
