#!/usr/bin/env bash
# `make vulkan`: what building the pinned tree with ggml's Vulkan backend needs (Debian's Vulkan
# headers and loader, glslc, SPIRV-Headers) and what runs it without a GPU: Mesa's llvmpipe, a
# Vulkan device that computes on the CPU, at Mesa 25 or later. Debian 12's own Mesa 22.3 runs
# featdiff's in-process captures but crashes llama.cpp's programs built with Vulkan
# (llama-speculative-simple -ngl 99: SIGSEGV in every run, in the driver's queue thread, which
# valgrind shows reading and freeing a block it had already freed); bookworm-backports' Mesa 25.0
# runs them. Installs as root, once; as another user, says what to install and fails.
set -euo pipefail

MESA_MIN=25
PACKAGES=(libvulkan-dev glslc spirv-headers)
BACKPORTS=bookworm-backports
BACKPORTS_SOURCE=/etc/apt/sources.list.d/featdiff-$BACKPORTS.sources

mesa_major() { dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | sed 's/^[0-9]*://; s/\..*//'; }

ready() {
  command -v glslc >/dev/null 2>&1 && test -f /usr/include/vulkan/vulkan.h && test -d /usr/share/cmake/SPIRV-Headers \
    && ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 && [ "$(mesa_major || echo 0)" -ge "$MESA_MIN" ]
}

ready && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "Vulkan build packages missing or Mesa older than $MESA_MIN: install Debian's ${PACKAGES[*]} and" \
       "mesa-vulkan-drivers >= $MESA_MIN (Debian 12: apt-get install -t $BACKPORTS mesa-vulkan-drivers), as root" >&2
  exit 1
fi

suite=()
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
if [ "$codename" = bookworm ]; then
  # Debian 12's Mesa is 22.3: take the backports suite's (added beside the machine's own sources)
  if ! grep -rqs "$BACKPORTS" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
      "$BACKPORTS" /usr/share/keyrings/debian-archive-keyring.gpg > "$BACKPORTS_SOURCE"
  fi
  suite=(-t "$BACKPORTS")
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${suite[@]}" mesa-vulkan-drivers >/dev/null
ready || { echo "mesa-vulkan-drivers $(mesa_major || echo '?') installed, older than $MESA_MIN: llama.cpp's Vulkan programs crash on it" >&2; exit 1; }
