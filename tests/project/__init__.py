"""The project as shipped: documentation examples, the plugin docs, the benchmarks' smoke runs, the conformance suite
catching bugs."""
