#!/bin/sh
# Entry point of the cluster image: optionally shape this container's outgoing link with tc,
# then run the command unchanged (the same `python -m horovod_dgc.cluster ...` as the netns
# cluster).
#   LINK_RATE   e.g. 100mbit or 1gbit; unset or empty: no shaping
#   LINK_DELAY  optional one-way delay per packet, e.g. 1ms (needs the kernel's sch_netem)
# Shaping needs the NET_ADMIN capability (cap_add in docker-compose.yml).
set -eu
iface="${HOROVOD_DGC_IFACE:-eth0}"
if [ -n "${LINK_RATE:-}" ]; then
    if [ -n "${LINK_DELAY:-}" ]; then
        qdisc="netem rate $LINK_RATE delay $LINK_DELAY limit 100000"
    else
        # A token bucket: the rate alone, without netem (not every kernel has it).
        qdisc="tbf rate $LINK_RATE burst 512kb latency 100ms"
    fi
    # shellcheck disable=SC2086 # $qdisc is a list of tc words
    if ! tc qdisc replace dev "$iface" root $qdisc; then
        echo "shape_link: could not shape $iface with '$qdisc' (is cap_add: [NET_ADMIN] set?)" >&2
        exit 1
    fi
    echo "shape_link: $iface shaped with '$qdisc'" >&2
fi
exec "$@"
