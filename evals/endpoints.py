"""A pool of M3 endpoints for one eval run: sticky per instance, least-loaded for new ones, failing ones out.

    pool = EndpointPool(["http://gpu-1:8000/v1", "http://gpu-2:8000/v1"])
    url = pool.acquire("django__django-11099")   # the endpoint with the fewest active sessions
    ...                                          # the whole instance talks to `url` (its prefix cache lives there)
    pool.release("django__django-11099")
    pool.fail(url)                               # it stopped answering: out, its instances go elsewhere

An instance keeps its endpoint across retries (a node that died, a rerun) as long as that endpoint is in
the pool, because the prompt prefix it already cached there makes the next request cheap.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from m3_agent.errors import EndpointError, UsageError


class EndpointPool:
    """Endpoints and their active sessions; safe to share between threads."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = list(dict.fromkeys(u.rstrip("/") for u in urls))  # order kept, duplicates dropped
        if not self.urls:
            raise UsageError("the endpoint pool is empty: pass --base-url at least once")
        self.active = {u: 0 for u in self.urls}
        self.failed: dict[str, str] = {}  # url -> why it was taken out
        self._sticky: dict[str, str] = {}  # instance id -> its endpoint
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def acquire(self, instance_id: str) -> str:
        """The endpoint `instance_id` runs against: its earlier one if still in, else the least loaded."""
        with self._lock:
            url = self._sticky.get(instance_id)
            if url is None or url in self.failed:
                live = [u for u in self.urls if u not in self.failed]
                if not live:
                    raise EndpointError("every endpoint of the pool failed: " + "; ".join(
                        f"{u} ({why})" for u, why in self.failed.items()))
                url = min(live, key=lambda u: self.active[u])  # ties: the first listed
                self._sticky[instance_id] = url
            if instance_id not in self._running:
                self._running.add(instance_id)
                self.active[url] += 1
            return url

    def release(self, instance_id: str) -> None:
        """The instance's session ended (finished, failed or cancelled); it stays sticky to its endpoint."""
        with self._lock:
            if instance_id in self._running:
                self._running.discard(instance_id)
                self.active[self._sticky[instance_id]] -= 1

    def fail(self, url: str, why: str = "stopped answering") -> None:
        """Take `url` out of the pool: its instances are placed elsewhere on their next acquire."""
        with self._lock:
            self.failed.setdefault(url.rstrip("/"), why)


def is_endpoint_failure(error: str | None) -> bool:
    """True when an instance's recorded error says its model endpoint failed (not the instance itself)."""
    return bool(error) and error.startswith("EndpointError:")
