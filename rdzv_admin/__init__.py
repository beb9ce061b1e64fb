"""rdzv_admin: the ``rdzv`` operator command (:mod:`rdzv_admin.cli`) and what it shows.

Modules: :mod:`.cli` (the command: its options, the five commands, exit codes), :mod:`.progress_view`
(``rdzv status``'s per-node progress), :mod:`.runs_view` (``rdzv runs``), :mod:`.self_check`
(``rdzv check``'s protocol self-test). It stands on :mod:`rdzv_core` and imports no torch.
"""
