"""The identity-keyed memo and the cached collective time the cost model shares (cost.py,
stage_time.py, dp_traffic.py): a search passes the very same model and cluster objects
thousands of times."""

from __future__ import annotations

from phalanx.planner.hardware import Cluster


def by_identity(fn):
    """Memoise fn(obj, obj2, *args, **kwargs) keyed on the objects' identities and the rest.

    lru_cache would hash the frozen ModelConfig and Cluster on every call, which is most of
    a search's time; the search passes the very same objects thousands of times.
    """
    cache: dict = {}

    def wrapper(a, b, *args, **kwargs):
        key = (id(a), id(b), args, tuple(kwargs.items()))
        hit = cache.get(key)
        if hit is not None and hit[0] is a and hit[1] is b:
            return hit[2]
        if len(cache) > 500_000:
            cache.clear()
        value = fn(a, b, *args, **kwargs)
        cache[key] = (a, b, value)
        return value

    wrapper.__wrapped__ = fn
    wrapper.__doc__ = fn.__doc__
    return wrapper


@by_identity
def collective_time(fn, cluster: Cluster, nbytes: float, size: int, stride: int) -> float:
    return fn(cluster, nbytes, size=size, stride=stride)
