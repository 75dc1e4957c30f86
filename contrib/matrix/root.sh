#!/usr/bin/env bash
# A Debian root holding one Slurm release (its own daemons, MariaDB, munge, Lua, Python), built
# once with debootstrap and kept under $SWAPAWARE_MATRIX_CACHE (default /var/cache/swapaware-matrix)
# so that later runs reuse it. Runs as root.
#
#   root.sh build RELEASE     build (or reuse) the root of RELEASE (22.05, 24.11, 26.05)
#   root.sh path RELEASE      print its directory
#   root.sh remove RELEASE    delete it
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=releases.sh
source "$HERE/releases.sh"


ensure_debootstrap() {
    command -v debootstrap >/dev/null && return 0
    mlog "installing debootstrap"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        debootstrap debian-archive-keyring; } >&2 || mdie "cannot install debootstrap"
}

# in_root ROOT CMD...: run CMD inside ROOT with /proc, /sys, /dev mounted for the call.
in_root() {
    local root=$1 rc=0
    shift
    mount_root "$root"
    chroot "$root" "${ROOT_ENV[@]}" DEBIAN_FRONTEND=noninteractive "$@" || rc=$?
    umount_root "$root"
    return $rc
}

cmd_build() {
    local rel=$1 root tmp suite
    release_ok "$rel" || mdie "unknown release $rel (supported: ${RELEASES[*]})"
    root=$(root_dir "$rel")
    suite=${SUITE_OF[$rel]}
    if [[ -f $root/.swapaware-root && $(cat "$root/.swapaware-root") == "$(stamp_text "$rel")" ]]; then
        mlog "root of Slurm $rel ($suite) is cached in $root"
        return 0
    fi
    # Same suite and format, packages added to ROOT_PACKAGES since: install those, no rebuild.
    if [[ -f $root/.swapaware-root ]] && grep -qx "suite=$suite" "$root/.swapaware-root" &&
        grep -qx 'format=1' "$root/.swapaware-root"; then
        release_lock "$rel" "root.sh build $rel (adding packages)"
        mount_root "$root"
        local rc=0
        (root_add_packages "$root" "$rel") || rc=$?
        umount_root "$root"
        ((rc == 0)) || exit $rc
        mlog "root of Slurm $rel ($suite) is cached in $root, packages added"
        return 0
    fi
    ensure_debootstrap
    mkdir -p "$(dirname "$root")"
    tmp=$root.building
    if [[ -d $tmp ]]; then umount_root "$tmp"; rm -rf --one-file-system "$tmp"; fi
    mlog "debootstrap $suite into $tmp (a few minutes, once)"
    local t0=$SECONDS
    debootstrap --variant=minbase --include=ca-certificates "$suite" "$tmp" "$DEBIAN_MIRROR" \
        >"$tmp.log" 2>&1 || { tail -n 20 "$tmp.log" >&2; mdie "debootstrap $suite failed (log $tmp.log)"; }
    ensure_hosts "$tmp"
    printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
    chmod 755 "$tmp/usr/sbin/policy-rc.d"
    # The machine's own certificate authorities (pip and apt inside the root go through them).
    if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
        mkdir -p "$tmp/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$tmp/usr/local/share/ca-certificates/"
    fi
    echo 'Acquire::Check-Valid-Until "false";' >"$tmp/etc/apt/apt.conf.d/90swapaware"
    in_root "$tmp" sh -c "update-ca-certificates >/dev/null 2>&1; apt-get update -qq && \
        apt-get install -y -qq --no-install-recommends ${ROOT_PACKAGES[*]} >/dev/null && apt-get clean" \
        >>"$tmp.log" 2>&1 || { tail -n 20 "$tmp.log" >&2; mdie "package install in the $suite root failed (log $tmp.log)"; }
    local got
    got=$(chroot "$tmp" dpkg-query -W -f='${Version}' slurmctld)
    [[ $got == "$rel".* ]] || mdie "the $suite root has slurmctld $got, expected $rel.x"
    stamp_text "$rel" >"$tmp/.swapaware-root"
    if [[ -d $root ]]; then umount_root "$root"; rm -rf --one-file-system "$root"; fi
    mv "$tmp" "$root"
    mv "$tmp.log" "$root.log"
    mlog "root of Slurm $rel ($suite, slurmctld $got) built in $((SECONDS - t0)) s: $root"
}

case ${1:-} in
    build) cmd_build "${2:?release}" ;;
    path) root_dir "${2:?release}" ;;
    remove) umount_root "$(root_dir "${2:?release}")"; rm -rf --one-file-system "$(root_dir "$2")" ;;
    *) echo "usage: $0 build|path|remove RELEASE" >&2; exit 2 ;;
esac
