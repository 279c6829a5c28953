"""The data stage: conversation files -> assistant-masked tokens -> packed fixed-shape batches."""

from dflash_lightning.data.conversations import DataError, TokenizedSamples, tokenize_conversation, tokenize_files
from dflash_lightning.data.datamodule import DFlashDataModule
from dflash_lightning.data.packing import PackedBatch, collate_documents, pack_documents

__all__ = [
    "DFlashDataModule",
    "DataError",
    "PackedBatch",
    "TokenizedSamples",
    "collate_documents",
    "pack_documents",
    "tokenize_conversation",
    "tokenize_files",
]
