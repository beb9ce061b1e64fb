"""What the agent tells others: a person on the console (:mod:`.console`), torch elastic's error files
(:mod:`.error_files`), torch elastic's events and metrics (:mod:`.torch_events`) and Prometheus
(:mod:`.prometheus_metrics`, ``--metrics-port``)."""
