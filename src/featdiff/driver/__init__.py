"""Capture in-process: the driver of each kind's flow over the build under test (llama/)."""
