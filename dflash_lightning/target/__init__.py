"""The frozen target: loading it, its context features (docs/method.md section 1), its placements, and the callback.

loading.py reads its files, features.py runs it, separate.py and sharded.py place it, callback.py serves the Trainer.
"""

from dflash_lightning.target.callback import TargetFeatures
from dflash_lightning.target.features import FeatureExtractor, packed_causal_mask
from dflash_lightning.target.loading import (
    DTYPES,
    decoder_layers,
    load_target_config,
    load_target_io,
    resolve_model_dir,
    tokenizer_ids,
    weight_map,
)
from dflash_lightning.target.separate import FeaturePrefetcher, rank_devices
from dflash_lightning.target.sharded import node_mesh, sharded_model

__all__ = [
    "decoder_layers",
    "DTYPES",
    "FeatureExtractor",
    "FeaturePrefetcher",
    "load_target_config",
    "load_target_io",
    "node_mesh",
    "packed_causal_mask",
    "rank_devices",
    "resolve_model_dir",
    "sharded_model",
    "TargetFeatures",
    "tokenizer_ids",
    "weight_map",
]
