"""cuctxd, the CUDA context daemon: a front socket, one worker thread per device, sessions, backends."""

from cuctxd.protos.version import __version__ as __version__
