"""The walks of nested tensor structures that the static inputs and the checkpoint's host copy share."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from types import MappingProxyType

import torch

from stalwart.checkpoint.dcp_io import _host_copy
from stalwart.tensor_tree import map_tensors, tensor_leaves

Pair = namedtuple("Pair", "a b")


def test_map_tensors_rebuilds_the_containers_and_keeps_other_leaves() -> None:
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 7.0)
    label = object()
    obj = {"x": [a, (b, "s", None)], "y": MappingProxyType({"z": c}), "n": Pair(a, label)}
    out = map_tensors(obj, lambda t: t + 1)
    assert type(out["y"]) is dict and type(out["n"]) is tuple  # as plain containers
    assert out["x"][1][1:] == ("s", None) and out["n"][1] is label
    leaves = tensor_leaves(out)
    expected = [a + 1, b + 1, c + 1, a + 1]
    assert len(leaves) == 4 and all(torch.equal(x, y) for x, y in zip(leaves, expected))
    assert [t.data_ptr() for t in tensor_leaves(obj)] == [t.data_ptr() for t in (a, b, c, a)]


def test_the_host_copy_copies_every_tensor_and_shares_no_storage() -> None:
    state = OrderedDict(w=torch.arange(4.0), opt={"step": 3, "m": [torch.ones(2)]})
    copied = _host_copy(state, pin=False)
    assert copied["opt"]["step"] == 3
    for original, copy in zip(tensor_leaves(state), tensor_leaves(copied), strict=True):
        assert torch.equal(original, copy) and copy.device.type == "cpu"
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    state["w"].add_(1.0)  # the live state moves on; the staged copy does not
    assert torch.equal(copied["w"], torch.arange(4.0))
