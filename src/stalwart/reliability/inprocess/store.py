"""The key-value store that outlives process groups: attempts, failures, heartbeats, barriers.

Rank 0 hosts a ``torch.distributed.TCPStore`` of its own (not the process group's), so aborting
or destroying a process group never loses it. Each attempt ``n`` works in the namespace
``PrefixStore("stalwart_inprocess/attempt_<n>")``; its process group is initialised from the
sub-namespace ``.../pg``, so a restart never sees the keys of an earlier rendezvous.

Keys of attempt ``n`` (under its prefix): ``failure`` (the first `FailureRecord`, compare-set so
the first writer wins), ``hb_<rank>`` (heartbeat counters), ``health_<rank>``, ``done_<rank>``
and the barrier counters. The base namespace holds ``attempt`` (the attempt a late joiner, e.g. a
rank restarted by its launcher, must join).

A TCPStore client is one socket: one object must not be used by two threads at once, so the
monitor thread of each rank opens its own client with :meth:`RestartStore.client`.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from stalwart.distributed.launch_env import env_int, env_token
from stalwart.reliability.inprocess.policy import FailureRecord

PORT_ENV = "STALWART_INPROCESS_PORT"
PORT_OFFSET = 2  # MASTER_PORT + 2 unless STALWART_INPROCESS_PORT is set (Megatron/NVRx: +1/+2)
ROOT = "stalwart_inprocess"


class RendezvousTimeout(RuntimeError):
    """Not every rank arrived at an in-process restart barrier in time."""


@dataclass(frozen=True)
class StoreAddress:
    """Where rank 0 hosts the restart store."""

    host: str
    port: int

    @classmethod
    def from_env(cls) -> StoreAddress:
        """``MASTER_ADDR`` and ``STALWART_INPROCESS_PORT`` (default ``MASTER_PORT + 2``)."""
        host = env_token("MASTER_ADDR", "127.0.0.1")
        if os.environ.get(PORT_ENV):
            return cls(host, env_int(PORT_ENV, 0, minimum=1, maximum=65535))
        if not os.environ.get("MASTER_PORT"):
            raise ValueError(f"--inprocess-restart: set MASTER_PORT or {PORT_ENV} (use torchrun)")
        port = env_int("MASTER_PORT", 0, minimum=1, maximum=65535 - PORT_OFFSET)
        return cls(host, port + PORT_OFFSET)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class RestartStore:
    """Typed access to the restart store for one rank (main-thread client)."""

    def __init__(
        self,
        address: StoreAddress | None,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 300.0,
        _store: dist.Store | None = None,
    ) -> None:
        self.address, self.rank, self.world_size = address, rank, world_size
        self.timeout_s = timeout_s
        if _store is not None:
            self.base: dist.Store = _store
        elif address is not None:
            self.base = dist.TCPStore(
                address.host,
                address.port,
                world_size,
                is_master=rank == 0,
                timeout=_td(timeout_s),
                wait_for_workers=False,
            )
        else:
            raise ValueError("RestartStore needs an address or a store")
        self.root = dist.PrefixStore(ROOT, self.base)

    @classmethod
    def local(cls) -> RestartStore:
        """A single-process store (``HashStore``: thread-safe, so ``client()`` shares it)."""
        return cls(None, 0, 1, _store=dist.HashStore())

    def client(self) -> RestartStore:
        """A second connection to the same store (for another thread)."""
        if self.address is None:
            return self
        store = dist.TCPStore(
            self.address.host,
            self.address.port,
            self.world_size,
            is_master=False,
            timeout=_td(self.timeout_s),
        )
        return RestartStore(
            self.address, self.rank, self.world_size, timeout_s=self.timeout_s, _store=store
        )

    # ------------------------------------------------------------------ attempts
    def attempt(self, n: int) -> dist.PrefixStore:
        return dist.PrefixStore(f"attempt_{n}", self.root)

    def group_store(self, n: int) -> dist.PrefixStore:
        """The namespace the process group of attempt ``n`` is initialised from."""
        return dist.PrefixStore("pg", self.attempt(n))

    def current_attempt(self) -> int:
        """The attempt in progress (0 for a fresh job); a late joiner starts there."""
        if not self.root.check(["attempt"]):
            return 0
        return int(self.root.get("attempt"))

    def advance_attempt(self, n: int) -> None:
        """Announce attempt ``n`` (idempotent: every rank may call it)."""
        self.root.set("attempt", str(n))

    # ------------------------------------------------------------------ failures
    def publish_failure(self, record: FailureRecord) -> FailureRecord:
        """Store ``record`` unless another rank was first; returns the winning record."""
        store = self.attempt(record.attempt)
        won = store.compare_set("failure", "", record.to_json())
        return FailureRecord.from_json(won)

    def failure(self, n: int) -> FailureRecord | None:
        store = self.attempt(n)
        if not store.check(["failure"]):
            return None
        return FailureRecord.from_json(store.get("failure"))

    def wait_failure(self, n: int, timeout_s: float) -> FailureRecord | None:
        """Poll for attempt ``n``'s failure record for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.failure(n)
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def history(self, upto: int) -> list[FailureRecord]:
        """Failure records of attempts ``0..upto`` (those that have one)."""
        records = (self.failure(n) for n in range(upto + 1))
        return [r for r in records if r is not None]

    # ------------------------------------------------------------------ heartbeats
    def beat(self, n: int) -> int:
        return int(self.attempt(n).add(f"hb_{self.rank}", 1))

    def peer_beats(self, n: int) -> list[int]:
        store = self.attempt(n)
        return [int(store.add(f"hb_{r}", 0)) for r in range(self.world_size)]

    # ------------------------------------------------------------------ barriers
    def barrier(self, n: int, name: str, timeout_s: float) -> None:
        """Wait until every rank has reached barrier ``name`` of attempt ``n``."""
        store = self.attempt(n)
        arrived = int(store.add(f"{name}/arrived", 1))
        if arrived >= self.world_size:
            store.set(f"{name}/open", "1")
        try:
            store.wait([f"{name}/open"], _td(timeout_s))
        except (dist.DistStoreError, RuntimeError) as exc:
            count = int(store.add(f"{name}/arrived", 0))
            raise RendezvousTimeout(
                f"in-process restart: only {count} of {self.world_size} ranks reached the "
                f"'{name}' barrier of attempt {n} within {timeout_s:.0f}s"
            ) from exc

    def set_rank_value(self, n: int, key: str, value: str) -> None:
        self.attempt(n).set(f"{key}_{self.rank}", value)

    def wait_rank_value(self, n: int, key: str, rank: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``rank`` to set ``key``; False on timeout."""
        try:
            self.attempt(n).wait([f"{key}_{rank}"], _td(timeout_s))
        except (dist.DistStoreError, RuntimeError):
            return False
        return True

    def rank_values(self, n: int, key: str) -> list[str | None]:
        store = self.attempt(n)
        keys = [f"{key}_{r}" for r in range(self.world_size)]
        return [store.get(k).decode() if store.check([k]) else None for k in keys]
