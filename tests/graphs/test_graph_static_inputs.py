from __future__ import annotations

import pytest
import torch

from stalwart.graphs import InputSignature, StaticInputs, signature_of


def _batch(seed: int, seq: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, 100, (2, seq), generator=gen),
        "labels": torch.randint(0, 100, (2, seq), generator=gen),
    }


def test_load_copies_into_fixed_addresses() -> None:
    static = StaticInputs(torch.device("cpu"))
    first = [_batch(0), _batch(1)]
    out1 = static.load(first)
    ptrs = static.data_ptrs()
    second = [_batch(2), _batch(3)]
    out2 = static.load(second)
    assert out2 is out1
    assert static.data_ptrs() == ptrs
    assert torch.equal(out2[1]["tokens"], second[1]["tokens"])
    # The static buffers are copies, never aliases of the loader's tensors.
    assert out2[0]["tokens"].data_ptr() != second[0]["tokens"].data_ptr()


def test_tuples_and_constants_are_supported() -> None:
    static = StaticInputs(torch.device("cpu"))
    out = static.load([(torch.ones(2), None, 3)])
    assert isinstance(out[0], tuple) and out[0][1] is None and out[0][2] == 3


def test_shape_change_is_rejected() -> None:
    static = StaticInputs(torch.device("cpu"))
    static.load([_batch(0)])
    with pytest.raises(ValueError, match="shape changed"):
        static.load([_batch(0, seq=8)])
    static.clear()
    assert not static.allocated
    static.load([_batch(0, seq=8)])


def test_signature_covers_dtype_structure_and_constants() -> None:
    base = signature_of([_batch(0)])
    assert signature_of([_batch(5)]) == base
    assert signature_of([{k: v.int() for k, v in _batch(0).items()}]) != base
    assert signature_of([_batch(0), _batch(1)]) != base
    assert signature_of([(torch.ones(1), 1)]) != signature_of([(torch.ones(1), 2)])
    with pytest.raises(ValueError, match="unsupported value"):
        signature_of([object()])


def test_signature_difference_names_the_change() -> None:
    a = InputSignature(4, signature_of([_batch(0)] * 4), (("seq_length", 4),))
    b = InputSignature(2, signature_of([_batch(0)] * 2), (("seq_length", 4),))
    c = InputSignature(4, signature_of([_batch(0)] * 4), (("seq_length", 8),))
    assert "num_microbatches changed from 4 to 2" in a.difference(b)
    assert "static arguments changed" in a.difference(c)


def _chunk(seed: int, count: int = 3) -> list[dict[str, torch.Tensor]]:
    """Micro-batches as ``MicroBatchIterator(chunk_microbatches=count)`` builds them."""
    whole = torch.randint(0, 100, (2 * count, 2, 4), generator=torch.Generator().manual_seed(seed))
    views = whole.unbind(0)
    return [{"tokens": t, "labels": lab} for t, lab in zip(views[:count], views[count:])]


def test_one_buffer_of_micro_batches_loads_with_one_copy() -> None:
    static = StaticInputs(torch.device("cpu"))
    out = static.load(_chunk(0))
    assert static.coalesced
    ptrs = static.data_ptrs()
    copies = []
    original = torch.Tensor.copy_

    def counted(self: torch.Tensor, src: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        copies.append(src.shape)
        return original(self, src, *a, **k)  # type: ignore[arg-type]

    for seed in (1, 2):
        batches = _chunk(seed)
        torch.Tensor.copy_ = counted  # type: ignore[method-assign]
        try:
            assert static.load(batches) is out
        finally:
            torch.Tensor.copy_ = original  # type: ignore[method-assign]
        assert static.data_ptrs() == ptrs
        for got, want in zip(out, batches):
            assert all(torch.equal(got[k], want[k]) and got[k].is_contiguous() for k in want)
    assert copies == [(2 * 3 * 2 * 4,)] * 2  # the whole buffer, once per load


def test_batches_not_in_one_buffer_still_load_exactly() -> None:
    static = StaticInputs(torch.device("cpu"))
    out = static.load(_chunk(0))
    separate = [{k: v.clone() for k, v in b.items()} for b in _chunk(3)]  # same signature
    static.load(separate)
    shuffled = _chunk(4)
    shuffled[0], shuffled[1] = shuffled[1], shuffled[0]  # one buffer, another layout
    for batches in (separate, shuffled):
        static.load(batches)
        for got, want in zip(out, batches):
            assert all(torch.equal(got[k], want[k]) for k in want)
    partial = StaticInputs(torch.device("cpu"))
    partial.load(_chunk(0)[:2])  # views not covering their buffer: copied one by one
    assert not partial.coalesced
