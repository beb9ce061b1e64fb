"""``rdzv-run``: its options (:mod:`.args`), options to a launch configuration (:mod:`.config`, with
:mod:`.target` for the rendezvous target and :mod:`.worker_options` for torchrun's per-worker options),
torchrun's static rendezvous (:mod:`.static`) and the run itself (:mod:`.launcher`)."""
