"""Hang detection: timed sections watched by a monitor process per rank.

``sections`` (the worker side: ``SectionMonitor``, ``build_section_monitor``), ``monitor`` (the
separate process that escalates on a stuck rank: stack and flight-recorder dump, abort, kill),
``monitor_client`` (its worker end: heartbeat record, process start), ``abort_listener`` (the
worker thread that aborts the process groups on the monitor's request), ``config``
(``FaultToleranceConfig``, ``--ft-timeouts``), ``timeouts`` (learned timeouts, ``ft_state.json``)
and ``tiers`` (the timeout hierarchy checked at start-up).
"""
