"""``psflow chaos``: a job run under random task kills and stalls, and the ledger of what it kept.

``schedule`` (pure: the seeded faults and whom they may hit), ``injector`` (carries them out through
the launch backend), ``report`` (pure: faults survived, restarts, the push ledger, accuracy against
the fault-free run) and ``harness`` (the command's I/O).
"""
