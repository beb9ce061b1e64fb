"""The worker processes of a node: one worker process (:mod:`.process`), warm workers started ahead
(:mod:`.warm`, whose program is :mod:`._warm_boot`), where output goes (:mod:`.log_specs`: torchrun's log
specs; :mod:`.streams`: redirects, tee, log pumps, error excerpts) and the node's reaper (:mod:`.reaper`)."""
