"""The ``stalwart train`` parser: flags in Megatron spelling, grouped by the component that owns
them.

The flags themselves are declared in ``train_flags`` (model, data, training, optimizer,
checkpoints) and ``train_flags_ops`` (reliability, observability, CUDA graphs); Megatron flags
that stalwart does not implement are refused by ``megatron_flags``. The parser only parses;
turning the namespace into typed configs (and validating combinations) is
``stalwart.config.run.build_run_config``. Parse errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from stalwart.cli import train_flags as run
from stalwart.cli import train_flags_ops as ops
from stalwart.cli.arg_types import register_checked_types, switch
from stalwart.cli.config_file import CONFIG_HELP, toml_defaults
from stalwart.cli.help_format import FlagHelpFormatter
from stalwart.cli.megatron_flags import add_megatron_refusals, unknown_flag_message
from stalwart.cli.train_flags import PRESET_NAMES
from stalwart.config import megatron_defaults

__all__ = ["PRESET_NAMES", "OneLineErrorParser", "build_train_parser", "parse_train_args"]

TRAIN_DESCRIPTION = """\
Train the reference GPT inside stalwart's reliability shell. Examples:

  stalwart train --demo --save runs/demo     # 100 CPU iterations; then: stalwart report runs/demo
  stalwart train --preset llama-150m --bf16 --save runs/l --save-interval 500 --log-throughput
  torchrun --nproc-per-node 8 -m stalwart train --preset gpt2-124m --bf16 --save /ckpt/run \\
      --global-batch-size 256 --save-interval 500 --async-save --exit-signal-handler --enable-ft

Flags keep Megatron-LM's names; Megatron flags that stalwart does not implement are refused in
one line (exit code 2). Switches are off unless given; other flags show their default."""

_GROUPS = (
    run.model_flags,
    run.architecture_flags,
    run.recompute_flags,
    run.data_flags,
    run.training_flags,
    run.optimizer_flags,
    run.checkpoint_flags,
    ops.rerun_flags,
    ops.hang_flags,
    ops.exit_flags,
    ops.inprocess_flags,
    ops.fault_injection_flags,
    ops.logging_flags,
    ops.timer_flags,
    ops.straggler_flags,
    ops.memory_energy_flags,
    ops.dump_flags,
    ops.profiler_flags,
    ops.graph_flags,
)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (``stalwart train: error: ...``), exit 2.

    Flags must be spelled out (``allow_abbrev=False``, as in Megatron: ``--train-iter`` is not
    ``--train-iters``), and ``type=int`` / ``type=float`` are the checked types of
    ``stalwart.cli.arg_types``. ``raise_errors=True`` raises ``ValueError(message)`` instead of
    exiting (used to parse ``--config`` values key by key).
    """

    def __init__(self, *args: Any, raise_errors: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", FlagHelpFormatter)
        super().__init__(*args, **kwargs)
        self.raise_errors = raise_errors
        register_checked_types(self)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, with unknown flags named one by one ("did you mean" for a typo)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            self.error(unknown_flag_message(extras, known))
        return ns

    def error(self, message: str) -> NoReturn:
        if self.raise_errors:
            raise ValueError(message)
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def build_train_parser(*, raise_errors: bool = False) -> argparse.ArgumentParser:
    """The ``stalwart train`` parser (flags only; defaults that depend on the preset are None)."""
    p = OneLineErrorParser(
        prog="stalwart train",
        usage="stalwart train [flags]   (--config run.toml for a file of them)",
        description=TRAIN_DESCRIPTION,
        raise_errors=raise_errors,
    )
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    switch(p, "--print-config", "print the flags as the TOML that --config reads, and exit")
    switch(p, "--demo", "the interactive CPU demo's defaults (make demo)")
    for add in _GROUPS:
        add(p)
    add_megatron_refusals(p)
    p.add_argument_group(*megatron_defaults.help_section())  # a paragraph of --help, no flags
    return p


def parse_train_args(argv: list[str], *, raise_errors: bool = False) -> argparse.Namespace:
    """Parse ``stalwart train`` flags, applying ``--config run.toml`` values as defaults.

    The namespace's ``config_file_keys`` holds the destinations the file set (they count as
    given explicitly, e.g. ``--demo`` does not override them). ``raise_errors``: a bad flag or
    file is a ``ValueError`` (one line) instead of the parser's exit (``stalwart launch`` reads
    the train args it hands on).
    """
    parser = build_train_parser(raise_errors=raise_errors)
    pre, _ = parser.parse_known_args(argv)
    defaults: dict[str, Any] = {}
    given = [a for a in argv if a == "--config" or a.startswith("--config=")]
    if len(given) > 1:  # argparse keeps the last: the other file would be ignored without a word
        parser.error("--config given twice (one file; flags on the command line win)")
    if pre.config is not None:
        try:
            defaults = toml_defaults(pre.config, lambda: build_train_parser(raise_errors=True))
        except ValueError as exc:
            parser.error(str(exc))
        parser.set_defaults(**defaults)
    ns = parser.parse_args(argv)
    ns.config_file_keys = frozenset(defaults)
    return ns
