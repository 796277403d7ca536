"""The one error type of the data package."""


class DataError(ValueError):
    """Training data or a tokenizer cannot be used; the message names what was wrong and what to do."""
