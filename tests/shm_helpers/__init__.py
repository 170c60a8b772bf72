"""Helpers for the kvwire.shm tests: top-level functions spawned processes can import."""
