#!/bin/sh
# Host discovery for hvpsrun's elastic mode (examples/pytorch_elastic.py, examples/keras_elastic.py).
#
# hvpsrun runs this every --discovery-interval seconds; it prints the hosts the job may use, one
# "host:slots" per line. By default: this machine with 2 slots. With EXAMPLE_HOSTS_FILE set, the lines
# of that file: edit it while the job runs to add hosts (e.g. 127.0.0.1:1) or remove them.
#
#   hvpsrun -np 2 --min-np 1 --max-np 3 --host-discovery-script examples/discover_hosts.sh \
#       python examples/pytorch_elastic.py --epochs 3
if [ -n "$EXAMPLE_HOSTS_FILE" ]; then
    cat "$EXAMPLE_HOSTS_FILE"
else
    echo "localhost:2"
fi
