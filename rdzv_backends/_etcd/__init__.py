"""What the etcd v2 and v3 backends share (settings, tls, budget, endpoints, errors, plugin); no client imports."""
