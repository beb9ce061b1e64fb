"""The scheduler tests' fixtures: ``slurm``, a real Slurm cluster on this host (:mod:`tests.support.slurm_cluster`)."""

from __future__ import annotations

from tests.support.slurm_cluster import slurm  # noqa: F401  (fixture)
