"""The library's one logger: every module logs through it, and a stage (eagle3_pipeline/cli/stage.py) decides where its
lines go (the console and RUN_DIR/logs/NN_name.log)."""
from __future__ import annotations

import logging

LOGGER_NAME = "eagle3"
# `extra=FILE_ONLY` on a log call: the line goes to the stage's log file, not to the console.
FILE_ONLY = {"file_only": True}


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
