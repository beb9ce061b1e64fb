"""Hosts in network namespaces (marker multihost) and the membership scenarios (marker membership)."""
