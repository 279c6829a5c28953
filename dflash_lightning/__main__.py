"""`python -m dflash_lightning ...`: the project's errors in one line (`DFLASH_TRACEBACK=1`: the full traceback).

Exit status: 2 for a bad setting or input (ConfigError, DataError, FeatureCacheError, other ValueErrors of the
argument checks, Lightning's MisconfigurationException), 1 for a run that failed (a damaged or unwritable checkpoint,
non-finite training, a server, a feature engine).
"""

import logging
import os
import sys

import torch

if not torch.cuda.is_available():  # torchao (imported by transformers) logs CUDA kernels it cannot load on a CPU
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

from lightning.fabric.utilities.exceptions import MisconfigurationException  # noqa: E402

from dflash_lightning.commands.cli import cli_main  # noqa: E402
from dflash_lightning.commands.console import quiet_lightning  # noqa: E402
from dflash_lightning.long_runs.checkpointing import CheckpointError  # noqa: E402
from dflash_lightning.long_runs.nonfinite import NonFiniteError  # noqa: E402
from dflash_lightning.regenerate.openai_backend import ServerError  # noqa: E402
from dflash_lightning.target_model.engine import EngineError  # noqa: E402

TRACEBACK_ENV = "DFLASH_TRACEBACK"
# exit 1; any other ValueError is a bad setting: 2
FAILED_RUN = (CheckpointError, NonFiniteError, ServerError, EngineError)


def main() -> None:
    """`cli_main()`, with the project's errors as one `error: ...` line and an exit status."""
    quiet_lightning()
    try:
        cli_main()
    except (*FAILED_RUN, ValueError, FileNotFoundError, MisconfigurationException) as err:  # 2 but FAILED_RUN
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        where = "trainer settings (Lightning): " if isinstance(err, MisconfigurationException) else ""
        print(f"error: {where}{err} ({TRACEBACK_ENV}=1: the full traceback)", file=sys.stderr)
        sys.exit(1 if isinstance(err, FAILED_RUN) else 2)


if __name__ == "__main__":
    main()
