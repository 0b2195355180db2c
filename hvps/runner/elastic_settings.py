"""hvpsrun's elastic flags (``--min-np``, ``--max-np``, ``--host-discovery-script``, ...), checked against
each other and against ``-H`` before anything starts; the elastic driver (:mod:`hvps.runner.elastic_run`)
reads them from the job's plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from . import hosts as hostlib
from .errors import LaunchError
from .settings import LaunchSettings


@dataclass(frozen=True)
class ElasticSettings:
    """The elastic flags, as the job process reads them from the plan."""

    min_np: int
    max_np: Optional[int]
    discovery_script: Optional[str]
    slots_per_host: Optional[int]
    elastic_timeout: float
    reset_limit: Optional[int]
    cooldown: Optional[tuple]
    discovery_interval: float
    #: resets in a row without a completed commit before a worker's loop, and so the job, gives up
    resets_without_commit: int = 8


def elastic_settings(settings: LaunchSettings, hosts: Sequence[hostlib.Host]) -> ElasticSettings:
    """Check the elastic flags against each other and against ``-H``; LaunchError names the flag."""
    min_np = settings.min_np or settings.num_proc or 1
    max_np = settings.max_np
    if max_np is not None and min_np > max_np:
        raise LaunchError(f"--min-np {min_np} is greater than --max-np {max_np}: give --min-np <= --max-np")
    if settings.num_proc is not None and max_np is not None and settings.num_proc > max_np:
        raise LaunchError(f"-np {settings.num_proc} is greater than --max-np {max_np}")
    if settings.host_discovery_script is None:
        if not hosts:
            raise LaunchError("elastic mode needs hosts: give --host-discovery-script SCRIPT (or -H/--hostfile for "
                              "fault tolerance without scaling)")
        total = sum(h.slots for h in hosts)
        if min_np > total:
            raise LaunchError(f"--min-np {min_np} is greater than the {total} slots -H/--hostfile offers: lower "
                              "--min-np or add hosts")
    else:
        if hosts:
            raise LaunchError("give either --host-discovery-script or -H/--hostfile, not both")
        if not os.access(settings.host_discovery_script, os.X_OK):
            raise LaunchError(f"--host-discovery-script {settings.host_discovery_script}: not an executable file "
                              "(chmod +x it; it prints lines 'host:slots')")
    return ElasticSettings(min_np, max_np, settings.host_discovery_script, settings.slots_per_host,
                           settings.elastic_timeout, settings.reset_limit, settings.blacklist_cooldown_range,
                           settings.discovery_interval, settings.resets_without_commit)
