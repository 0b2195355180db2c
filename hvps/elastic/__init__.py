"""Elastic training's framework-neutral front end, with Horovod's semantics (``horovod.common.elastic``).

- :class:`State` / :class:`ObjectState`: what a training loop commits, restores and syncs;
- :func:`run_fn`: the retry loop behind every adapter's ``hvd.elastic.run``;
- :func:`notify_hosts_updated`: where an elastic launcher's notice of added or removed hosts arrives;
- :func:`elastic_mode`: whether this job was started by an elastic launcher (``HVPS_ELASTIC=1``).

The adapters (``hvps.adapters.torch.elastic``, ``hvps.adapters.tensorflow.elastic``) build on it.
"""

from .loop import MAX_RESETS_WITHOUT_COMMIT, reset, run_fn
from .mode import elastic_mode, joins_a_running_job, refuse_torchrun_restarts, torchrun_restarts
from .notification import (
    HostsUpdatedInterrupt,
    HostUpdateResult,
    WorkerNotificationManager,
    notification_manager,
    notify_hosts_updated,
)
from .state import ObjectState, State

__all__ = [
    "State", "ObjectState", "run_fn", "reset", "MAX_RESETS_WITHOUT_COMMIT",
    "HostsUpdatedInterrupt", "HostUpdateResult", "WorkerNotificationManager", "notification_manager",
    "notify_hosts_updated", "elastic_mode", "joins_a_running_job", "torchrun_restarts", "refuse_torchrun_restarts",
]
