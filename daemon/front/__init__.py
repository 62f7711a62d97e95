"""The front thread: the main ROUTER, the sessions it owns, and the ops it answers itself."""
