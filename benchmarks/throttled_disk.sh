#!/usr/bin/env bash
# Emulate a disk-bound machine for the benchmarks (Linux, root, cgroup v1
# blkio): an ext4 file system on a loop device
# (direct I/O to its backing file, so the guest's page cache of the backing
# file does not hide the limit) whose reads and writes the kernel throttles.
#
#   sudo benchmarks/throttled_disk.sh up [DIR] [READ_MBPS] [WRITE_MBPS]
#   .venv/bin/python benchmarks/bench_dist.py --dir DIR
#   sudo benchmarks/throttled_disk.sh down [DIR]
#
# Defaults: DIR /mnt/tensorckpt-slow, 1500 MB/s read, 450 MB/s write (the raw
# limits issue #6 quotes for the machine its targets were set on). The
# backing file (24 GiB, sparse) lives beside DIR's name under /var/tmp.
set -euo pipefail
cmd=${1:-}
dir=${2:-/mnt/tensorckpt-slow}
img=/var/tmp/$(basename "$dir").img

throttle() {  # $1 device major:minor, $2 read bytes/s, $3 write bytes/s (0: no limit)
  local v1=/sys/fs/cgroup/blkio
  if [ ! -e $v1/blkio.throttle.read_bps_device ]; then
    echo "needs cgroup v1 blkio throttling ($v1); on cgroup v2, set io.max of the benchmark's cgroup instead" >&2
    exit 1
  fi
  # the root group's limits also apply to page-cache writeback, so buffered writes are throttled too
  echo "$1 $2" > $v1/blkio.throttle.read_bps_device
  echo "$1 $3" > $v1/blkio.throttle.write_bps_device
}

case "$cmd" in
  up)
    read_mbps=${3:-1500}
    write_mbps=${4:-450}
    mkdir -p "$dir"
    truncate -s 24G "$img"
    loop=$(losetup -f --show --direct-io=on "$img")
    mkfs.ext4 -q -F "$loop"
    mount "$loop" "$dir"
    majmin=$(lsblk -ndo MAJ:MIN "$loop" | tr -d ' ')
    throttle "$majmin" $((read_mbps * 1000000)) $((write_mbps * 1000000))
    echo "$dir: $loop ($majmin), reads $read_mbps MB/s, writes $write_mbps MB/s"
    ;;
  down)
    loop=$(findmnt -no SOURCE "$dir" || true)
    if [ -n "$loop" ]; then
      majmin=$(lsblk -ndo MAJ:MIN "$loop" | tr -d ' ')
      throttle "$majmin" 0 0 || true
      umount "$dir"
      losetup -d "$loop"
    fi
    rm -f "$img"
    echo "$dir: removed"
    ;;
  *)
    echo "usage: $0 up [DIR] [READ_MBPS] [WRITE_MBPS] | down [DIR]" >&2
    exit 2
    ;;
esac
