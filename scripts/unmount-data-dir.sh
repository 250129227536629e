#!/usr/bin/env bash
# Unmounts what ember mounted in a data directory that is about to be removed (run as root,
# after the daemon and its sandboxes are gone): runsc's namespace bind mount, and the btrfs
# layer filesystem that `ember serve --layer-fs=auto` mounts over the data directory on hosts
# whose filesystem cannot clone (ext4). Its loop device is attached with autoclear, so the
# unmount detaches it too. Nothing mounted: nothing done.
#   scripts/unmount-data-dir.sh DATA_DIR
set -u
d="${1:?usage: unmount-data-dir.sh DATA_DIR}"
d="$(realpath -m -- "$d")"
umount "$d/runsc/null-netns" 2>/dev/null
mountpoint -q -- "$d" || exit 0
for _ in $(seq 1 50); do
  # -R: the mounts below it first (a sandbox's overlay left by a cut run).
  umount -R -- "$d" 2>/dev/null && break
  sleep 0.2
done
if mountpoint -q -- "$d"; then
  echo "unmount-data-dir: $d is busy: detached lazily (its loop device goes with its last user)" >&2
  umount -l -- "$d"
  exit 1
fi
exit 0
