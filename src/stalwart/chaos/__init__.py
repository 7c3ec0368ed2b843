"""Chaos campaigns: the reference trainer under a seeded schedule of faults, compared bitwise with
the fault-free run (``stalwart chaos``; see ``docs/reliability.md``).

Modules: ``schedule`` (fault kinds, documented outcomes, seeded plan), ``runner`` (torchrun
launches with time-stamped output), ``scenarios``/``storage`` (one function per fault kind),
``compare`` (bitwise parameters, checkpoint-chain readability), ``campaign`` (the whole run).
"""
