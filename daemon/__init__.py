"""cuctxd, the CUDA context daemon: a front socket, one worker thread per device, sessions, backends."""

__version__ = "0.1.0"
