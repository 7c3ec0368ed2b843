"""The attribution room of the rerun machine: who is to blame for a rejected result.

The peer replay (``peer``: the plan and the outcome, pure; ``peer_flow``: the pass), the
verdict file a relaunch applies (``verdict_file``), and the one replica check (``replicas``,
with its fingerprints in ``fingerprints``): in the step, and before every save.
"""
