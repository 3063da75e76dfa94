"""What every ``hf-ext`` command shares."""

from __future__ import annotations

import logging


def quiet_logging() -> None:
    """Only errors from the libraries, so that a command's own output is what the user reads."""
    import transformers  # noqa: PLC0415 (only once a command runs: `hf-ext --help` stays instant)

    # DeepSpeed resets its logger's level when imported; a filter on the logger survives that.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    for name in ("hf_ext", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
