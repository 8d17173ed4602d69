"""The one error type of the data pipeline."""
from __future__ import annotations


class DataError(Exception):
    """A user-facing data problem (missing/corrupt file, wrong tokenizer, bad split): one line saying
    what is wrong and what to do. Raised instead of assert so a run stops with a readable message."""
