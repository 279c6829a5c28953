"""Warm start: a run's drafter begins from another run's weights (a `.ckpt` or an exported folder, ours or published),
of the same variant or another on the same backbone (`--model.init_from`).
"""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info

from dflash_lightning.config import PART_SETTINGS, ConfigError
from dflash_lightning.model import DFlashDrafter


def warm_start(drafter: DFlashDrafter, path: str) -> None:
    """Load a drafter `.ckpt` or folder's weights into `drafter`, of the same variant or another on the same backbone.

    The source's config must be the drafter's in every shape field of the backbone and of the parts both have.
    Parts the drafter has and the source lacks keep their initialisation; parts the source has and the drafter
    lacks are dropped (logged) if they leave the backbone as it is (a head), else refused (convolutions).
    """
    from dflash_lightning.folder.reader import read_drafter

    mine = drafter.config
    cfg, state, _ = read_drafter(path, mine.num_target_layers)
    theirs, ours = set(cfg.preset.parts), set(mine.preset.parts)
    unshared = set(PART_SETTINGS) - {p.name for p in theirs & ours}  # settings of a part not in both: unread
    skip = {"variant", *cfg.training_fields(), *mine.training_fields()}
    flat = mine.flat_dict()
    diff = [k for k, v in cfg.flat_dict().items()
            if k not in skip and k.split(".")[0] not in unshared and v != flat.get(k)]
    if diff:
        raise ConfigError(f"model.init_from '{path}': its drafter differs from this run's in {', '.join(diff)}")
    only_theirs = [p for p in cfg.preset.parts if p not in ours]  # in preset order: messages repeat
    lost = [p for p in only_theirs if p.changes_backbone]
    if lost:
        raise ConfigError(f"model.init_from '{path}': a {cfg.variant} drafter cannot start a {mine.variant} run: "
                          f"its {', '.join(p.name for p in lost)} part(s) change the backbone this run lacks")
    if theirs == ours:
        drafter.load_state_dict(state)
        return
    dropped = [k for k in state if any(p.owns(k) for p in only_theirs)]
    kept = {k: v for k, v in state.items() if k not in dropped}
    missing, unexpected = drafter.load_state_dict(kept, strict=False)
    fresh = [p for p in drafter.parts if type(p) in ours - theirs]
    extra = [k for k in missing if not any(p.owns(k) for p in fresh)]
    if unexpected or extra:
        raise ConfigError(f"model.init_from '{path}': unexpected keys {unexpected}, missing {extra}")
    # the backbone's weights fit either layout; that its slots were trained to predict other positions is said
    words = {False: "fill-in", True: "anchor-first"}
    theirs_first, mine_first = cfg.layout.anchor_first, mine.layout.anchor_first
    relayout = "" if theirs_first == mine_first else (
        f"; its backbone was trained on {words[theirs_first]} blocks, this run's are {words[mine_first]}")
    if dropped:
        rank_zero_info(f"model.init_from '{path}': the {cfg.variant} drafter's "
                       f"{', '.join(p.name for p in only_theirs)} weights are not used by this "
                       f"{mine.variant} run ({len(dropped)} tensors){relayout}")
    elif relayout:
        rank_zero_info(f"model.init_from '{path}': a {cfg.variant} drafter starts this {mine.variant} run{relayout}")
