"""The wire: requests built without I/O, session state, routes, the socket and shm lane transports, the fd channel."""
