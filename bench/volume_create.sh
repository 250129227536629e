#!/bin/bash
# Create latency against a running daemon: a default create (warm pool or checkpoint restore) and
# a create with one volume (a boot: runsc restores a checkpoint only under its own mounts),
# alternating, N each; prints median and p99. A=<api url> DATA=<data dir holding api-key>.
#   A=http://127.0.0.1:3112 DATA=/var/tmp/ember-volumes/data N=20 bench/volume_create.sh
set -eu
A=${A:-http://127.0.0.1:3000}; K=$(cat "${DATA:-/var/lib/ember}/api-key"); N=${N:-20}
curl -s -XPOST "$A/volumes" -H "X-API-Key: $K" -d '{"name":"bench-volume-create"}' >/dev/null
out=$(mktemp)
one() { # $1 = request body; prints seconds
	local t id
	t=$(curl -s -o "$out" -w '%{time_total}' -XPOST "$A/sandboxes" -H "X-API-Key: $K" -d "$1")
	id=$(sed 's/.*"sandboxID":"\([a-z0-9]*\)".*/\1/' "$out")
	curl -s -XDELETE "$A/sandboxes/$id" -H "X-API-Key: $K" >/dev/null
	echo "$t"
}
for _ in $(seq "$N"); do
	echo "plain $(one '{"templateID":"base"}')"
	echo "volume $(one '{"templateID":"base","volumeMounts":[{"name":"bench-volume-create","path":"/mnt/v"}]}')"
	sleep 0.5
done | awk '{a[$1]=a[$1]" "$2} END {for (k in a) print k, a[k]}' | while read -r k rest; do
	echo $rest | tr ' ' '\n' | sort -n | awk -v k="$k" '{v[NR]=$1} END {m=v[int((NR+1)/2)]; p=v[int(NR*0.99+0.999)]; printf "%s: n=%d median=%.0f ms p99=%.0f ms\n", k, NR, m*1000, p*1000}'
done
rm -f "$out"
curl -s -XDELETE "$A/volumes/bench-volume-create" -H "X-API-Key: $K" >/dev/null
