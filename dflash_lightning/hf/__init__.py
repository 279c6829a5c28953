"""The modelling file shipped inside exported drafter folders (copied, never imported by the package)."""
