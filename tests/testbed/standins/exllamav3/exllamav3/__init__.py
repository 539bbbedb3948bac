"""STAND-IN for exllamav3 (testbed only): the version, and a call into the compiled extension."""

__version__ = "1.5.1"


def extension_ok() -> bool:
    """True when the compiled extension imports (it needs the venv's torch loaded first)."""
    import torch  # noqa: F401  (loads libtorch for the extension)

    # isort: split
    import exllamav3_ext

    return hasattr(exllamav3_ext, "add_one")
