"""The one base class of a user's mistake. Anything derived from it is printed as one line naming the problem and
the fix, with exit code 2 (gpt_tp.entry); anything else is a bug in gpt_tp and keeps its traceback."""


class UserError(ValueError):
    """A bad input (config value, flag, file, layout, data, checkpoint): its message names the flag or file and the fix."""


class DataError(UserError):
    """Bad data input: the message names the file or flag at fault and how to fix it."""
