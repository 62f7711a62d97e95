"""A device's state: its contexts, memory, pools, streams, host buffers and shares, owned by its worker thread."""
