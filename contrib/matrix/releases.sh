# Sourced by contrib/matrix/*.sh: the supported Slurm releases and the Debian suite that ships each.
# shellcheck shell=bash
# release -> Debian suite whose slurmctld package is that release
declare -A SUITE_OF=([22.05]=bookworm [24.11]=trixie [26.05]=sid)
RELEASES=(22.05 24.11 26.05)
MATRIX_CACHE=${SWAPAWARE_MATRIX_CACHE:-/var/cache/swapaware-matrix}
MATRIX_STATE=${SWAPAWARE_MATRIX_STATE:-/var/tmp/swapaware-matrix}
DEBIAN_MIRROR=${SWAPAWARE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Everything the tests need inside a release's root (its own Slurm, MariaDB, munge, Lua, Python).
ROOT_PACKAGES=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server mariadb-client
               lua5.1 lua-socket lua-cjson lua-posix python3 python3-venv python3-pip procps iproute2
               hostname util-linux ca-certificates perl)

# The stamp names what a root was built with (root.sh): a root of another suite or format is
# rebuilt; one that only lacks packages of ROOT_PACKAGES gets them (root_add_packages).
stamp_text() { printf 'suite=%s\npackages=%s\nformat=1\n' "${SUITE_OF[$1]}" "${ROOT_PACKAGES[*]}"; }

# root_add_packages ROOT RELEASE: install the packages of ROOT_PACKAGES that ROOT lacks (a list that
# grew since the root was built) with the host's network, then stamp it. ROOT is mounted
# (mount_root) and no run of RELEASE uses it but the caller.
root_add_packages() {
    local root=$1 rel=$2 missing=() p st
    for p in "${ROOT_PACKAGES[@]}"; do
        st=$(chroot "$root" dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
        [[ $st == installed ]] || missing+=("$p")
    done
    if ((${#missing[@]})); then
        mlog "adding ${missing[*]} to the root of Slurm $rel ($root)"
        chroot "$root" "${ROOT_ENV[@]}" DEBIAN_FRONTEND=noninteractive sh -c "apt-get update -qq && \
            apt-get install -y -qq --no-install-recommends ${missing[*]} >/dev/null && apt-get clean" >&2 ||
            mdie "cannot install ${missing[*]} in the root of Slurm $rel"
    fi
    stamp_text "$rel" >"$root/.swapaware-root"
}

# The environment a command inside a root starts with (nothing of the caller's leaks in):
#   chroot "$root" "${ROOT_ENV[@]}" [VAR=value...] COMMAND...
ROOT_ENV=(/usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8)

mlog() { printf '[matrix] %s\n' "$*" >&2; }
mdie() { printf '[matrix] ERROR: %s\n' "$*" >&2; exit 1; }

# host_suite: the Debian suite of this machine (bookworm, trixie, ...), from /etc/os-release.
host_suite() {
    local v
    v=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
    [[ -n $v ]] || v=$(sed -n 's/^\([a-z]*\)\/sid$/\1/p' /etc/debian_version)
    echo "${v:-unknown}"
}

# host_release: the supported release the host's own packages give (empty when none).
host_release() {
    local suite r
    suite=$(host_suite)
    for r in "${RELEASES[@]}"; do
        [[ ${SUITE_OF[$r]} == "$suite" ]] && { echo "$r"; return 0; }
    done
    echo ""
}

# release_lock RELEASE WHAT: take RELEASE's run lock on fd 9 (flock on
# $MATRIX_STATE/swa-<release>.lock, held until this shell exits), or refuse naming the holder.
# Commands the holder starts should run with 9>&- so that nothing they leave running keeps it.
release_lock() {
    mkdir -p "$MATRIX_STATE"
    local lock
    lock=$MATRIX_STATE/$(ns_name "$1").lock
    exec 9<>"$lock"
    if ! flock -n 9; then
        mdie "Slurm $1: another run of this release is in progress ($(tr -d '\0' <"$lock" | head -c 200)); \
wait for it to end, or end it, before starting another (lock: $lock)"
    fi
    printf 'pid %s since %s: %s\n' "$$" "$(date -u +%FT%TZ)" "$2" >"$lock"
}

release_ok() { [[ -n ${SUITE_OF[$1]:-} ]]; }
root_dir() { echo "$MATRIX_CACHE/roots/${SUITE_OF[$1]}"; }
ns_name() { echo "swa-${1//./}"; }

# mount_root ROOT / umount_root ROOT: the kernel file systems a Debian root needs to run daemons.
mount_root() {
    local root=$1
    # The root is a mount point of its own (a private bind mount of itself): inside the chroot, "/"
    # is then a mount, so that a multi-node cluster's nodes can have mount namespaces of their own
    # (unshare --propagation private needs "/" to be a mount point) without their mounts reaching
    # the host's.
    if ! mountpoint -q "$root"; then
        : >"$root/.swapaware-bound"
        mount --bind "$root" "$root"
        mount --make-private "$root"
    fi
    mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
    mountpoint -q "$root/sys" || mount -t sysfs sysfs "$root/sys"
    if ! mountpoint -q "$root/dev"; then
        mount --rbind /dev "$root/dev"
        mount --make-rslave "$root/dev"
    fi
}

umount_root() {
    local root=$1 m
    for m in dev sys proc; do
        if mountpoint -q "$root/$m"; then umount -R "$root/$m" 2>/dev/null || umount -lR "$root/$m"; fi
    done
    if [[ -e $root/.swapaware-bound ]] && mountpoint -q "$root"; then
        umount "$root" 2>/dev/null || umount -l "$root"
        rm -f "$root/.swapaware-bound"
    fi
}

# ensure_hosts ROOT: a root that debootstrap made on another suite may have no /etc/hosts (bookworm
# built on trixie had none), and MariaDB 10.11's install script then refuses to run ("Neither host
# ... nor 'localhost' could be looked up").
ensure_hosts() {
    local root=$1
    grep -qsw localhost "$root/etc/hosts" && return 0
    printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >>"$root/etc/hosts"
}
