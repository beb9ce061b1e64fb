"""Side-by-side benchmark of rdzv's backends against PyTorch's own rendezvous.

Not part of the library or of the test suite (``tests/project/test_benchmark_smoke.py``
only runs the smoke mode). Run from the project root::

    python -m benchmarks.run            # full run (~15 minutes here), writes docs/benchmarks.{json,png,md}
    python -m benchmarks.run --quick    # fewer sizes and repetitions
    python -m benchmarks.run --smoke    # N = 8, one repetition, c10d baseline only (< 60 s)

Modules, one idea each:

* :mod:`benchmarks.counting` — :class:`~benchmarks.counting.CountingKV`, a
  ``KVBackend`` proxy that counts every public operation and its conflicts;
* :mod:`benchmarks.servers` — etcd, Redis and a ``TCPStore`` started on free
  loopback ports, plus their server-side request counters;
* :mod:`benchmarks.agents` — the worker process: N/P agent threads of one
  target (an rdzv backend or a PyTorch handler), driven over a pipe;
* :mod:`benchmarks.harness` — the parent side: a pool of worker processes per
  target, the start barrier, the per-round time limit;
* :mod:`benchmarks.scenarios` — the latency and re-rendezvous scenarios, their
  repetitions, skip rules and per-round records;
* :mod:`benchmarks.throughput` — Store set/get/add throughput;
* :mod:`benchmarks.report` — medians, ratios, targets, the Markdown table and the plot;
* :mod:`benchmarks.run` — the command line;
* :mod:`benchmarks.profile` — one round under py-spy, summarised.

See ``docs/benchmarks.md`` for the method and the results.
"""
