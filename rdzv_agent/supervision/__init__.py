"""What watches running workers: the health-check endpoint (:mod:`.health`), torch's file-timer watchdog
(:mod:`.watchdog`), the stuck-process check (:mod:`.stuck`), hung-worker detection from reported progress
(:mod:`.hang_watch`), and the environment's operations hooks that switch them on (:mod:`.ops_hooks`)."""
