"""Worker scripts and the process harness for the agent tests."""
