"""Helpers shared by the tests (no tests here): polling (``waiting.py``), worker programs (``agent_workers``),
fault agents (``fault_agents``), jobs of real launchers (``membership_jobs.py``, ``multihost_jobs.py``)."""
