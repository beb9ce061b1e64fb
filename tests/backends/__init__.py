"""The backends one by one (memory, file, Redis, Sentinel, etcd), bad input, outages, network faults, the proxy, the
fault matrix."""
