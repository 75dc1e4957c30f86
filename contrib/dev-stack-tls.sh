# shellcheck shell=bash
# The dev stack's TLS, sourced by dev-stack.sh: a private CA and the service's certificate for every
# name clients use (made with the openssl CLI, kept while valid), and the [tls] section of the
# config it writes (SWAPAWARE_DEV_TLS=0: none).

# The names clients use for the service: loopback, and the controller's bridge address where
# the nodes have their own network.
tls_san() {
    local san="IP:127.0.0.1,DNS:localhost"
    if multi_node; then san+=",IP:$(ctld_addr)"; fi
    local n
    for n in $(controllers); do san+=",IP:$(ctl_addr "$n")"; done
    echo "$san"
}

# A private CA and the service's certificate, signed by it, for every name in tls_san. Kept while
# they verify, cover those names and last another day; keys 0600, certificates readable by all
# (`swapaware explain` runs as the user). Made with the openssl CLI (cluster.sh install has it).
ensure_tls() {
    local san ok=1
    san=$(tls_san)
    command -v openssl >/dev/null || die "openssl not found (contrib/dev-cluster/cluster.sh install adds it)"
    mkdir -p "$TLSDIR"
    chmod 0755 "$TLSDIR"
    if [[ -f $TLSDIR/ca.pem && -f $TLSDIR/ca.key && -f $TLSDIR/server.pem && -f $TLSDIR/server.key ]] &&
        [[ $(cat "$TLSDIR/server.san" 2>/dev/null) == "$san" ]] &&
        openssl verify -CAfile "$TLSDIR/ca.pem" "$TLSDIR/server.pem" >/dev/null 2>&1 &&
        openssl x509 -checkend 86400 -noout -in "$TLSDIR/ca.pem" >/dev/null 2>&1 &&
        openssl x509 -checkend 86400 -noout -in "$TLSDIR/server.pem" >/dev/null 2>&1; then
        ok=0
    fi
    if ((ok != 0)); then
        log "making the dev CA and the service's certificate ($san) in $TLSDIR"
        rm -f "$TLSDIR"/ca.* "$TLSDIR"/server.*
        (
            umask 077
            cd "$TLSDIR"
            openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=swapaware-dev-ca \
                -keyout ca.key -out ca.pem
            openssl req -newkey rsa:2048 -nodes -subj "/CN=swapaware-dev-service" -keyout server.key -out server.csr
            printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san" >server.ext
            openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
                -extfile server.ext -out server.pem
            echo "$san" >server.san
            rm -f server.csr
        ) >/dev/null 2>"$TLSDIR/openssl.err" || die "openssl failed: $(cat "$TLSDIR/openssl.err")"
        rm -f "$TLSDIR/openssl.err"
    fi
    chmod 0600 "$TLSDIR/ca.key" "$TLSDIR/server.key"
    chmod 0644 "$TLSDIR/ca.pem" "$TLSDIR/server.pem"
}

tls_section() {
    if [[ $DEV_TLS == 1 ]]; then
        cat <<EOF
[tls]
# The service's certificate from the dev stack's private CA ($TLSDIR, contrib/dev-stack.sh
# ensure_tls); hooks, agents and the CLI check it against ca before they send anything.
cert = "$TLSDIR/server.pem"
key = "$TLSDIR/server.key"
ca = "$TLSDIR/ca.pem"
EOF
    else
        printf '# [tls] off: SWAPAWARE_DEV_TLS=0 (plaintext gRPC)\n'
    fi
}
