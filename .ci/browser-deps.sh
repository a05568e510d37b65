#!/usr/bin/env bash
# Installs Debian's chromium and chromium-driver for the browser tests when they are missing.
set -u
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi
echo "browser-deps: installing chromium and chromium-driver (Debian packages) for the browser tests ..."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq >/dev/null 2>&1 || true
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
  || echo "browser-deps: could not install chromium; browser tests will be skipped"
exit 0
