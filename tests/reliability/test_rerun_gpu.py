"""CUDA checks of the rerun machine: no sync in validate_result, graph-captured checks, CUDA RNG."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from stalwart.reliability.rerun import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunErrorInjector,
    RerunStateMachine,
    ValidationBuffer,
)
from stalwart.rng_state import capture_rng_state, restore_rng_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_validate_result_never_syncs_on_cuda() -> None:
    dev = torch.device("cuda")
    sm = RerunStateMachine(mode="validate_results")
    spiky = functools.partial(sm.is_unexpectedly_large, threshold=10, context="loss", num_samples=2)
    for it in range(4):
        while sm.should_run_forward_backward(iteration=it):
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = torch.randn(16, device=dev).square().mean()
                if it == 3:
                    loss = loss * math.nan
                sm.validate_result(loss, torch.isnan, "nan loss")
                sm.validate_result(loss, spiky, "Spiky loss", fatal=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert sm.should_checkpoint_and_exit() == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)


def test_graph_captured_checks_and_injection() -> None:
    dev = torch.device("cuda")
    buf = ValidationBuffer(dev, name="graph")
    slot = buf.add_check("found NaN in loss", torch.isnan)
    static_x = torch.zeros(8, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        buf.record(slot, static_x.sum())  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.record(slot, static_x.square().sum())

    sm = RerunStateMachine(mode="validate_results")
    sm.recorder.attach_buffer(buf)
    for it in range(3):
        while sm.should_run_forward_backward(iteration=it):
            static_x.copy_(torch.full((8,), math.nan if it == 2 else 1.0, device=dev))
            graph.replay()
    assert sm.should_checkpoint_and_exit() == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)

    inj = RerunErrorInjector(1, "transient_error", at_iterations={1})
    sm = RerunStateMachine(mode="validate_results", error_injector=inj)
    sm.recorder.attach_buffer(buf)
    passes = 0
    for it in range(3):
        while sm.should_run_forward_backward(iteration=it):
            passes += 1
            static_x.fill_(1.0)
            graph.replay()
        code = sm.should_checkpoint_and_exit()
        if code[1]:
            break
    assert (passes, code) == (3, (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION))


def test_cuda_rng_replay() -> None:
    state = capture_rng_state()
    assert state["cuda"] is not None
    a = torch.rand(4, device="cuda")
    restore_rng_state(state)
    assert torch.equal(a, torch.rand(4, device="cuda"))
