"""cumulus.Error, defined in Python so that type checkers and the stub see it; the module
cumulus._cumulus raises it for every cumulus::Error the C++ library throws."""


class Error(ValueError, RuntimeError):
    """Bad input or a failure inside cumulus.

    str(e) is the C++ cumulus::Error's text, "where: message"; e.where names the call
    ("Decoder.append") or the library function that found it, e.message says what is wrong,
    naming the argument and its value.
    """

    where: str = ""
    message: str = ""
