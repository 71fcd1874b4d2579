"""Capture around other programs (`capture --exec`): preload, llama-server, their logs and memory."""
