"""Silence transformers' progress bars and info logs in the workers and the demo (the report is the output)."""

from __future__ import annotations


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
