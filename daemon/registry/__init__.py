"""Daemon-wide records: sessions (owned by the front thread) and share names."""
