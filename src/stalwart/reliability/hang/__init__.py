"""Hang detection: timed sections watched by a monitor process per rank.

``sections`` (the worker side: ``SectionMonitor``, ``build_section_monitor``), ``monitor`` (the
separate process that dumps a stuck rank's stack and kills it), ``config``
(``FaultToleranceConfig``, ``--ft-timeouts``) and ``timeouts`` (learned timeouts, ``ft_state.json``).
"""
