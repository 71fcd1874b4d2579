# Two commands: `make demo` and `make test`. Each does the whole set-up first (a virtual env in
# .venv with the CPU torch wheel, featdiff itself, and the pinned llama.cpp's library built once
# into build/llama.cpp, the build the tools later extend).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.featdiff-setup
TORCH  := torch==2.13.0

.PHONY: setup library demo lint test test-fast test-cuda bench browser vulkan tools clean

setup: $(STAMP) library

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,lint,convert]'
	touch $(STAMP)

# libllama of the pinned llama.cpp (llama-cpp-python 0.3.36's sdist, with featdiff's patches),
# built once into build/llama.cpp/src/build; `make tools` adds the programs to the same build.
library: $(STAMP)
	$(BIN)/python -m featdiff.llama.tools --library

# Debian's Chromium renders the HTML report in the report tests (root installs it once).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: install Debian's chromium package (sudo apt-get install chromium)"; exit 1; fi; }

# Debian's Vulkan headers, loader, glslc and SPIRV-Headers build the pinned tree with ggml's Vulkan
# backend, and Mesa's llvmpipe (a Vulkan device that computes on the CPU), at Mesa 25 or later
# (Debian 12: bookworm-backports), runs it, for the tests that capture on a device backend
# (tests/llama/test_device*.py; root installs them once; scripts/vulkan-packages.sh says why 25).
vulkan:
	@bash scripts/vulkan-packages.sh

# The in-process parts need only the library (setup), so their verdicts print first; demo.sh
# builds the tools (make tools' step, once) before the part that runs llama-server.
demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

# llama-server, llama-speculative-simple, llama-simple and llama-quantize, added to the library's
# build for `capture --exec` and the tests; built once, cached in build/llama.cpp
tools: setup
	$(BIN)/python -m featdiff.llama.tools

# ruff (pyproject.toml [tool.ruff]): the lint rules, and the formatter's check on every file it
# holds; mypy (pyproject.toml [tool.mypy]): the package's types
LINTED := src tests bench
lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# The 20 slowest tests printed at the end: where a fresh clone's time goes. TEST_WORKERS pytest
# processes (pytest-xdist) take the test modules one at a time, in the suite's order (its
# conftest.py runs the modules that wait on a background build last); TEST_WORKERS=0 runs the
# suite in one process. The tests' llama.cpp and torch compute on one thread each.
TEST_WORKERS ?= 2
test: setup lint browser vulkan tools
	$(BIN)/python -m pytest -q -m "not cuda" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=20

# Everything that needs neither the tools build nor a browser (markers in pyproject.toml,
# tests/conftest.py) and nothing `slow`: measured 133 s (880 tests) on 2 idle cores after set-up, caches warm.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not cuda and not tools and not browser and not slow"

# The device tests (tests/llama/test_device*.py) on CUDA, on a machine with an NVIDIA GPU: the
# pinned tree built once with -DGGML_CUDA=ON into build/llama.cpp-cuda (nvcc and cuBLAS needed), or
# a build of your own (FEATDIFF_CUDA_LLAMA_DIR=<its CMake build dir>). Without a GPU they skip.
test-cuda: setup tools
	$(BIN)/python -m pytest -q -m cuda -rs

# Speed goals, each a ratio measured side by side in one run (not part of `make test`).
bench: setup
	$(BIN)/python bench/bench_capture.py
	$(BIN)/python bench/bench_compare.py
	$(BIN)/python bench/bench_report.py
	$(BIN)/python bench/bench_hf_target.py

clean:
	rm -rf $(VENV) demo-out build
