"""Asynchronous saves: host staging buffers and the checkpoint thread."""
