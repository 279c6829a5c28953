"""Pictures of a run: the figures of masks, batches and acceptance (figures.py) and the callback that logs them."""
