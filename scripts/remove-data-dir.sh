#!/usr/bin/env bash
# Removes a data directory that a test run made, with whatever still runs from it: the sandboxes
# its last daemon left behind on purpose (the warm pool, sandboxes a test did not kill: a daemon
# that stops keeps its sandboxes for the next one to adopt) are killed by their runsc root, the
# mounts below it are unmounted deepest first, then the layer filesystem (unmount-data-dir.sh),
# then the directory goes. Run as root, after the daemon stopped.
#   scripts/remove-data-dir.sh DATA_DIR
set -u
d="$(realpath -m -- "${1:?usage: remove-data-dir.sh DATA_DIR}")"
[ -d "$d" ] || exit 0
pat="--root=$d/runsc( |$)"
if pgrep -f -- "$pat" >/dev/null; then
  pkill -KILL -f -- "$pat"
  for _ in $(seq 1 50); do pgrep -f -- "$pat" >/dev/null || break; sleep 0.2; done
fi
findmnt -rn -o TARGET | awk -v p="$d/" 'index($0, p) == 1' | sort -r | while read -r m; do
  umount "$m" 2>/dev/null || umount -l "$m"
done
bash "$(dirname "$0")/unmount-data-dir.sh" "$d"
rm -rf -- "$d"
