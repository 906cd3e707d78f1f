#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# Stop what deploy/ceph/start_rgw.sh started in DIR (by the pid files there), and wait for it.
#   stop_rgw.sh DIR              radosgw, the OSD and the mon; DIR is left for inspection
#   stop_rgw.sh --rgw-only DIR   radosgw only (restart it with start_rgw.sh --rgw-only DIR)
set -uo pipefail

rgw_only=0
if [ "${1:-}" = "--rgw-only" ]; then rgw_only=1; shift; fi
D=${1:?usage: stop_rgw.sh [--rgw-only] DIR}

alive() {  # running and not a zombie (daemons are reparented; their reaper may be slow)
    [ -r "/proc/$1/stat" ] || return 1
    local state
    state=$(sed 's/^.*) \(.\).*$/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

stop() {  # TERM, wait up to 10 s, then KILL
    local f="$D/run/$1.pid" pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null) || return 0
    [ -n "$pid" ] && alive "$pid" || { rm -f "$f"; return 0; }
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do alive "$pid" || { rm -f "$f"; return 0; }; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
    rm -f "$f"
}

# In this order: radosgw shuts down slowly once the mon is gone.
stop client.rgw.a
if [ $rgw_only -eq 0 ]; then stop osd.0; stop mon.a; fi
exit 0
