"""Train DFlash block-diffusion drafters for speculative decoding with PyTorch Lightning."""
