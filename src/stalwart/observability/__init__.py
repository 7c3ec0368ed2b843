"""Observability: timers, training log, metric sinks (TensorBoard / W&B / JSONL), progress bar,
stragglers, theoretical vs measured memory, energy and tensor dumps (the offline run report is
`stalwart.report`).

Every part works on its own in a hand-written loop (see each module's docstring).
"""
