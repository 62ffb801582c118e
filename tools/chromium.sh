#!/usr/bin/env bash
# Debian's Chromium for psflow's browser test (tests/integration/test_dashboard_browser.py), which
# drives it headless with Playwright through executable_path (never `playwright install`: that
# downloads a browser build of its own).
#
#   tools/chromium.sh    prints the browser's path (/usr/bin/chromium) once it is there
#
# Exit codes: 0 the browser is there; 2 it is missing and cannot be installed here (not root, or apt
# failed; the reason is on stderr). As root a missing browser is installed with apt (Debian's
# `chromium` package), unless PSFLOW_CHROMIUM_INSTALL=0.
set -euo pipefail

BROWSER=${PSFLOW_CHROMIUM:-/usr/bin/chromium}
log() { echo "chromium: $*" >&2; }

if [ -x "$BROWSER" ]; then echo "$BROWSER"; exit 0; fi
if [ "${PSFLOW_CHROMIUM_INSTALL:-1}" = 0 ]; then log "$BROWSER is missing and PSFLOW_CHROMIUM_INSTALL=0"; exit 2; fi
if [ "$(id -u)" != 0 ]; then log "$BROWSER is missing and installing it needs root (apt-get install chromium)"; exit 2; fi
if ! command -v apt-get >/dev/null; then log "$BROWSER is missing and there is no apt-get to install it"; exit 2; fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends chromium >/tmp/psflow-chromium-apt.log 2>&1; then
  apt-get update -q >>/tmp/psflow-chromium-apt.log 2>&1 || true  # a stale package list: refresh once, try again
  if ! apt-get install -y -q --no-install-recommends chromium >>/tmp/psflow-chromium-apt.log 2>&1; then
    log "apt-get install chromium failed:"; tail -5 /tmp/psflow-chromium-apt.log >&2; exit 2
  fi
fi
[ -x "$BROWSER" ] || { log "chromium installed, but $BROWSER is not there"; exit 2; }
echo "$BROWSER"
