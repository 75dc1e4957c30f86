# shellcheck shell=bash
# What the kernel says of a process, for the dev cluster's and the dev stack's pid files (sourced by
# dev-cluster/processes.sh and dev-stack-daemons.sh).

# start_ticks PID: when the process started, in clock ticks after boot (field 22 of /proc/PID/stat);
# fails when no such process. It does not change when the process execs, unlike its environment
# or command line, and nothing the process or its caller sets moves it.
start_ticks() {
    local stat rest
    stat=$(cat "/proc/$1/stat" 2>/dev/null) && [[ -n $stat ]] || return 1
    rest=${stat##*) }  # after "pid (comm) ": field 3 on (comm may hold spaces and parentheses)
    local -a f
    read -r -a f <<<"$rest"
    echo "${f[19]}"
}
