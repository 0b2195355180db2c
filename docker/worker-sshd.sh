#!/bin/sh
# hvps-worker-sshd: the worker side of a multi-container job. Runs sshd as the current
# (non-root) user on port ${HVPS_SSH_PORT:-2222}, so that mpirun in the launcher container
# can start its daemons here; key material comes from ${HVPS_SSH_DIR:-/etc/hvps-ssh}.
#   hvps-worker-sshd keygen   write a client key, authorized_keys, one host key shared by
#                             all workers and a known_hosts naming it (compose's 'keys' service)
#   hvps-worker-sshd          wait for the keys, then run sshd in the foreground
# Without a host key in the directory (e.g. under Kubernetes, where the MPI Operator mounts
# only the client key and authorized_keys at ~/.ssh) it makes one in a private temp dir.
set -eu
dir=${HVPS_SSH_DIR:-/etc/hvps-ssh}
port=${HVPS_SSH_PORT:-2222}
if [ "${1:-}" = keygen ]; then
    umask 077
    [ -f "$dir/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hvps-job -f "$dir/id_ed25519"
    [ -f "$dir/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hvps-host -f "$dir/host_ed25519"
    cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
    echo "* $(cut -d' ' -f1,2 "$dir/host_ed25519.pub")" > "$dir/known_hosts"
    chmod 644 "$dir/known_hosts"
    echo "hvps-worker-sshd: keys ready in $dir"
    exit 0
fi
auth=$dir/authorized_keys
[ -f "$auth" ] || auth=$HOME/.ssh/authorized_keys
for _ in $(seq 60); do [ -f "$auth" ] && break; sleep 1; done
[ -f "$auth" ] || { echo "hvps-worker-sshd: no authorized_keys in $dir or ~/.ssh after 60 s" >&2; exit 1; }
hostkey=$dir/host_ed25519
if [ ! -f "$hostkey" ]; then
    tmp=$(mktemp -d)
    ssh-keygen -q -t ed25519 -N '' -f "$tmp/host_ed25519"
    hostkey=$tmp/host_ed25519
fi
# SetEnv: the ssh sessions mpirun opens get the image's PATH (prted lives in /opt/hvps/bin).
exec /usr/sbin/sshd -D -e -f /dev/null -p "$port" -h "$hostkey" \
    -o AuthorizedKeysFile="$auth" -o PidFile=none -o StrictModes=no -o UsePAM=no \
    -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no -o PermitRootLogin=no \
    -o SetEnv="PATH=${PATH} HOME=${HOME}"
