"""Side-by-side benchmark of rdzv's backends against PyTorch's own rendezvous (issue 6).

Not part of the library or of the test suite (``tests/test_benchmark_smoke.py``
only runs the smoke mode). Run from the project root::

    python -m benchmarks.run            # full run (~10 minutes), writes docs/benchmarks.{json,png,md}
    python -m benchmarks.run --quick    # fewer sizes and repetitions
    python -m benchmarks.run --smoke    # N = 8, one repetition, c10d baseline only (< 60 s)

Modules, one idea each:

* :mod:`benchmarks.counting` — :class:`~benchmarks.counting.CountingKV`, a
  ``KVBackend`` proxy that counts every public operation and its conflicts;
* :mod:`benchmarks.servers` — etcd, Redis and a ``TCPStore`` started on free
  loopback ports, plus their server-side request counters;
* :mod:`benchmarks.agents` — the worker process: N/P agent threads of one
  target (an rdzv backend or a PyTorch handler), driven over a pipe;
* :mod:`benchmarks.harness` — the parent side of one cell (target x N):
  spawn workers, start barrier, repetitions, per-cell time limit;
* :mod:`benchmarks.throughput` — Store set/get/add throughput;
* :mod:`benchmarks.report` — medians, ratios, targets, the Markdown table and the plot;
* :mod:`benchmarks.run` — the command line.

See ``docs/benchmarks.md`` for the method and the results.
"""
