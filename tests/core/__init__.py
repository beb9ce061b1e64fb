"""Unit tests of the core: URL, errors, plugins, round record, ranks, round watch, keep-alive, handler, logging,
clock offset, the rdzv command."""
