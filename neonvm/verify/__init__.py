"""Exhaustive exploration of the reconcile protocol: interleavings, crashes, stale reads.

``model`` is a small API server + etcd + caches; ``actors`` drives the shipped
:func:`neonvm.controller.decide.decide` and :mod:`neonvm.controller.mutations` through a
model driver, next to the pod lifecycle, the user and the faults; ``explore`` searches
every interleaving up to a bound and checks ``invariants`` in every state (the replay of a
found trace against the real API server is test code, ``tests/support/replay.py``). See
docs/verification.md.
"""
