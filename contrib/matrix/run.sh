#!/usr/bin/env bash
# Run a command against one Slurm release, in a network namespace of its own (Slurm's ports,
# 127.0.0.1 and the daemons belong to that namespace). The release the host's own packages give
# runs on the host's files; another runs inside that release's Debian root (contrib/matrix/
# root.sh), with a copy of this checkout in the root and a Python venv built there.
#
#   run.sh RELEASE [COMMAND...]      default COMMAND: bash contrib/run-tests.sh --integration-only
#   run.sh RELEASE --cleanup         remove the namespace and the mounts of RELEASE
#   run.sh RELEASE --prepare         only what a run does before its command: the root mounted, the
#                                    checkout copied in, the venv and the wheelhouse built (for lanes)
#
# Lanes (contrib/run-tests.sh runs two per release, so that the release's suites run side by side):
#   SWAPAWARE_MATRIX_LANE=NAME       a network namespace and run lock of its own (swa-<release>-NAME);
#                                    the root's copy, venv and wheelhouse are the ones --prepare made
#   SWAPAWARE_MATRIX_KEEP_ROOT=1     the run leaves the root mounted at its end (another lane may be
#                                    using it; run-tests.sh runs --cleanup once every lane ended)
#   SWAPAWARE_MATRIX_NODES="mn ha"   the suites' state directories whose compute nodes the run's end
#                                    may stop (default: all: swapaware-*-<release>)
#
# One run per release at a time: a run holds $MATRIX_STATE/<release>.lock (flock) until it has
# cleaned up, and a second run of that release (or --cleanup) while it holds it refuses, naming the
# holder, instead of overwriting the first run's copy of the checkout and ending its processes.
# The command itself runs without the lock's descriptor, so a daemon it leaves behind cannot hold
# the lock after the run has ended.
#
# Everything it starts lives under the root's /var/tmp and the namespace; the command's own
# cleanup (the tests stop their daemons by pid file) runs inside, and --cleanup runs at the end.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=releases.sh
source "$HERE/releases.sh"

REL=${1:?usage: run.sh RELEASE [COMMAND...]}
shift
release_ok "$REL" || mdie "unknown release $REL (supported: ${RELEASES[*]})"
ROOT=$(root_dir "$REL")
LANE=${SWAPAWARE_MATRIX_LANE:-}
[[ -z $LANE || $LANE =~ ^[a-z0-9]{1,8}$ ]] || mdie "SWAPAWARE_MATRIX_LANE must be 1-8 of a-z0-9, got '$LANE'"
NS=$(ns_name "$REL")${LANE:+-$LANE}
ON_HOST=0
[[ $REL == "$(host_release)" ]] && ON_HOST=1
SRC=/opt/swapaware/src      # inside the root
VENV=/opt/swapaware/venv    # inside the root

# Slurm >= 23 resolves its listen address with AI_ADDRCONFIG and dies when the namespace has
# only loopback: a veth pair with a link-local address that routes nowhere gives it one.
netns_up() {
    if ! ip netns list | grep -qw "$NS"; then
        ip netns add "$NS"
    fi
    in_ns ip link set lo up
    if ! in_ns ip link show v0 >/dev/null 2>&1; then
        in_ns ip link add v0 type veth peer name v1
        in_ns ip addr add 169.254.77.1/32 dev v0
        in_ns ip link set v0 up
        in_ns ip link set v1 up
    fi
}

# in_ns COMMAND...: COMMAND in the release's network namespace, nothing else changed (`ip -n` and
# `ip netns exec` also make a mount namespace and remount /sys, which hides the host's cgroups
# and fails where / is not a mount point).
in_ns() { nsenter --net="/run/netns/$NS" "$@"; }

netns_down() {
    ip netns list | grep -qw "$NS" || return 0
    # Anything still running in the namespace belongs to this run: end it first.
    local pids
    pids=$(ip netns pids "$NS" 2>/dev/null || true)
    if [[ -n $pids ]]; then
        mlog "ending processes left in $NS: $(echo $pids)"
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        local i
        for i in $(seq 1 50); do
            [[ -z $(ip netns pids "$NS" 2>/dev/null) ]] && break
            sleep 0.1
        done
        pids=$(ip netns pids "$NS" 2>/dev/null || true)
        # shellcheck disable=SC2086
        [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    fi
    ip netns delete "$NS"
}

# Compute nodes of a multi-node cluster (contrib/dev-cluster/nodes.sh) live in namespaces of their
# own, not in $NS: whatever the suite left running in them ends here too, found by the pid files of
# the nodes' namespace holders under this release's state directories (SWAPAWARE_MATRIX_NODES: those
# of these suites alone, e.g. "mn" or "ha", when another lane's suites may still run).
nodes_down() {
    local f pid want p kind
    for kind in ${SWAPAWARE_MATRIX_NODES:-all}; do
        [[ $kind =~ ^[a-z0-9]+$ ]] || continue
        [[ $kind == all ]] && kind='*'
        for f in "$1"/var/tmp/swapaware-$kind-"${REL//./}"/nodes/*.pid; do
            [[ -e $f ]] || continue
            pid=$(tr -dc '0-9' <"$f")
            want=$(readlink "/proc/$pid/ns/net" 2>/dev/null) || continue
            for p in /proc/[0-9]*; do
                [[ $(readlink "$p/ns/net" 2>/dev/null) == "$want" ]] && kill -KILL "${p#/proc/}" 2>/dev/null
            done
            mlog "ended the processes of node $(basename "$f" .pid) left by the suite"
        done
    done
    return 0
}

cleanup() {
    if ((ON_HOST)); then nodes_down ""; else nodes_down "$ROOT"; fi
    netns_down || true
    ((ON_HOST)) || [[ -n ${SWAPAWARE_MATRIX_KEEP_ROOT:-} ]] || umount_root "$ROOT" || true
}

in_root() {  # COMMAND...: in the root with the host's network (package registries)
    chroot "$ROOT" "${ROOT_ENV[@]}" "$@"
}

# The checkout's files: tracked and untracked-not-ignored ones in a git checkout, else every file
# but build outputs.
source_files() {
    if command -v git >/dev/null && git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
        git -C "$REPO" ls-files -z -co --exclude-standard
    else
        (cd "$REPO" && find . \( -name .git -o -name .venv -o -name __pycache__ -o -name _generated \
            -o -name '*.egg-info' \) -prune -o -type f -print0)
    fi
}

# copy_source DIR: the checkout's files (source_files) copied into DIR.
copy_source() {
    source_files | (cd "$REPO" && tar --null -T - -cf -) | tar -xf - -C "$1"
}

# A fresh copy of this checkout, then the venv: built once (kept while pyproject/setup.py/protos
# are unchanged), the package reinstalled each time (the stubs are generated at install).
sync_source() {
    rm -rf "${ROOT:?}$SRC"
    mkdir -p "$ROOT$SRC"
    copy_source "$ROOT$SRC"
    in_root env SWAPAWARE_VENV=$VENV bash "$SRC/contrib/dev-stack.sh" venv
    if [[ -f $ROOT$VENV/.swapaware-stamp && ! -d $ROOT$SRC/policy_service/_generated ]]; then
        in_root $VENV/bin/python -m pip install -q --no-deps -e "$SRC" >/dev/null
    fi
}

# The admin guide's build-host step for tests/install (the guide's install on a site of this
# release): swapaware's wheel and every dependency's, made here where the package registries are
# reachable (the namespace reaches none). PYTHON SOURCE WHEELHOUSE [PREFIX...]: PREFIX runs them
# (chroot into the root). Without registries the install test skips, and fails under CI.
build_wheelhouse() {
    local py=$1 src=$2 wh=$3
    shift 3
    "$@" rm -f "$wh"/swapaware-*.whl
    "$@" "$py" -m pip wheel -q -w "$wh" "$src" >/dev/null 2>"$MATRIX_STATE/wheelhouse-$REL.log" ||
        mlog "no wheelhouse for the install test (pip wheel failed: $MATRIX_STATE/wheelhouse-$REL.log)"
}

# The checkout's files alone in a fresh directory (setuptools' build/ of an earlier build in the
# checkout would go into the wheel with files since moved or removed).
fresh_copy() {
    local dir
    dir=$(mktemp -d)
    copy_source "$dir"
    echo "$dir"
}

[[ $(id -u) -eq 0 ]] || mdie "must run as root"
release_lock "$REL${LANE:+-$LANE}" "run.sh $REL${LANE:+ (lane $LANE)} $*"
if [[ ${1:-} == --cleanup ]]; then
    cleanup
    exit 0
fi
PREPARE_ONLY=0
if [[ ${1:-} == --prepare ]]; then
    [[ -z $LANE ]] || mdie "--prepare is the release's, not a lane's"
    PREPARE_ONLY=1
    shift
fi
(($#)) || set -- bash contrib/run-tests.sh --integration-only
# prepare: unless a lane runs on what --prepare made
prepare=1
[[ -z $LANE ]] || prepare=0
((PREPARE_ONLY)) || trap cleanup EXIT
if ((ON_HOST)); then
    # The namespace reaches no package registry: the checkout's venv is built (or found current)
    # here first, as sync_source does for a release's root.
    HOST_VENV=${SWAPAWARE_VENV:-$REPO/.venv}
    if ((prepare)); then
        SWAPAWARE_VENV=$HOST_VENV bash "$REPO/contrib/dev-stack.sh" venv >/dev/null ||
            mdie "the venv $HOST_VENV could not be built (it needs the package registries, before the namespace)"
        copy=$(fresh_copy)
        build_wheelhouse "$HOST_VENV/bin/python" "$copy" "$REPO/build/wheelhouse"
        rm -rf "$copy"
    fi
    ((PREPARE_ONLY)) && exit 0
    netns_up
    mlog "Slurm $REL: $(dpkg-query -W -f='${Version}' slurmctld 2>/dev/null || echo 'not installed') on the host, namespace $NS"
    in_ns env SWAPAWARE_VENV="$HOST_VENV" SWAPAWARE_WHEELHOUSE="$REPO/build/wheelhouse" CI="${CI:-}" \
        SWAPAWARE_RELEASE="$REL" SWAPAWARE_SUITES="${SWAPAWARE_SUITES:-}" bash -c 'cd "$0" && exec "$@"' "$REPO" "$@" 9>&-
    exit $?
fi
[[ -f $ROOT/.swapaware-root ]] || mdie "no root for $REL: run contrib/matrix/root.sh build $REL"
ensure_hosts "$ROOT"
mount_root "$ROOT"
if ((prepare)); then
    # A root built before ROOT_PACKAGES grew gets the new packages (root.sh build does the same).
    if [[ $(cat "$ROOT/.swapaware-root") != "$(stamp_text "$REL")" ]] &&
        grep -qx "suite=${SUITE_OF[$REL]}" "$ROOT/.swapaware-root"; then
        root_add_packages "$ROOT" "$REL"
    fi
    sync_source
    build_wheelhouse $VENV/bin/python "$SRC" /var/cache/swapaware-wheelhouse in_root
fi
((PREPARE_ONLY)) && exit 0
netns_up
mlog "Slurm $REL: $(chroot "$ROOT" dpkg-query -W -f='${Version}' slurmctld) in $ROOT, namespace $NS"
in_ns chroot "$ROOT" "${ROOT_ENV[@]}" SWAPAWARE_VENV=$VENV SWAPAWARE_WHEELHOUSE=/var/cache/swapaware-wheelhouse CI="${CI:-}" SWAPAWARE_RELEASE="$REL" SWAPAWARE_SUITES="${SWAPAWARE_SUITES:-}" bash -c 'cd "$0" && exec "$@"' "$SRC" "$@" 9>&-
