"""The marks of a test module that needs a CUDA device: ``pytestmark = GPU_ONLY``."""

from __future__ import annotations

import pytest
import torch

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
