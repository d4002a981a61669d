"""Errors meant for the person running the program: printed as one clear line, no traceback."""


class UserError(Exception):
    """Bad input or environment that the user can fix; the message says how."""
