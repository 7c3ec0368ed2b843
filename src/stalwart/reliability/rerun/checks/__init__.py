"""The checks room of the rerun machine: what a pass records and how it is read.

The device buffer and its one read per pass (``buffer``, ``reading``), the rules and their
messages (``rules``), the stats of sampled values (``stats``), the recorder that records a
pass's checks (``recorder``) and the gradient checks (``grads``). Nothing here changes the
machine's state; the machine (``stalwart.reliability.rerun.machine``) judges what is read.
"""
