"""Capture: the llama.cpp side. The cffi binding to the build under test, handles on its C API,
the in-process DFlash driver, the preload launcher around unmodified programs, and the packing
of the shim's spool into a dump."""
