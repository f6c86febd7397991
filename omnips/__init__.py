"""omnips: a parameter server for heterogeneous clusters."""

__version__ = "0.1.0"

# The roles' packages (server/, worker/, scheduler/) install as omnips.server, omnips.worker
# and omnips.scheduler (pyproject.toml). In a source tree they sit beside this folder:
# found there, so that a checkout runs as itself whatever else is installed.
def _source_tree_roles() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if all((root / role / "__main__.py").is_file() for role in ("server", "worker", "scheduler")):
        __path__.append(str(root))


_source_tree_roles()
