"""Train DFlash block-diffusion drafters for speculative decoding with PyTorch Lightning."""

from dflash_lightning import _moved

_moved.install()
