"""The fd channel's thread: file descriptors to clients over Unix sockets beside the ipc:// endpoints."""
