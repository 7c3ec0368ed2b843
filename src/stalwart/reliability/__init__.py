"""Reliability shell: rerun state machine, hang detection, graceful exit, fault injection,
in-process restart. Import the submodules (``stalwart.reliability.rerun``, ``.sections``,
``.exit``, ``.signals``, ``.faults``, ``.inprocess``); nothing is re-exported here so that importing
one part never starts another's machinery."""
