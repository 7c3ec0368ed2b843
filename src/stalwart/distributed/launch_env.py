"""Environment variables stalwart reads, checked: a bad value is one ``ValueError`` naming it.

Launchers (torchrun, SLURM) set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` ...; a user may set them
by hand, and a typo (``LOCAL_RANK=-1``, ``nan``, a 30-digit number, bytes pasted from a binary)
must not end in a traceback from deep inside ``int()`` or ``torch.distributed``. Every read site
uses `env_int` / `env_token`, and the CLI calls `check_launch_env` before it touches anything, so
the message comes first and names the variable::

    rank = env_int("RANK", 0)                 # 0 when unset
    check_launch_env()                        # all of them, and RANK < WORLD_SIZE etc.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

# Values that land in file names, log prefixes and tracker lines: printable, no whitespace.
_TOKEN = re.compile(r"[\x21-\x7e]{1,256}")
_MAX_RANKS = 1 << 24  # far beyond any job, small enough that a typo is caught
_PORT_VARS = ("MASTER_PORT", "STALWART_INPROCESS_PORT")
_TOKEN_VARS = (
    "MASTER_ADDR",
    "STALWART_DEVICE_ID",
    "STALWART_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURMD_NODENAME",
)


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def env_int(
    name: str,
    default: int,
    *,
    minimum: int = 0,
    maximum: int = _MAX_RANKS,
    environ: Mapping[str, str] | None = None,
) -> int:
    """``int($name)`` in ``[minimum, maximum]``; ``default`` when unset or empty."""
    raw = _environ(environ).get(name)
    if raw is None or raw == "":
        return default
    text = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,19}", text, flags=re.ASCII):
        value = None
    else:
        value = int(text)
    if value is None or not minimum <= value <= maximum:
        raise ValueError(
            f"environment variable {name}={raw[:40]!r}: must be an integer in "
            f"[{minimum}, {maximum}] (set by the launcher, e.g. torchrun)"
        )
    return value


def env_token(name: str, default: str, *, environ: Mapping[str, str] | None = None) -> str:
    """``$name`` as printable ASCII without spaces (<= 256 characters); ``default`` when unset."""
    raw = _environ(environ).get(name)
    if raw is None or raw == "":
        return default
    if not _TOKEN.fullmatch(raw):
        raise ValueError(
            f"environment variable {name}={raw[:40]!r}: must be 1-256 printable ASCII characters "
            "without spaces"
        )
    return raw


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name as the scheduler knows it: ``$SLURMD_NODENAME`` (checked as
    `env_token`) when set, else the hostname (outside SLURM, where no other name exists).

    SLURM's node name may differ from the hostname (``NodeName`` vs ``NodeHostname`` in
    slurm.conf), and only the former is what ``scontrol update ExcNodeList=`` takes: the verdict
    files (``suspect_devices.json``) and ``stalwart launch`` both name a node by this function, so
    that a suspect's node is compared with the launcher's own under one name.
    """
    return env_token("SLURMD_NODENAME", "", environ=environ) or socket.gethostname()


VISIBLE_DEVICES_ENV = "STALWART_VISIBLE_DEVICES"
"""Comma list of device ids, one per local rank (``stalwart launch`` sets it on CPU/gloo, as it
sets ``CUDA_VISIBLE_DEVICES`` on GPUs): local rank ``r`` runs on entry ``r``."""


def env_device_list(name: str, *, environ: Mapping[str, str] | None = None) -> list[str]:
    """``$name`` as a comma list of tokens (``[]`` when unset); ValueError naming it otherwise."""
    raw = _environ(environ).get(name)
    if raw is None or raw.strip() == "":
        return []
    items = [item.strip() for item in raw.split(",")]
    if len(raw) > 65536 or not all(_TOKEN.fullmatch(item) and "," not in item for item in items):
        raise ValueError(
            f"environment variable {name}={raw[:40]!r}: must be a comma list of device ids, each "
            "1-256 printable ASCII characters without spaces"
        )
    return items


def check_launch_env(environ: Mapping[str, str] | None = None) -> None:
    """Check every launcher/stalwart variable that is set; ValueError naming the first bad one."""
    env = _environ(environ)
    # A rank must be below its world size when the launcher announced one (a plain process
    # with LOCAL_RANK=3 picking GPU 3 stays allowed).
    world = env_int("WORLD_SIZE", 0, minimum=1, environ=env)
    # RANK without WORLD_SIZE is a world of one: any other rank would run quietly as a non-zero
    # rank (no rank-0 logs, no summary) of a job that does not exist.
    env_int("RANK", 0, maximum=world - 1 if world else 0, environ=env)
    local_world = env_int("LOCAL_WORLD_SIZE", 0, minimum=1, environ=env)
    env_int("LOCAL_RANK", 0, maximum=local_world - 1 if local_world else _MAX_RANKS, environ=env)
    env_int("TORCHELASTIC_RESTART_COUNT", 0, maximum=1 << 31, environ=env)
    for name in _PORT_VARS:
        env_int(name, 1, minimum=1, maximum=65535, environ=env)
    for name in _TOKEN_VARS:
        env_token(name, "", environ=env)
    visible = env_device_list(VISIBLE_DEVICES_ENV, environ=env)
    if visible and env_int("LOCAL_RANK", 0, environ=env) >= len(visible):
        raise ValueError(
            f"environment variable {VISIBLE_DEVICES_ENV}={','.join(visible)[:40]!r}: names "
            f"{len(visible)} device(s), but LOCAL_RANK is {env_int('LOCAL_RANK', 0, environ=env)}"
        )
