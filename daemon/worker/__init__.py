"""A device's worker loop: the thread that polls its ways in (tasks, its own ROUTER, shm lanes) and runs their jobs."""
