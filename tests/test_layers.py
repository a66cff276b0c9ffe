"""The package's import layers (docs/layout.md, "Import layers"): a module imports its own unit (a
private package's modules import each other) and the units of lower layers, never a higher or an
equal one. The imports are read from the source (every ``import``, at module level or in a
function), so a lazy import that runs back up fails here too."""

import ast
import pathlib

import lik_cupy

ROOT = pathlib.Path(lik_cupy.__file__).parent

# Lowest first. A unit is a top-level module or package of lik_cupy ("" is the package's
# __init__, the public facade, whose names load lazily).
LAYERS = (
    ("errors", "_version"),
    ("_base",),  # environment switches, device memory, caches: what every other unit may read
    ("_files", "_shard_format", "_cpu", "_ranking", "_batched_calls"),
    ("_interop", "_atomic"),
    ("_dispatch",),  # reads a framework's TF32 default through its adapter
    ("_validate",),
    ("_runtime",),
    ("_streaming", "_maxsim_calls", "_scaled"),
    ("forward", "int8", "fp8", "quantize", "backward", "retrieval", "shards", "precision"),
    ("_plaid_files", "_torch_autograd", "fused_head"),  # PLAID index files; lik_cupy.torch's operators; the fused head
    ("plaid", "_torch_hidden"),  # the fused head's torch operators
    ("corpus", "torch", "_jax_ops", "_jax_xla"),
    ("distributed", "jax", "integrations"),
    ("serving",),  # lik serve --scheduler serves a DistributedCorpus
    ("",),
    ("cli",),
    ("__main__",),
)
LAYER = {unit: n for n, units in enumerate(LAYERS) for unit in units}


def _units() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()} | {""}


def _unit_of(dotted: str) -> str:
    """The unit ``lik_cupy.a.b`` belongs to: ``a`` when lik_cupy has such a module or package, else
    the root (a name the package's __init__ gives)."""
    parts = dotted.split(".")
    if len(parts) > 1 and parts[1] in _units():
        return parts[1]
    return ""


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import of lik_cupy in ``path``, relative ones resolved; a
    ``from X import name`` counts as an import of ``X.name`` (a module or a name of X)."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
            mod = ".".join(p for p in (base, node.module or "") if p)
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] == "lik_cupy"]


def _unit_of_file(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return "" if rel == pathlib.Path("__init__.py") else rel.parts[0].removesuffix(".py")


def test_every_unit_has_a_layer():
    assert _units() == set(LAYER), "place new modules in LAYERS (and docs/layout.md): " \
        f"{sorted(_units() ^ set(LAYER))}"


def test_no_import_runs_back_up():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit_of_file(path)
        for line, name in imports(path):
            target = _unit_of(name)
            if target != unit and LAYER[target] >= LAYER[unit]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name} (layer {LAYER[target]}, "
                           f"{target or 'lik_cupy'}) from layer {LAYER[unit]} ({unit or 'lik_cupy'})")
    assert not bad, "\n".join(bad)


def test_walker_resolves_relative_and_lazy_imports():
    # the walk sees what the layer check relies on: relative imports from a package's __init__
    # and a subpackage, imports inside functions, and names the root gives
    init = dict((n, line) for line, n in imports(ROOT / "_dispatch" / "__init__.py"))
    assert "lik_cupy._dispatch.backend.use_gpu" in init
    quantize = [n for _, n in imports(ROOT / "_runtime" / "quantize.py")]
    assert "lik_cupy._base.device.device_properties" in quantize and "lik_cupy._dispatch.elem_spec" in quantize
    cli = [n for _, n in imports(ROOT / "cli.py")]
    assert "lik_cupy.distributed.DistributedCorpus" in cli  # imported in a function
    assert _unit_of("lik_cupy") == _unit_of("lik_cupy.maxsim") == "" and _unit_of("lik_cupy._base.env") == "_base"


def _module_exists(dotted: str) -> bool:
    path = ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_import_of_the_package_resolves():
    # a relative import one dot short (in a function, where no import-time error shows it) names
    # a module that does not exist
    bad = [f"{path.relative_to(ROOT.parent)}:{line} imports {name}" for path in sorted(ROOT.rglob("*.py"))
           for line, name in imports(path) if not (_module_exists(name) or _module_exists(name.rsplit(".", 1)[0]))]
    assert not bad, "\n".join(bad)


def _public_modules() -> set[str]:
    """The dotted names of the package's public modules: no part of the path under lik_cupy starts
    with an underscore (``lik_cupy`` itself, ``lik_cupy.shards``, ``lik_cupy.serving.batcher``)."""
    out = set()
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(p.startswith("_") for p in parts[1:]):
            out.add(".".join(parts))
    return out


def private_names_from_public_modules(path: pathlib.Path, public: set[str]) -> list[str]:
    """Where ``path`` reaches an underscore name of a public module of the package other than its
    own: ``from lik_cupy.shards import _x`` or ``shards._x`` after ``from lik_cupy import shards``."""
    own = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    aliases = {}  # local name -> public module it is bound to
    bad = []
    for line, name in imports(path):
        mod, _, attr = name.rpartition(".")
        if name in public and name != own:
            aliases[attr] = name
        elif mod in public and mod != own and attr.startswith("_") and not attr.startswith("__") \
                and not _module_exists(name):  # (a private module of a package is no private name)
            bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {attr} from {mod}")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.alias) and node.asname and node.name.split(".")[-1] in aliases:
            aliases[node.asname] = aliases[node.name.split(".")[-1]]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    return bad


def test_no_module_takes_a_private_name_from_a_public_module():
    # What a public module keeps private may change with it; what other modules share lives in a
    # private module (lik_cupy/_files.py, lik_cupy/_shard_format.py, ...).
    public = _public_modules()
    bad = [b for path in sorted(ROOT.rglob("*.py")) for b in private_names_from_public_modules(path, public)]
    assert not bad, "\n".join(bad)


def test_the_private_name_check_sees_both_forms(tmp_path, monkeypatch):
    # a module of the package that takes shards' privates both ways is reported twice
    probe = ROOT / "_probe_private_names.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: (
        "from lik_cupy.shards import _INT8\nfrom lik_cupy import shards as s\nx = s._DTYPES\n"
        if self == probe else _read_text(self, *a, **k)))
    found = private_names_from_public_modules(probe, _public_modules())
    assert [f.split(" ", 1)[1] for f in found] == ["imports _INT8 from lik_cupy.shards", "reads lik_cupy.shards._DTYPES"]


_read_text = pathlib.Path.read_text
