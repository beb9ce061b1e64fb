"""The launcher (rdzv-run) and the agent: API, local agent, logs, reaper, flags, health check, watchdog, stuck check,
telemetry, warm workers, progress, end to end."""
