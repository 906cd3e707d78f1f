#!/usr/bin/env bash
# Debian packages the test suite uses. Installs only what is missing; needs root or sudo for that.
set -euo pipefail
need=()
# (added as tiers/operations land: ceph for the S3 tier, prometheus for promtool)
for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
