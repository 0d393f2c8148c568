"""A small least-recently-used cache."""

from collections import OrderedDict


class LRUCache:
    """Keeps at most `capacity` entries, evicting the least recently used."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._data = OrderedDict()

    def get(self, key, default=None):
        """The value for key, or default."""
        if key not in self._data:
            return default
        return self._data[key]

    def put(self, key, value) -> None:
        """Store value under key, evicting the oldest entry when full."""
        if key in self._data:
            self._data.move_to_end(key)
        self._data[key] = value
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
