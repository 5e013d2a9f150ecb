#!/usr/bin/env bash
# linksim.sh: run benchmarks/onebit_allreduce.py with one rank per network namespace, each rank
# behind a rate-limited link, to emulate a multi-host network on one machine.
#
# Layout (all of it in namespaces of its own; the host's interfaces, routes and qdiscs are not
# touched):
#
#   namespace <prefix>-br:  bridge "br0", with one veth port "p<i>" per rank
#   namespace <prefix>-r<i>: loopback and "eth0" (the other end of "p<i>"), address
#                            <subnet>.<i+1>/24; rank i of the benchmark runs here
#
# <prefix> is "lsim-<pid of this script>", so a leftover from a killed run never blocks a new one;
# `linksim.sh --cleanup` removes every "lsim-*" namespace (and ends the processes inside them).
#
# Shaping: a tbf qdisc at --rate on *both* ends of every veth pair, i.e. the egress of the rank's
# eth0 (rank -> switch) and of the bridge's port p<i> (switch -> rank), so each rank's link is
# limited in both directions, as a host's NIC on a non-blocking switch. tbf parameters:
#   burst   = max(128 KiB, 1 ms at --rate)  (1gbit: 128 KiB; 10gbit: 1.25 MB; 25gbit: 3.1 MB):
#             at least one 64 KiB GSO segment, so tbf never has to split the large segments veth
#             passes, and large enough that timer granularity does not cap high rates;
#   latency = 10 ms                         (the queue: rate x 10 ms + burst bytes).
# veth moves bytes with the CPU: on a small machine (2 cores here) the link cannot go much beyond
# what the cores copy, roughly 10 Gbit/s or less, and the ranks compete with it for the cores. The
# benchmark's first line, the link check (a timed gloo round trip between ranks 0 and 1), shows the
# rate the link actually carried.
#
# --delay adds a netem delay on each rank's own egress (so one way between two ranks carries it
# once, a round trip twice), only where the kernel has the netem qdisc (probed first; skipped with a
# note otherwise).

set -euo pipefail

PREFIX_BASE=lsim
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat <<'EOF'
Usage: benchmarks/linksim.sh [--rate RATE] [--ranks N] [--delay TIME] [--port P] [--] [BENCHMARK ARGS...]
       benchmarks/linksim.sh --cleanup
       benchmarks/linksim.sh --help

Runs benchmarks/onebit_allreduce.py with one rank per network namespace, every rank's link
shaped to RATE in both directions (tc tbf), the ranks joined by a bridge in a namespace of its own.
Needs root (EUID 0; no sudo is used) and the `ip` and `tc` commands.

Options:
  --rate RATE    each rank's link rate, in tc's syntax: 1gbit, 10gbit, 25gbit, 500mbit ... (default: 1gbit)
  --ranks N      ranks, one namespace each (default: 2)
  --delay TIME   extra one-way latency per rank link, e.g. 0.1ms (only with the netem qdisc; skipped
                 with a note where the kernel lacks it)
  --port P       rank 0's port for the process group (default: 29500; namespaces have their own ports)
  --cleanup      remove every namespace left by earlier runs (prefix "lsim-"), ending processes in
                 them, and exit; this also removes a concurrently running harness's namespaces
  -h, --help     this text

Everything else (or everything after "--") goes to the benchmark, e.g.
  benchmarks/linksim.sh --rate 1gbit -- --values-millions 2 --iters 5 --ddp-millions 2
The Python is $PYTHON, else .venv/bin/python in the repository, else python3. Each rank runs
with OMP_NUM_THREADS=1. Rank 0's output is shown; the other ranks' only if they fail.
Exit status: rank 0's, or a failing rank's if the others had to be stopped because of it.
EOF
}

die() {
    echo "linksim.sh: $*" >&2
    exit 2
}

# ------------------------------------------------------------------------------ arguments

rate=1gbit
ranks=2
delay=
port=29500
cleanup_only=0
bench_args=()
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --rate) rate=${2:?--rate needs a value}; shift 2 ;;
        --rate=*) rate=${1#*=}; shift ;;
        --ranks) ranks=${2:?--ranks needs a value}; shift 2 ;;
        --ranks=*) ranks=${1#*=}; shift ;;
        --delay) delay=${2:?--delay needs a value}; shift 2 ;;
        --delay=*) delay=${1#*=}; shift ;;
        --port) port=${2:?--port needs a value}; shift 2 ;;
        --port=*) port=${1#*=}; shift ;;
        --cleanup) cleanup_only=1; shift ;;
        --) shift; bench_args+=("$@"); break ;;
        *) bench_args+=("$1"); shift ;;
    esac
done

[[ $ranks =~ ^[0-9]+$ ]] && ((ranks >= 2 && ranks <= 250)) || die "--ranks must be 2..250, got '$ranks'"
[[ $port =~ ^[0-9]+$ ]] && ((port >= 1 && port <= 65535)) || die "--port must be 1..65535, got '$port'"
for a in "${bench_args[@]}"; do
    case $a in
        --rank | --rank=* | --world | --world=* | --world-size | --world-size=* | --master-addr* | \
            --master-port* | --ifname*)
            die "$a is set by the harness (one rank per namespace); leave it out" ;;
    esac
done

# tc rate -> bytes per second (tc's units: bit/kbit/mbit/gbit/tbit, their IEC forms kibit...,
# bps/kbps/... in bytes, a bare number in bit/s).
rate_bytes() {
    local r=${1,,} num unit mult
    [[ $r =~ ^([0-9]+)([a-z]*)$ ]] || return 1
    num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
    case $unit in
        "" | bit) mult=1 ;;
        kbit) mult=1000 ;; mbit) mult=1000000 ;; gbit) mult=1000000000 ;; tbit) mult=1000000000000 ;;
        kibit) mult=1024 ;; mibit) mult=1048576 ;; gibit) mult=1073741824 ;; tibit) mult=1099511627776 ;;
        bps) mult=8 ;; kbps) mult=8000 ;; mbps) mult=8000000 ;; gbps) mult=8000000000 ;;
        tbps) mult=8000000000000 ;;
        *) return 1 ;;
    esac
    echo $((num * mult / 8))
}
rate_Bps=$(rate_bytes "$rate") || die "--rate '$rate' is not a tc rate (e.g. 1gbit, 10gbit, 500mbit)"
((rate_Bps > 0)) || die "--rate must be positive"
[[ -z $delay || ${delay,,} =~ ^[0-9]+(\.[0-9]+)?(s|ms|us|usec|msec|sec)$ ]] ||
    die "--delay '$delay' is not a tc time (e.g. 0.1ms, 50us)"

# ------------------------------------------------------------------------------ checks

if [[ $EUID -ne 0 ]]; then
    die "needs root (EUID 0, this is EUID $EUID) to create network namespaces and qdiscs; run it as root, e.g. in a root shell or a privileged container (the script itself never calls sudo)"
fi
for cmd in ip tc; do
    command -v "$cmd" >/dev/null || die "needs the '$cmd' command (iproute2); install iproute2 and retry"
done

# ------------------------------------------------------------------------------ teardown

ns_list() { # every namespace whose name starts with $1
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$1" || true
}

remove_ns() { # end the processes inside namespace $1, then delete it (its veths go with it)
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [[ -n $pids ]]; then
        kill -TERM $pids 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [[ -z $pids ]] && break
            sleep 0.3
        done
        [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || true
}

if ((cleanup_only)); then
    left=$(ns_list "$PREFIX_BASE-")
    if [[ -z $left ]]; then
        echo "linksim.sh: no leftover namespaces (prefix $PREFIX_BASE-)"
        exit 0
    fi
    for ns in $left; do
        remove_ns "$ns"
        echo "linksim.sh: removed namespace $ns"
    done
    exit 0
fi

PREFIX="$PREFIX_BASE-$$"
BR="$PREFIX-br"
pids=()
workdir=
teardown() {
    local rc=$?
    trap - EXIT INT TERM
    for p in "${pids[@]}"; do
        kill -TERM "$p" 2>/dev/null || true
    done
    for ns in $(ns_list "$PREFIX-"); do
        remove_ns "$ns"
    done
    [[ -n $workdir ]] && rm -rf "$workdir"
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ------------------------------------------------------------------------------ subnet

# A private /24 that overlaps no route and no address of the host (all tables): 10.213.X.0/24
# for the first free X. The namespaces are isolated, so this only keeps the addresses unambiguous.
ip2int() {
    local IFS=. a b c d
    read -r a b c d <<<"$1"
    echo $(((a << 24) | (b << 16) | (c << 8) | d))
}
taken=()
while read -r dst; do
    case $dst in
        default | "") continue ;;
        */*) taken+=("$dst") ;;
        *.*.*.*) taken+=("$dst/32") ;;
    esac
done < <({ ip -4 route show table all | awk '{ if ($1 ~ /^(local|broadcast|unicast|anycast|multicast|blackhole|unreachable|prohibit|throw|nat)$/) print $2; else print $1 }'; ip -4 -o addr show | awk '{print $4}'; } 2>/dev/null)
overlaps() { # does 10.213.$1.0/24 overlap any taken prefix?
    local net=$(((10 << 24) | (213 << 16) | ($1 << 8))) p addr len mask
    for p in "${taken[@]}"; do
        addr=$(ip2int "${p%/*}") len=${p#*/}
        ((len > 24)) && mask=24 || mask=$len # compare on the shorter prefix
        local m=$(((0xFFFFFFFF << (32 - mask)) & 0xFFFFFFFF))
        (((addr & m) == (net & m))) && return 0
    done
    return 1
}
octet=
for x in $(seq 0 255); do
    if ! overlaps "$x"; then
        octet=$x
        break
    fi
done
[[ -n $octet ]] || die "no free 10.213.X.0/24 subnet: every one overlaps a host route or address"
SUBNET="10.213.$octet"

# ------------------------------------------------------------------------------ network

burst=$((rate_Bps / 1000))
((burst < 131072)) && burst=131072
tbf=(tbf rate "$rate" burst "$burst" latency 10ms)

netem=0
if [[ -n $delay ]]; then
    probe="$PREFIX-probe"
    ip netns add "$probe"
    if ip -n "$probe" link set lo up && ip netns exec "$probe" tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
        netem=1
    else
        echo "linksim.sh: the kernel has no netem qdisc (sch_netem): --delay $delay is skipped, links are rate-limited only" >&2
    fi
    ip netns del "$probe"
fi

fail_setup() {
    die "setting up the namespaces failed at: $*"
}
run() { "$@" || fail_setup "$*"; }

run ip netns add "$BR"
run ip -n "$BR" link set lo up
run ip -n "$BR" link add br0 type bridge
run ip -n "$BR" link set br0 up
for ((i = 0; i < ranks; i++)); do
    ns="$PREFIX-r$i"
    run ip netns add "$ns"
    run ip -n "$ns" link set lo up
    run ip -n "$BR" link add "p$i" type veth peer name eth0 netns "$ns"
    run ip -n "$BR" link set "p$i" master br0
    run ip -n "$BR" link set "p$i" up
    run ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    run ip -n "$ns" link set eth0 up
    run ip netns exec "$BR" tc qdisc add dev "p$i" root "${tbf[@]}"
    if ((netem)); then
        run ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem delay "$delay"
        run ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: "${tbf[@]}"
    else
        run ip netns exec "$ns" tc qdisc add dev eth0 root "${tbf[@]}"
    fi
done
MASTER="$SUBNET.1"

PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || die "no Python '$PY' (set PYTHON)"

# Connectivity: every rank reaches rank 0 (ping where there is one, else a TCP connection).
if command -v ping >/dev/null; then
    for ((i = 1; i < ranks; i++)); do
        ip netns exec "$PREFIX-r$i" ping -c 1 -W 2 "$MASTER" >/dev/null ||
            die "rank $i's namespace cannot reach rank 0 at $MASTER (ping)"
    done
    check="ping"
else
    probe_port=$((port == 65535 ? port - 1 : port + 1))
    ip netns exec "$PREFIX-r0" "$PY" -c "
import socket, sys
s = socket.create_server(('$MASTER', $probe_port)); s.settimeout(10)
for _ in range($ranks - 1): s.accept()[0].close()
" &
    server=$!
    ok=1
    for ((i = 1; i < ranks; i++)); do
        ip netns exec "$PREFIX-r$i" "$PY" -c "
import socket, time
for _ in range(50):
    try:
        socket.create_connection(('$MASTER', $probe_port), timeout=2).close(); break
    except OSError: time.sleep(0.1)
else: raise SystemExit(1)
" || ok=0
    done
    wait "$server" || ok=0
    ((ok)) || die "the ranks' namespaces cannot reach rank 0 at $MASTER:$probe_port (TCP probe)"
    check="TCP probe (no ping here)"
fi

shaping="tbf rate $rate burst $burst latency 10ms on both ends of each rank's veth"
((netem)) && shaping+=", netem delay $delay on each rank's egress"
echo "linksim.sh: $ranks ranks in namespaces $PREFIX-r{0..$((ranks - 1))} on $SUBNET.0/24 behind bridge namespace $BR; $shaping; connectivity checked ($check)"

# ------------------------------------------------------------------------------ the ranks

workdir=$(mktemp -d)
for ((i = 0; i < ranks; i++)); do
    cmd=(ip netns exec "$PREFIX-r$i" env OMP_NUM_THREADS=1 "$PY" "$ROOT/benchmarks/onebit_allreduce.py"
        --rank "$i" --world-size "$ranks" --master-addr "$MASTER" --master-port "$port"
        --ifname eth0 "${bench_args[@]}")
    if ((i == 0)); then
        "${cmd[@]}" &
    else
        "${cmd[@]}" >"$workdir/rank$i.log" 2>&1 &
    fi
    pids+=($!)
done

# Wait for all; if a rank fails, stop the others (they would wait for it until their timeout).
rc0=
failed=
failed_rc=1
while :; do
    running=0
    for ((i = 0; i < ranks; i++)); do
        p=${pids[i]}
        [[ $p == done ]] && continue
        if kill -0 "$p" 2>/dev/null; then
            running=1
            continue
        fi
        rc=0
        wait "$p" || rc=$?
        pids[i]=done
        ((i == 0)) && rc0=$rc
        if ((rc != 0)) && [[ -z $failed ]]; then
            failed=$i
            failed_rc=$rc
            echo "linksim.sh: rank $i exited with status $rc" >&2
            if ((i > 0)); then
                echo "--- rank $i's output:" >&2
                tail -n 40 "$workdir/rank$i.log" >&2 || true
            fi
            for q in "${pids[@]}"; do
                [[ $q != done ]] && kill -TERM "$q" 2>/dev/null || true
            done
        fi
    done
    ((running)) || break
    sleep 0.2
done
pids=()
[[ -n $failed && $failed != 0 ]] && exit "$failed_rc"
exit "${rc0:-1}"
