"""The Kubernetes watcher: pods, nodes and Kueue workloads as allocation and queue events.

The join needs the truth about who holds which GPU, so this package is the
one place gpusteward reads the Kubernetes API for it. Its modules follow the
data:

- :mod:`.reflector`: list+watch of one resource in a thread, with
  resourceVersion, bookmarks, 410 handling and relist diffs;
- :mod:`.translate`: API objects -> schema events (pure, emits only changes);
- :mod:`.watcher`: :class:`KubeWatcher`, which composes the reflectors and the
  translator on an asyncio loop and publishes;
- :mod:`.roster`: what the watcher's own topics last said of each object, read back at
  start to report what was deleted while no watcher ran;
- :mod:`.settings`: :class:`KubeWatchSettings`, shared by all of them.
"""

from gpusteward.collectors.kubernetes.settings import KubeWatchSettings
from gpusteward.collectors.kubernetes.watcher import KubeWatcher, api_client

__all__ = ["KubeWatchSettings", "KubeWatcher", "api_client"]
