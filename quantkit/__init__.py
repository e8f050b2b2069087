"""quantkit: offline compression of large language models to compressed-tensors checkpoints."""


DISTRIBUTION = "quantkit-llm"  # pip install quantkit-llm; imported as quantkit, run as `quantkit`


def _version() -> str:
    """One version string: pyproject.toml's, as installed package metadata carries it.

    The metadata is used only when it describes this very copy of the package (a wheel install): an
    editable install of another checkout, or a source tree on PYTHONPATH, would otherwise report a
    different tree's version. A source tree reads its own pyproject.toml instead."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution
    from pathlib import Path

    here = Path(__file__).resolve()
    try:
        dist = distribution(DISTRIBUTION)
        if Path(str(dist.locate_file("quantkit/__init__.py"))).resolve() == here:
            return dist.version
    except (PackageNotFoundError, OSError):
        pass
    pyproject = here.parents[1] / "pyproject.toml"
    if pyproject.is_file():
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    return "0+unknown"


__version__ = _version()
