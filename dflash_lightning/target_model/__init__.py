"""The frozen target model: loading it, its context features (docs/method.md section 1), its placements, the callback.

loading.py reads its files, features.py runs it, separate.py and sharded.py place it, callback.py serves the Trainer,
fingerprints.py names it by content.
"""

from dflash_lightning.target_model.callback import TargetFeatures
from dflash_lightning.target_model.features import FeatureExtractor, packed_causal_mask
from dflash_lightning.target_model.loading import (
    DTYPES,
    decoder_layers,
    load_target_config,
    load_target_io,
    resolve_model_dir,
    tokenizer_ids,
    weight_map,
)
from dflash_lightning.target_model.separate import FeaturePrefetcher, rank_devices
from dflash_lightning.target_model.sharded import node_mesh, sharded_model

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
