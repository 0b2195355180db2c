#!/usr/bin/env bash
# An emulated cluster on one machine: N "hosts" that are network namespaces, each with
# its own hostname (UTS namespace, set by the rsh agent), joined by veth pairs through
# a bridge, addresses from the benchmarking range 198.18.0.0/15, and a per-host egress
# rate (tc tbf) and delay (tc netem, when the kernel has it).
#
#   jobs/testbed/netns-cluster.sh up      # create (replaces a cluster with the same prefix)
#   jobs/testbed/netns-cluster.sh down    # remove everything 'up' created
#   jobs/testbed/netns-cluster.sh status  # show hosts, addresses and qdiscs
#   jobs/testbed/netns-cluster.sh set-rate RATE   # change every host's rate (e.g. 100mbit)
#
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2. After 'up', $TB_STATE holds:
#   hostfile     lines '<ip> slots=<TB_SLOTS>' for mpirun/hvpsrun --hostfile
#   hosts        lines '<ip> <netns> <hostname>'
#   rsh-agent    Open MPI's plm_rsh_agent: 'rsh-agent <ip|hostname> <command...>' runs the
#                command inside that host's namespace, in a fresh UTS namespace named
#                after the host
#   mpirun-args  the Open MPI flags for this cluster (agent, TCP only, the bridge subnet)
# Launch, e.g.:
#   mpirun -np 2 --hostfile "$TB_STATE/hostfile" $(cat "$TB_STATE/mpirun-args") python app.py
#   hvpsrun -np 2 --hostfile "$TB_STATE/hostfile" --mpi-args="$(cat "$TB_STATE/mpirun-args")" python app.py
#
# Environment (defaults):
#   TB_HOSTS=2            number of hosts (1..50)
#   TB_PREFIX=hvtb        names: netns <prefix>-h<i>, bridge <prefix>-br, veth <prefix>-v<i> (<= 8 chars)
#   TB_SUBNET=198.18.0    /24 inside 198.18.0.0/15; host i is .<i+1>, the bridge (this machine) .254
#   TB_RATE=1gbit         per-host egress rate (tc tbf); 'none' for no limit
#   TB_BURST=             tbf burst; default rate/250 (4 ms of traffic), at least 32kb
#   TB_DELAY=0            per-host egress delay (tc netem), e.g. 1ms; '0' for none
#   TB_SLOTS=1            slots per host in the hostfile
#   TB_STATE=/run/hvps-testbed/<prefix>   where the hostfile, host map and agent go
# Traffic stays on the bridge: the namespaces have no route beyond TB_SUBNET.
set -euo pipefail

TB_HOSTS=${TB_HOSTS:-2}
TB_PREFIX=${TB_PREFIX:-hvtb}
TB_SUBNET=${TB_SUBNET:-198.18.0}
TB_RATE=${TB_RATE:-1gbit}
TB_BURST=${TB_BURST:-}
TB_DELAY=${TB_DELAY:-0}
TB_SLOTS=${TB_SLOTS:-1}
TB_STATE=${TB_STATE:-/run/hvps-testbed/$TB_PREFIX}
BRIDGE="$TB_PREFIX-br"

die() { echo "netns-cluster: $*" >&2; exit 2; }

check_args() {
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth, tc)"
    command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (apt-get install iproute2)"
    [[ "$TB_HOSTS" =~ ^[0-9]+$ ]] && [ "$TB_HOSTS" -ge 1 ] && [ "$TB_HOSTS" -le 50 ] || die "TB_HOSTS=$TB_HOSTS: give 1..50"
    [ "${#TB_PREFIX}" -le 8 ] || die "TB_PREFIX=$TB_PREFIX: at most 8 characters (interface names are <= 15)"
    [[ "$TB_SUBNET" =~ ^198\.(18|19)\.[0-9]+$ ]] || die "TB_SUBNET=$TB_SUBNET: use a /24 of 198.18.0.0/15, e.g. 198.18.0"
}

# Rate in bytes/s for a tc rate like 1gbit, 100mbit, 500kbit.
rate_bytes() {
    local r=${1,,} n unit
    n=${r%%[a-z]*}; unit=${r#"$n"}
    case $unit in
        gbit) echo $(( n * 125000000 ));; mbit) echo $(( n * 125000 ));; kbit) echo $(( n * 125 ));;
        bit|"") echo $(( n / 8 ));; *) die "TB_RATE=$1: write e.g. 1gbit, 100mbit";;
    esac
}

shape() {  # shape <netns> <rate>: netem delay (optional) with tbf under it, on eth0 egress
    local ns=$1 rate=$2 burst parent=root
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    if [ "$TB_DELAY" != 0 ]; then
        ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem delay "$TB_DELAY" 2>/dev/null \
            || die "TB_DELAY=$TB_DELAY: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); use TB_DELAY=0"
        parent="parent 1:1"
    fi
    [ "$rate" = none ] && return 0
    burst=$TB_BURST
    if [ -z "$burst" ]; then
        burst=$(( $(rate_bytes "$rate") / 250 )); [ "$burst" -ge 32768 ] || burst=32768
    fi
    # shellcheck disable=SC2086
    ip netns exec "$ns" tc qdisc add dev eth0 $parent handle 10: tbf rate "$rate" burst "$burst" latency 100ms
}

down() {
    local i
    for ((i = 0; i < 50; i++)); do
        ip link del "$TB_PREFIX-v$i" 2>/dev/null || true
        ip netns del "$TB_PREFIX-h$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$TB_STATE"
}

up() {
    check_args
    down
    mkdir -p "$TB_STATE"
    ip link add "$BRIDGE" type bridge
    ip addr add "$TB_SUBNET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    : > "$TB_STATE/hostfile"; : > "$TB_STATE/hosts"
    local i ns addr name
    for ((i = 0; i < TB_HOSTS; i++)); do
        ns="$TB_PREFIX-h$i"; addr="$TB_SUBNET.$((i + 1))"; name="$TB_PREFIX-node$i"
        ip netns add "$ns"
        ip link add "$TB_PREFIX-v$i" type veth peer name eth0 netns "$ns"
        ip link set "$TB_PREFIX-v$i" master "$BRIDGE"
        ip link set "$TB_PREFIX-v$i" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        shape "$ns" "$TB_RATE"
        echo "$addr slots=$TB_SLOTS" >> "$TB_STATE/hostfile"
        echo "$addr $ns $name" >> "$TB_STATE/hosts"
    done
    cat > "$TB_STATE/rsh-agent" <<AGENT
#!/bin/sh
# Open MPI plm_rsh_agent for the netns testbed: rsh-agent HOST COMMAND...
# Runs COMMAND (joined by spaces, as ssh does) with /bin/sh inside HOST's network
# namespace and a fresh UTS namespace whose hostname is the host's name.
host=\$1; shift
line=\$(awk -v h="\$host" '\$1 == h || \$3 == h { print; exit }' "$TB_STATE/hosts")
[ -n "\$line" ] || { echo "rsh-agent: unknown testbed host '\$host'" >&2; exit 255; }
set -- "\$@"
ns=\$(echo "\$line" | cut -d' ' -f2); name=\$(echo "\$line" | cut -d' ' -f3)
exec ip netns exec "\$ns" unshare --uts /bin/sh -c 'hostname "\$1" && exec /bin/sh -c "\$2"' rsh-agent "\$name" "\$*"
AGENT
    chmod +x "$TB_STATE/rsh-agent"
    echo "--mca plm_rsh_agent $TB_STATE/rsh-agent --mca btl tcp,self --mca btl_tcp_if_include $TB_SUBNET.0/24 --mca oob_tcp_if_include $TB_SUBNET.0/24" > "$TB_STATE/mpirun-args"
    echo "netns-cluster: $TB_HOSTS hosts up ($TB_SUBNET.1-$TB_HOSTS, rate $TB_RATE, delay $TB_DELAY); state in $TB_STATE"
}

set_rate() {
    local i
    for ((i = 0; i < TB_HOSTS; i++)); do shape "$TB_PREFIX-h$i" "$1"; done
}

status() {
    [ -f "$TB_STATE/hosts" ] || die "no cluster with prefix $TB_PREFIX (state $TB_STATE)"
    cat "$TB_STATE/hosts"
    local ns
    while read -r _ ns _; do echo "== $ns"; ip netns exec "$ns" tc qdisc show dev eth0; done < "$TB_STATE/hosts"
}

case "${1:-}" in
    up) up ;;
    down) down; echo "netns-cluster: $TB_PREFIX removed" ;;
    status) status ;;
    set-rate) [ -n "${2:-}" ] || die "set-rate RATE"; set_rate "$2" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac
