#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# Debian packages the test suite uses; installs only what is missing (needs root or sudo then).
#   ceph-mon ceph-osd radosgw: a real S3 server (radosgw) on loopback for the S3 tier's tests
#   prometheus: promtool, to check /metrics, the alert rules and the scrape config
#   systemd: systemd-analyze, to verify the unit file
#   openssl: throwaway certificates for the TLS listener tests; curl: the radosgw start script
#   tmux: a real terminal for the test that drives `kvstoredctl top`
#   redis-server (redis-cli with it): a real Redis Cluster for the fleet directory's tests
set -euo pipefail
packages=(ceph-mon ceph-osd radosgw prometheus systemd openssl curl tmux redis-server "$@")
need=()
for pkg in "${packages[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
