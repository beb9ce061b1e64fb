"""What speaks torch's API: the ``RendezvousHandler`` (:mod:`.handler`), the c10d ``Store`` (:mod:`.store`),
torchrun's ``rdzv-*`` handlers (:mod:`.torchrun`) and the address rank 0 publishes (:mod:`.address`).

Importing this package imports nothing; its modules import torch.
"""
