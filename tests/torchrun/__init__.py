"""Plain torchrun with the rdzv-* handlers: parity with torchrun, the example scripts, the example training job."""
