"""A device's worker thread: its own ROUTER (lane), its state, and the only calls to the driver for it."""
