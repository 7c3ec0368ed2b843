from stalwart.distributed import collectives

from dist_utils import run_distributed


def _body(rank: int, world_size: int) -> tuple[float, list[bool], list[list[float]]]:
    m = collectives.all_reduce_max(float(rank))
    anyf = collectives.all_reduce_any([rank == 1, False])
    gathered = collectives.all_gather_floats([float(rank), 2.0 * rank])
    return m, anyf, gathered


def test_collectives_two_ranks() -> None:
    results = run_distributed(_body, world_size=2)
    for m, anyf, gathered in results:
        assert m == 1.0
        assert anyf == [True, False]
        assert gathered == [[0.0, 0.0], [1.0, 2.0]]


def test_collectives_without_group_are_identity() -> None:
    assert collectives.all_reduce_max(3.5) == 3.5
    assert collectives.all_reduce_any([True, False]) == [True, False]
    assert collectives.all_gather_floats([1.0]) == [[1.0]]
