"""Errors meant for the person running the program: printed as one clear line, no traceback."""


class UserError(Exception):
    """Bad input or environment that the user can fix; the message says how."""


class EngineError(RuntimeError):
    """A step the engine could not finish (a CPU expert pool that failed or stopped answering);
    the message names the part and the layer."""


def printable(text: str) -> str:
    """`text` as valid Unicode for JSON and UIs: bytes of a file name that are not UTF-8 (kept by
    Python as surrogate escapes) become U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
