"""Jobs under a real Slurm started on this host (marker scheduler): the example batch script trains, is requeued, is
signalled (docs/schedulers.md)."""
