"""Measurements of cuctxd against anchors taken in the same run: ``python -m bench``.

Where things live: ``__main__`` (the command line) -> ``run`` (starts the daemon
and the anchor servers, runs every figure, always cleans up) -> ``figures/``
(one module per group of figures) -> ``report`` (the table and the JSON).
``daemon_run`` starts and stops the daemon process, ``anchors`` the bare
ZeroMQ servers and clients the daemon is compared with, ``cuda_local`` the
in-process driver anchors, ``pool`` and ``loads`` the spawned client processes.
"""
