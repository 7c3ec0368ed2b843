"""stalwart: reliability, observability and full-iteration CUDA graphs for PyTorch training
loops."""

__version__ = "0.1.0"
