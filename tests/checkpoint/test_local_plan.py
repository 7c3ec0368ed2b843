"""The pure parts of local copies and in-memory snapshots: which local iteration is complete and
who serves it, the choice among all copies, the cliques, the owners of ``fully_parallel``, the
shard format's checks, and every module's docstring example."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

from stalwart.checkpoint import integrity
from stalwart.checkpoint.local import assign_owners
from stalwart.checkpoint.local_plan import (
    CopyKind,
    Held,
    choose_copy,
    common_snapshot,
    plan_local,
)
from stalwart.checkpoint.replication import Replication
from stalwart.checkpoint.safe_state import StateFormatError
from stalwart.checkpoint.shard_format import encode_header, parse_shard, split_tensors, tensor_table

MODULES = [
    "shard_format",
    "staging",
    "replication",
    "local_plan",
    "local_layout",
    "local",
    "in_memory",
    "state_fill",
    "non_persistent",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(f"stalwart.checkpoint.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def _held(holder: int, it: int, owner: int, world: int = 2, **kw) -> Held:
    facts = {"algo": "fully_parallel", "save_id": f"s:{it}", "sharded": False, **kw}
    return Held(
        holder,
        it,
        owner,
        world,
        facts["algo"],
        facts["save_id"],
        facts["sharded"],
        f"/n{holder}/{it}/{owner}",
    )


def test_the_owner_serves_its_shard_and_a_replica_covers_a_lost_one() -> None:
    held = [_held(0, 8, 0), _held(0, 8, 1), _held(1, 8, 1), _held(1, 8, 0)]
    plan, why = plan_local(held, 2)
    assert why is None and [(t.owner, t.holder) for t in plan.transfers] == [(0, 0), (1, 1)]
    plan, _ = plan_local([h for h in held if h.holder == 0], 2)  # node 1 lost
    assert [(t.owner, t.holder) for t in plan.transfers] == [(0, 0), (1, 0)]
    assert [t.owner for t in plan.replicas] == [1]


def test_an_incomplete_newest_iteration_falls_back_to_an_older_complete_one() -> None:
    held = [_held(0, 10, 0), _held(0, 8, 0), _held(1, 8, 1)]
    plan, why = plan_local(held, 2)
    assert plan.iteration == 8 and why is None
    assert plan.skipped == ("iteration 10 lacks rank 1's shard (no local directory holds it)",)
    assert plan_local(held[:1], 2) == (None, plan.skipped[0])
    assert plan_local([], 2) == (None, None)


def test_shards_of_two_sessions_never_mix() -> None:
    """Iteration 8 written again after a resume: an old shard of rank 1 and a new one of rank 0
    are not one checkpoint (the training may not be bitwise repeatable)."""
    held = [_held(0, 8, 0, save_id="new:8"), _held(1, 8, 1, save_id="old:8")]
    assert plan_local(held, 2)[0] is None


def test_a_new_world_size_reads_replicated_state_but_not_sharded_state() -> None:
    held = [_held(0, 8, 0), _held(0, 8, 1)]
    plan, _ = plan_local(held, 1)  # a 2-rank save resumed by 1 rank
    assert [(t.owner, t.receivers) for t in plan.transfers] == [(0, (0,)), (1, (0,))]
    atomic = [_held(0, 8, 0, algo="atomic"), _held(0, 8, 1, algo="atomic")]
    plan, _ = plan_local(atomic, 1)
    assert [(t.owner, t.receivers) for t in plan.transfers] == [(0, (0,))]
    sharded = [_held(0, 8, 0, sharded=True), _held(0, 8, 1, sharded=True)]
    assert "sharded (FSDP2) state; this job has 1" in plan_local(sharded, 1)[1]


def test_the_newest_copy_wins_and_a_tie_goes_to_the_cheapest() -> None:
    both = {CopyKind.PERSISTENT: 8, CopyKind.LOCAL: 8}
    assert choose_copy(both).kind is CopyKind.LOCAL
    newer = choose_copy({CopyKind.PERSISTENT: 9, CopyKind.IN_MEMORY: 8}, ["why"])
    assert newer.kind is CopyKind.PERSISTENT
    assert newer.detail == (
        "the persistent checkpoint of iteration 9 (newest complete; also found the in-memory "
        "snapshot of iteration 8; why)"
    )
    assert choose_copy({}) is None
    assert common_snapshot([[6, 8], [8, 10]]) == (8, None)
    assert common_snapshot([[6], []])[1] == "not every rank holds an in-memory snapshot"
    assert common_snapshot([[], []]) == (None, None)


def test_replicas_go_to_other_nodes_and_a_small_world_says_how_many_copies_are_left() -> None:
    ring = Replication(jump=4, factor=2)  # 4 ranks per node
    assert [ring.holders(r, 16) for r in (0, 5, 13)] == [[0, 4], [5, 9], [13, 1]]
    assert ring.receives_from(1, 16) == [13] and ring.sends_to(1, 16) == [5]
    assert ring.shortfall(16, 4) is None
    assert "only 1 node(s), not --replication-factor 2" in ring.shortfall(4, 4)  # one node
    assert Replication(jump=1, factor=2).holders(0, 1) == [0]  # after an exclusion to 1 rank
    assert "only 1 node(s)" in Replication(jump=1, factor=2).shortfall(1, 1)
    three = Replication(jump=1, factor=3)
    assert [three.holders(r, 3) for r in range(3)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert three.receives_from(0, 3) == [2, 1]


def test_fully_parallel_spreads_bytes_evenly() -> None:
    sizes = [(f"t{i}", n) for i, n in enumerate([40, 30, 20, 10, 10, 10])]
    owners = assign_owners(sizes, 3)
    loads = [sum(n for p, n in sizes if owners[p] == r) for r in range(3)]
    assert sorted(loads) == [40, 40, 40]
    assert assign_owners(list(reversed(sizes)), 3) == owners  # the order given does not matter


def _blob(tree) -> bytearray:
    skeleton, tensors = split_tensors(tree)
    table, size = tensor_table(tensors)
    data = bytearray(size)
    for entry, tensor in zip(table, tensors.values(), strict=True):
        data[entry.offset : entry.offset + entry.nbytes] = tensor.numpy().tobytes()
    return bytearray(encode_header({"iteration": 1}, skeleton, table)) + data


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda b: b[:5], "not a stalwart shard"),
        (lambda b: b"STWSHRD1" + (1 << 60).to_bytes(8, "little") + b[16:], "past the end"),
        (lambda b: b[:-60], "does not fit its bytes"),
        (lambda b: b.replace(b'"float32"', b'"object"'), "malformed tensor entry"),
        (
            lambda b: b.replace(b'"format":"stalwart-shard-v1"', b'"format":"stalwart-shard-v0"'),
            "not a stalwart-shard-v1 header",
        ),
    ],
)
def test_a_damaged_shard_is_one_error(damage, needle) -> None:
    blob = _blob({"w": torch.ones(4), "b": torch.zeros(2)})
    assert parse_shard(blob, "x").tensors  # the undamaged one parses
    with pytest.raises(StateFormatError, match=needle):
        parse_shard(bytearray(damage(bytes(blob))), "shard.bin")


def test_overlapping_tensors_are_refused() -> None:
    blob = bytes(_blob({"w": torch.ones(32), "b": torch.zeros(16)}))
    forged = blob.replace(b",128,64]", b",64,64]")  # the second tensor starts inside the first
    assert forged != blob
    with pytest.raises(StateFormatError, match="overlap"):
        parse_shard(bytearray(forged), "shard.bin")


def test_digests_of_bytes_in_memory_match_the_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)
    data = bytes(range(256)) * 10
    (tmp_path / "f").write_bytes(data)
    on_disk = integrity.digests([str(tmp_path / "f")])[str(tmp_path / "f")][1]
    assert integrity.digest_bytes(data[:77], data[77:1500], data[1500:]) == on_disk
    assert on_disk.count("-") == 2
