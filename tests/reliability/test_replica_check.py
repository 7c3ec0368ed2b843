"""Single-process tests of the replica weight check: fingerprints, the pure decision, the checker."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stalwart.reliability.rerun.attribution.fingerprints import (
    CHECK_INTERVAL_FLAG,
    ReplicaCheckResult,
    check_replica_consistency,
    decide_replica_consistency,
    flip_parameter_bit,
    parameter_fingerprints,
)
from stalwart.reliability.rerun.attribution.replicas import ReplicaCheck, ReplicaSchedule

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def _flip_bit(param: torch.Tensor, element: int, bit: int) -> None:
    """Flip one bit of one element in place, through an integer view of the same bytes."""
    int_dtype = _INT_VIEW[param.element_size()]
    width = 8 * param.element_size()
    mask = torch.iinfo(int_dtype).min if bit == width - 1 else 1 << bit  # sign bit as a value
    with torch.no_grad():
        words = param.data.view(-1).view(int_dtype)
        words[element] ^= mask


def test_fingerprints_shape_dtype_and_determinism() -> None:
    a, b = _model(seed=3), _model(seed=3)
    fa = parameter_fingerprints(a)
    assert fa.dtype == torch.int64 and fa.dim() == 1
    assert fa.numel() == len(list(a.parameters()))
    assert torch.equal(fa, parameter_fingerprints(b))  # same weights, separate module
    assert torch.equal(fa, parameter_fingerprints(a))  # repeatable
    assert not torch.equal(fa, parameter_fingerprints(_model(seed=4)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("chunk", [1, 3, 1 << 22])
def test_fingerprint_is_the_documented_sum(dtype: torch.dtype, chunk: int) -> None:
    """The exact value: sum of unsigned word i times (2 i + 1), modulo 2**64, as an int64
    (computed here in Python integers), whatever the chunking; an empty tensor is zero."""
    from stalwart.reliability.rerun.attribution.fingerprints import tensor_fingerprints

    torch.manual_seed(1)
    tensors = [torch.randn(5, 3).to(dtype), torch.randn(7).to(dtype), torch.empty(0, dtype=dtype)]
    bits = 16 if dtype in (torch.bfloat16, torch.float16) else 32
    expected = []
    for t in tensors:
        words = t.contiguous().view(-1).view(torch.int16 if bits == 16 else torch.int32).tolist()
        total = sum((w % (1 << bits)) * (2 * i + 1) for i, w in enumerate(words)) % (1 << 64)
        expected.append(total - (1 << 64) if total >= 1 << 63 else total)
    assert tensor_fingerprints(tensors, chunk_words=chunk).tolist() == expected
    assert expected[-1] == 0


def test_fingerprints_independent_of_chunking() -> None:
    model = _model()
    reference = parameter_fingerprints(model)
    for chunk in (1, 3, 7, 32):
        assert torch.equal(parameter_fingerprints(model, chunk_words=chunk), reference)


@pytest.mark.parametrize("chunk", [0, -1, 2**31 + 1])
def test_bad_chunk_size_rejected(chunk: int) -> None:
    with pytest.raises(ValueError, match="chunk_words"):
        parameter_fingerprints(_model(), chunk_words=chunk)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_single_bit_flip_changes_only_that_parameter(dtype: torch.dtype) -> None:
    model = _model(dtype)
    before = parameter_fingerprints(model)
    target = model[2].weight  # third parameter in named_parameters() order
    _flip_bit(target, element=5, bit=3)
    after = parameter_fingerprints(model)
    changed = (before != after).tolist()
    assert changed == [False, False, True, False]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_single_bit_flip_is_detected(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    holder = nn.Module()
    holder.p = nn.Parameter(torch.randn(5).to(dtype))
    original = parameter_fingerprints(holder).tolist()
    width = 8 * holder.p.element_size()
    for element in range(holder.p.numel()):
        for bit in range(width):
            _flip_bit(holder.p, element, bit)
            assert parameter_fingerprints(holder).tolist() != original, (element, bit)
            _flip_bit(holder.p, element, bit)  # restore
    assert parameter_fingerprints(holder).tolist() == original


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_pair_of_bit_flips_in_different_elements_is_detected(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    holder = nn.Module()
    holder.p = nn.Parameter(torch.randn(3).to(dtype))
    original = parameter_fingerprints(holder).tolist()
    width = 8 * holder.p.element_size()
    for first, second in [(0, 1), (0, 2), (1, 2)]:
        for bit_a in range(width):
            for bit_b in range(width):
                _flip_bit(holder.p, first, bit_a)
                _flip_bit(holder.p, second, bit_b)
                assert parameter_fingerprints(holder).tolist() != original, (bit_a, bit_b)
                _flip_bit(holder.p, second, bit_b)
                _flip_bit(holder.p, first, bit_a)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_permutation_changes_fingerprint(dtype: torch.dtype) -> None:
    holder = nn.Module()
    holder.p = nn.Parameter(torch.arange(1, 13, dtype=torch.float32).reshape(3, 4).to(dtype))
    original = parameter_fingerprints(holder)
    with torch.no_grad():
        swapped = holder.p.data.clone()
        swapped.view(-1)[[0, 7]] = swapped.view(-1)[[7, 0]]
        holder.p.copy_(swapped)
    assert not torch.equal(parameter_fingerprints(holder), original)
    with torch.no_grad():
        holder.p.copy_(torch.arange(12, 0, -1, dtype=torch.float32).reshape(3, 4).to(dtype))
    assert not torch.equal(parameter_fingerprints(holder), original)


def test_non_contiguous_parameter_uses_logical_order() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a, b = nn.Module(), nn.Module()
    a.p = nn.Parameter(base.clone())
    b.p = nn.Parameter(base.t().contiguous().t())  # same values, transposed storage
    assert not b.p.is_contiguous()
    assert torch.equal(parameter_fingerprints(a), parameter_fingerprints(b))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.uint8])
def test_unsupported_dtype_raises_type_error(dtype: torch.dtype) -> None:
    holder = nn.Module()
    holder.p = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False)
    with pytest.raises(TypeError, match="'p'"):
        parameter_fingerprints(holder)


def test_parameters_on_several_devices_rejected() -> None:
    holder = nn.Module()
    holder.a = nn.Parameter(torch.zeros(2))
    holder.b = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        parameter_fingerprints(holder)


def test_module_without_parameters() -> None:
    out = parameter_fingerprints(nn.ReLU())
    assert out.dtype == torch.int64 and out.numel() == 0
    assert check_replica_consistency(nn.ReLU()).consistent


def test_check_without_process_group_is_consistent() -> None:
    result = check_replica_consistency(_model())
    assert result == ReplicaCheckResult(True, [], [])


# --- pure decision ------------------------------------------------------------------------------


def test_decide_all_equal() -> None:
    result = decide_replica_consistency([[1, 2, 3]] * 4, ["a", "b", "c"])
    assert result == ReplicaCheckResult(True, [], [], reference_ranks=[0, 1, 2, 3])
    assert "consistent" in result.describe()


def test_decide_one_rank_of_four_differs() -> None:
    rows = [[1, 2, 3], [1, 2, 3], [1, 9, 3], [1, 2, 3]]
    result = decide_replica_consistency(rows, ["a", "b", "c"])
    assert not result.consistent
    assert result.mismatched_ranks == [2]
    assert result.mismatched_parameters == ["b"]
    assert "[2]" in result.describe() and "b" in result.describe()


def test_decide_two_against_two_tie_keeps_lowest_rank_group() -> None:
    rows = [[5, 6], [7, 6], [5, 6], [7, 6]]
    result = decide_replica_consistency(rows, ["w", "b"])
    assert result.mismatched_ranks == [1, 3]
    assert result.mismatched_parameters == ["w"]
    assert not result.has_majority and result.reference_ranks == [0, 2]
    assert "no majority tells which replica is right: ranks [0, 2] vs ranks [1, 3]" in (
        result.describe()
    )
    rows = [[7, 6], [7, 6], [5, 6], [5, 6]]
    assert decide_replica_consistency(rows, ["w", "b"]).mismatched_ranks == [2, 3]


def test_decide_majority_need_not_include_rank_zero() -> None:
    rows = [[0, 0], [1, 1], [1, 1], [1, 1]]
    result = decide_replica_consistency(rows, ["x", "y"])
    assert result.mismatched_ranks == [0]
    assert result.mismatched_parameters == ["x", "y"]


def test_decide_several_parameters_and_ranks() -> None:
    names = [f"layer{i}.weight" for i in range(8)]
    good = list(range(8))
    bad1 = [*good[:2], 99, *good[3:]]
    bad2 = [*good[:6], 98, 97]
    rows = [good, bad1, good, bad2, good]
    result = decide_replica_consistency(rows, names)
    assert result.mismatched_ranks == [1, 3]
    assert result.mismatched_parameters == ["layer2.weight", "layer6.weight", "layer7.weight"]


def test_decide_all_different_references_rank_zero() -> None:
    result = decide_replica_consistency([[1], [2], [3]], ["p"])
    assert result.mismatched_ranks == [1, 2]
    assert result.mismatched_parameters == ["p"]


def test_decide_validates_shapes() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        decide_replica_consistency([], ["a"])
    with pytest.raises(ValueError, match="rank 1"):
        decide_replica_consistency([[1, 2], [1]], ["a", "b"])


def test_describe_lists_at_most_five_parameters() -> None:
    names = [f"p{i}" for i in range(8)]
    result = ReplicaCheckResult(False, [1, 3], names)
    line = result.describe()
    assert "\n" not in line
    assert "[1, 3]" in line
    assert all(f"p{i}" in line for i in range(5))
    assert "p5" not in line and "+3 more" in line


# --- checker ------------------------------------------------------------------------------------


def _checker(interval: int) -> ReplicaCheck:
    return ReplicaCheck(ReplicaSchedule(interval))


def test_checker_interval_logic() -> None:
    checker = _checker(3)
    assert checker.schedule.enabled
    assert [i for i in range(1, 11) if checker.due(i)] == [3, 6, 9]
    assert not checker.due(0)


def test_checker_disabled_with_zero() -> None:
    checker = _checker(0)
    assert not checker.schedule.enabled
    assert not any(checker.due(i) for i in range(0, 20))


def test_checker_every_iteration() -> None:
    checker = _checker(1)
    assert all(checker.due(i) for i in range(1, 5))


def test_checker_negative_interval_names_flag() -> None:
    with pytest.raises(ValueError, match=CHECK_INTERVAL_FLAG):
        _checker(-1)
    assert CHECK_INTERVAL_FLAG == "--check-weight-hash-across-dp-replicas-interval"


def test_checker_check_without_group() -> None:
    assert _checker(5).check(_model()).consistent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_flip_parameter_bit_is_a_large_finite_change_undone_by_a_second_flip(dtype) -> None:
    model = nn.Linear(3, 2).to(dtype)
    with torch.no_grad():
        model.weight.fill_(0.75)
    before = parameter_fingerprints(model)
    what = flip_parameter_bit(model)
    assert what.endswith("of weight[0]")
    value = float(model.weight.detach().view(-1)[0])
    # A high mantissa bit: big enough that a later optimizer step cannot round it away.
    assert torch.isfinite(model.weight).all() and 0.0625 <= abs(value - 0.75) / 0.75 <= 0.125
    assert torch.equal(model.weight.view(-1)[1:], torch.full((5,), 0.75, dtype=dtype))
    after = parameter_fingerprints(model)
    assert after[0] != before[0] and after[1] == before[1]
    flip_parameter_bit(model)
    assert torch.equal(parameter_fingerprints(model), before)


def test_flip_parameter_bit_by_name_and_bit() -> None:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.bias.fill_(1.0)
    flip_parameter_bit(model, "bias", bit=31)  # the sign bit
    assert model.bias.tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="bit must be"):
        flip_parameter_bit(model, "bias", bit=32)
