#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
# A throwaway single-node Ceph cluster (one mon, one memstore OSD) with radosgw on loopback,
# for the S3 tier's tests, benchmarks and CI. Everything lives in DIR; nothing is installed.
#
#   start_rgw.sh DIR RGW_PORT MON_PORT     fresh cluster in DIR (wiped first) + rgw + S3 user
#   start_rgw.sh --rgw-only DIR            start radosgw again on an existing DIR (after
#                                          `stop_rgw.sh --rgw-only DIR`); the objects survive
#                                          because the mon and OSD keep running
#
# Prints the endpoint on its last line. Credentials: $RGW_ACCESS_KEY / $RGW_SECRET_KEY
# (default kvak / kvsecret). Memstore size: $RGW_MEMSTORE_BYTES (default 4 GiB, RAM used as filled).
# Needs: apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw curl
# (deploy/install-system-deps.sh). Stop with deploy/ceph/stop_rgw.sh DIR.
set -euo pipefail

rgw_only=0
if [ "${1:-}" = "--rgw-only" ]; then rgw_only=1; shift; fi
D=${1:?usage: start_rgw.sh DIR RGW_PORT MON_PORT | start_rgw.sh --rgw-only DIR}
D=$(realpath -m "$D")
C=(-c "$D/ceph.conf")
HERE=$(dirname "$(realpath "$0")")

for bin in ceph-mon ceph-osd radosgw radosgw-admin monmaptool ceph-authtool ceph curl; do
    command -v "$bin" >/dev/null || {
        echo "start_rgw.sh: $bin not found; install it with deploy/install-system-deps.sh" \
             "(apt-get install --no-install-recommends ceph-mon ceph-osd radosgw curl)" >&2
        exit 127
    }
done

fail() {  # show the logs, stop what this run started, exit 1
    echo "start_rgw.sh: $*" >&2
    for log in "$D"/log/*.log; do
        [ -f "$log" ] && { echo "--- tail of $log" >&2; tail -n 20 "$log" >&2; }
    done
    if [ $rgw_only -eq 1 ]; then "$HERE/stop_rgw.sh" --rgw-only "$D"; else "$HERE/stop_rgw.sh" "$D"; fi >/dev/null 2>&1
    exit 1
}

rgw_log_size() { stat -c %s "$D/log/client.rgw.a.log" 2>/dev/null || echo 0; }

wait_rgw() {  # until the S3 endpoint answers HTTP (any status); give up if radosgw can't listen
    local url=$1 log_from=$2 end=$((SECONDS + 30))
    while [ $SECONDS -lt $end ]; do
        if curl -s -o /dev/null --max-time 1 "$url"; then return 0; fi
        if tail -c +$((log_from + 1)) "$D/log/client.rgw.a.log" 2>/dev/null | grep -q "failed initializing frontend"; then
            fail "radosgw could not listen on $url (port taken?)"
        fi
        sleep 0.1
    done
    fail "radosgw did not answer on $url within 30 s"
}

if [ $rgw_only -eq 1 ]; then
    [ -f "$D/ceph.conf" ] || fail "no cluster in $D (start one first)"
    PORT=$(sed -n 's/^rgw frontends = beast endpoint=127.0.0.1:\([0-9]*\)$/\1/p' "$D/ceph.conf")
    log_from=$(rgw_log_size)
    radosgw "${C[@]}" -n client.rgw.a || fail "radosgw did not start"
    wait_rgw "http://127.0.0.1:$PORT/" "$log_from"
    echo "http://127.0.0.1:$PORT"
    exit 0
fi

PORT=${2:?RGW_PORT}; MONPORT=${3:?MON_PORT}
AK=${RGW_ACCESS_KEY:-kvak}; SK=${RGW_SECRET_KEY:-kvsecret}
MEMSTORE=${RGW_MEMSTORE_BYTES:-4294967296}

# DIR is wiped: refuse anything but a new or empty directory or one of our own clusters.
if [ -e "$D" ] && [ -n "$(ls -A "$D")" ] && [ ! -f "$D/ceph.conf" ]; then
    echo "start_rgw.sh: $D is not empty and holds no cluster of ours; not wiping it" >&2
    exit 2
fi
rm -rf "$D"; mkdir -p "$D"/{run,log,rgw,osd-0}
FSID=$(cat /proc/sys/kernel/random/uuid)
# auth none needs the "crc secure" client modes, or radosgw hangs for 300 s at start.
# A short paxos propose interval makes each pool creation (radosgw makes ~6 at start, one per
# first bucket and first object) take ~0.1 s instead of ~2 s: start-up 12 s -> ~1.5 s.
cat > "$D/ceph.conf" <<CONF
[global]
fsid = $FSID
mon host = v2:127.0.0.1:$MONPORT
public addr = 127.0.0.1
public network = 127.0.0.0/8
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
ms client mode = crc secure
run dir = $D/run
admin socket = $D/run/\$name.asok
log file = $D/log/\$name.log
pid file = $D/run/\$name.pid
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon warn on pool no redundancy = false
mon data avail warn = 1
paxos propose interval = 0.05
[mon]
mon data = $D/mon-\$id
[osd]
osd data = $D/osd-\$id
osd objectstore = memstore
memstore device bytes = $MEMSTORE
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$PORT
rgw data = $D/rgw
CONF

monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MONPORT]" "$D/monmap" >/dev/null
ceph-authtool --create-keyring "$D/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-mon "${C[@]}" --mkfs -i a --monmap "$D/monmap" --keyring "$D/mon.keyring" || fail "ceph-mon --mkfs failed"
ceph-mon "${C[@]}" -i a || fail "ceph-mon did not start"
UUID=$(cat /proc/sys/kernel/random/uuid)
ID=$(timeout 60 ceph "${C[@]}" osd new "$UUID") || fail "ceph osd new failed (is the mon up?)"
ceph-osd "${C[@]}" -i "$ID" --mkfs --osd-uuid "$UUID" 2>/dev/null || fail "ceph-osd --mkfs failed"
ceph-osd "${C[@]}" -i "$ID" 2>/dev/null || fail "ceph-osd did not start"
radosgw "${C[@]}" -n client.rgw.a || fail "radosgw did not start"
wait_rgw "http://127.0.0.1:$PORT/" 0
timeout 60 radosgw-admin "${C[@]}" user create --uid=kv --display-name=kv \
    --access-key="$AK" --secret="$SK" >/dev/null || fail "radosgw-admin user create failed"
echo "http://127.0.0.1:$PORT"
