"""The layout's rules, checked on the source (no imports run): roles do not import each
other, the shared library imports no role, pure modules do not load zmq, and no module
passes 400 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("scheduler", "server", "worker")
PACKAGES = ("omnips",) + ROLES
# Sans-IO modules: they take events and return instructions, so they must not need sockets.
PURE = ("omnips.batching", "omnips.timemodel", "omnips.sharding", "omnips.data", "omnips.protocol", "omnips.cluster",
        "omnips.job", "omnips.optim", "omnips.wire", "omnips.checkpoint", "omnips.server.shard", "omnips.server.asynchrony",
        "omnips.server.assembly", "omnips.server.barrier", "omnips.server.holds", "omnips.server.values", "omnips.server.members", "omnips.server.pulls",
        "omnips.server.shard_state", "omnips.scheduler.control", "omnips.scheduler.windows", "omnips.scheduler.regret", "omnips.scheduler.registry",
        "omnips.scheduler.disturbance", "omnips.scheduler.stopping", "omnips.scheduler.divergence", "omnips.scheduler.planning", "omnips.codec", "omnips.fieldchecks",
        "omnips.scheduler.core", "omnips.scheduler.instructions", "omnips.scheduler.evaluation", "omnips.scheduler.liveness", "omnips.scheduler.recovery",
        "omnips.scheduler.reports", "omnips.scheduler.options", "omnips.scheduler.progress", "omnips.scheduler.stalls", "omnips.scheduler.checkpoints",
        "omnips.worker.core")
MAX_LINES = 400
# The command-line front door checks a job's flags with each role's parser (for a local
# launch, or a cluster manager's job): the one place in omnips/ that may import them
# (lazily, inside the commands that need them).
FRONT_DOOR = {"omnips/cli.py", "omnips/clusterjob.py"}
# Modules over MAX_LINES today, at their size: they may shrink, not grow (each is to be
# split into a pure core beside a thin driver). None now.
OVERSIZE: dict[str, int] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if package in ROLES:  # installed as omnips.server, ... (pyproject.toml)
                name = f"omnips.{name}"
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, top_level_only: bool) -> set[str]:
    """The modules `name` imports, absolute (relative imports resolved); with
    `top_level_only`, only those its import runs (not those inside functions)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return out


def _role(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "omnips" and parts[1] in ROLES else None


def test_the_rules_see_every_package():
    assert {_role(n) or n.split(".")[0] for n in MODULES} == set(PACKAGES)
    assert "omnips.server.shard" in MODULES and "omnips.protocol" in MODULES
    assert _imports("omnips.server.shard", True) >= {"omnips.protocol", "omnips.server.barrier", "omnips.server.values"}


@pytest.mark.parametrize("name", [n for n in MODULES if _role(n)])
def test_a_role_imports_no_other_role(name):
    others = {m for m in _imports(name, top_level_only=False) if _role(m) not in (None, _role(name))}
    assert not others, f"{name} imports {sorted(others)}: roles share code through omnips/"


@pytest.mark.parametrize("name", [n for n in MODULES if not _role(n)])
def test_the_library_imports_no_role(name):
    if str(MODULES[name].relative_to(ROOT)) in FRONT_DOOR:
        pytest.skip("the front door imports the roles it starts")
    roles = {m for m in _imports(name, top_level_only=False) if _role(m)}
    assert not roles, f"{name} imports {sorted(roles)}: omnips/ is the library the roles use"


def _loaded(name: str) -> set[str]:
    """Every module importing `name` runs, transitively (this project's, and the first
    part of every other)."""
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        if module in MODULES:
            todo.extend(_imports(module, top_level_only=True))
            todo.extend(p for p in (module.rpartition(".")[0],) if p in MODULES)  # a package's __init__
    return {m.split(".")[0] if m not in MODULES else m for m in seen}


@pytest.mark.parametrize("name", PURE)
def test_a_pure_module_does_not_load_zmq(name):
    assert name in MODULES
    assert "zmq" not in _loaded(name), f"importing {name} loads zmq: {sorted(_loaded(name) & set(MODULES))}"


def test_loaded_follows_imports():
    """The check above can fail: a driver does load zmq, through the library."""
    assert "zmq" in _loaded("omnips.server.service") and "zmq" in _loaded("omnips.security")


@pytest.mark.parametrize("name", list(MODULES))
def test_no_module_passes_400_lines(name):
    path = str(MODULES[name].relative_to(ROOT))
    lines = len(MODULES[name].read_text().splitlines())
    limit = OVERSIZE.get(path, MAX_LINES)
    assert lines <= limit, f"{path} has {lines} lines (at most {limit}): split it by what it holds"
    if path in OVERSIZE:
        assert lines > MAX_LINES, f"{path} is down to {lines} lines: take it off OVERSIZE"


def test_every_installed_package_is_under_omnips():
    """A user's own `server` or `worker` package never meets ours: the role folders install
    as omnips.server, omnips.worker and omnips.scheduler."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "omnips" or p.startswith("omnips.") for p in setup["packages"]), setup["packages"]
    assert setup["package-dir"] == {f"omnips.{role}": role for role in ROLES}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert all(target.startswith("omnips.") for target in scripts.values()), scripts
