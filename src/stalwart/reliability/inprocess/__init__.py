"""In-process restart: recover from a fault without restarting the job.

Built on torch.distributed's own ``TCPStore``/``PrefixStore`` (no nvidia-resiliency-ext). Entry
points: :func:`restartable` / :class:`InProcessRestarter` for any train function written against
:class:`Attempt`, and ``--inprocess-restart`` for the reference trainer
(:func:`stalwart.train.inprocess.run_training_inprocess`). See ``wrapper.py`` for the
abort -> finalize -> health check -> rendezvous cycle.
"""

from __future__ import annotations

from stalwart.reliability.inprocess.wrapper import Attempt, InProcessRestarter, restartable

__all__ = ["Attempt", "InProcessRestarter", "restartable"]
