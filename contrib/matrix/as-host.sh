#!/usr/bin/env bash
# Run the whole test command as a machine of another Debian release would: inside the cached
# root of RELEASE (contrib/matrix/root.sh), with that root as "the host". On a Debian 12 machine,
# `as-host.sh 24.11` checks what `bash contrib/run-tests.sh` does on Debian 13: the host's Slurm is
# 24.11, and 22.05 and 26.05 come from roots built inside that root.
#
#   as-host.sh RELEASE [run-tests.sh ARGS...]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=releases.sh
source "$HERE/releases.sh"

REL=${1:?usage: as-host.sh RELEASE [run-tests.sh ARGS...]}
shift
release_ok "$REL" || mdie "unknown release $REL (supported: ${RELEASES[*]})"
[[ $(id -u) -eq 0 ]] || mdie "must run as root"
bash "$HERE/root.sh" build "$REL"
ROOT=$(root_dir "$REL")
HOST_SRC=/opt/swapaware-as-host/src

cleanup() {
    local d
    for d in "$ROOT$MATRIX_CACHE"/roots/*/; do
        [[ -d $d ]] && umount_root "${d%/}"
    done
    umount_root "$ROOT"
    # `ip netns add` inside the root bind-mounts the root's /run/netns onto itself
    if mountpoint -q "$ROOT/run/netns"; then umount "$ROOT/run/netns" || umount -l "$ROOT/run/netns"; fi
}
trap cleanup EXIT
mount_root "$ROOT"
rm -rf "${ROOT:?}$HOST_SRC" && mkdir -p "$ROOT$HOST_SRC"
# The committed files only, and no .git: the root has no git, as a tarball checkout would not.
(cd "$REPO" && git ls-files -z -c | tar --null -T - -cf -) | tar -xf - -C "$ROOT$HOST_SRC"
chroot "$ROOT" "${ROOT_ENV[@]}" CI="${CI:-}" SWAPAWARE_VENV=/opt/swapaware-as-host/venv \
    bash -c 'cd "$0" && exec bash contrib/run-tests.sh "$@"' "$HOST_SRC" "$@"
