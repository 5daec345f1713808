"""No module or name on the sandbox's allow-list turns a string into code or hands out the real builtins.

The review's attack: `dataclasses` writes each field name into the source of the methods it
generates and `exec`s it in a namespace whose builtins are the real ones (the tool's class is in
no module, so the namespace is `{}` and `exec` fills in its own builtins). A tool that passed
`validate_tool_code` built a class whose annotations dict held the name
`__class__,exec(PAYLOAD))#`, got `__import__` and `os` with every layer on, and forged its own
result on descriptor 1. Renaming a `Field` and subclassing did the same.

What stops it now, each layer on its own:

* the allow-list: `dataclasses`, `collections.namedtuple` and `typing.NamedTuple` are off it
  (statically, and the runtime views follow the same list);
* the child: text that a library runs for the tool (`exec`/`eval` of a string) gets the tool's
  reduced builtins, and is refused in a real module's namespace;
* two mechanical checks that keep it so: every allowed callable is called with string data and
  must not run code built from it, and every exec/eval/compile/__import__ in the Python code the
  sandbox loads is listed here with the reason it is out of the tool's reach.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.skills import sandbox
from ratchet.skills.sandbox import SandboxResult, UnsafeCodeError, run_tool

# What the attacks write to descriptor 1: a whole reply, as the child would, then exit before it can.
FORGED_REPLY = sandbox._RESULT_MARK + json.dumps({"ok": True, "value": '{"FORGED_BY_TOOL": 1}'}).encode()
PAYLOAD = f"__import__('os').write(1, {FORGED_REPLY!r}); __import__('os')._exit(0)"
# A field name that `dataclasses` pastes into `return (self.NAME,)==(other.NAME,)`: the payload
# runs when two instances are compared; `#` comments out the rest of the generated line.
FIELD = repr(f"__class__,exec({PAYLOAD!r}))#")

ATTACKS = {
    "annotations-built-from-strings": f"""
import dataclasses

def run():
    C = dataclasses.dataclass(type("C", (), {{"__annotations__": {{{FIELD}: int}}}}), init=False, repr=False)
    return C() == C()
""",
    "field-renamed-then-subclassed": f"""
from dataclasses import dataclass, fields

@dataclass
class A:
    x: int = 0

def run():
    fields(A)[0].name = {FIELD}

    @dataclass(init=False, repr=False)
    class B(A):
        pass

    return B() == B()
""",
    "make_dataclass-with-a-str-subclass": f"""
import dataclasses

class Name(str):
    def isidentifier(self):
        return True

def run():
    C = dataclasses.make_dataclass("C", [Name({FIELD})], init=False, repr=False)
    return C() == C()
""",
    "asdict-reads-dunders": """
import dataclasses

@dataclasses.dataclass
class A:
    x: int = 0

def run():
    dataclasses.fields(A)[0].name = "__class__"
    return str(dataclasses.asdict(A()))
""",
}
ATTACKS["field-in-a-real-module"] = ATTACKS["annotations-built-from-strings"].replace(
    'type("C", (), {', 'type("C", (), {"__module__": "re", '
)


def not_forged(result: SandboxResult, needle: str) -> None:
    assert not result.ok and result.value is None, result
    assert needle in result.error and "\n" not in result.error, result.error


@pytest.mark.parametrize("attack", ATTACKS)
def test_dataclass_field_names_cannot_run_code(attack: str) -> None:
    """Every layer on: refused before it runs, since `dataclasses` is off the allow-list."""
    with pytest.raises(UnsafeCodeError, match="import of `dataclasses` is not allowed"):
        run_tool(ATTACKS[attack], {})


@pytest.fixture
def runtime_view_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static check off, its runtime twin on."""
    monkeypatch.setattr(sandbox, "validate_tool_code", lambda source, entry="run": None)


@pytest.mark.parametrize("attack", ATTACKS)
def test_the_runtime_view_does_not_hand_out_dataclasses(runtime_view_only: None, attack: str) -> None:
    not_forged(run_tool(ATTACKS[attack], {}), "ImportError: tool code may not import 'dataclasses'")


@pytest.fixture
def dataclasses_allowed_again(runtime_view_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A future allow-list that let `dataclasses` back in, with no static check and no audit hook:
    only the child's handling of text a library runs for the tool is left."""
    names = frozenset("dataclass fields make_dataclass asdict".split())
    monkeypatch.setitem(sandbox.ALLOWED_IMPORTS, "dataclasses", names)
    monkeypatch.setattr(sandbox, "_INNER_GUARDS", False)


@pytest.mark.parametrize(
    "attack, needle",
    [
        ("annotations-built-from-strings", "NameError: name 'exec' is not defined"),
        ("field-renamed-then-subclassed", "NameError: name 'exec' is not defined"),
        # the class belongs to a real module, whose namespace dataclasses runs the text in:
        # `types` (make_dataclass builds it there), `re` (the class says so)
        (
            "make_dataclass-with-a-str-subclass",
            "PermissionError: sandbox blocked exec in the namespace of module 'types'",
        ),
        ("field-in-a-real-module", "PermissionError: sandbox blocked exec in the namespace of module 're'"),
    ],
    ids=["annotations", "renamed-field", "make_dataclass", "real-module"],
)
def test_text_a_library_runs_for_the_tool_gets_the_reduced_builtins(
    dataclasses_allowed_again: None, attack: str, needle: str
) -> None:
    not_forged(run_tool(ATTACKS[attack], {}), needle)


def test_a_library_that_generates_code_still_works_with_the_reduced_builtins(
    dataclasses_allowed_again: None,
) -> None:
    source = """
from dataclasses import dataclass, asdict

@dataclass(frozen=True, order=True)
class P:
    x: int
    y: int = 2

def run():
    return [asdict(P(1)), P(1) < P(2), repr(P(3, 4)), P(1) == P(1)]
"""
    assert run_tool(source, {}).value == [{"x": 1, "y": 2}, True, "P(x=3, y=4)", True]


@pytest.mark.parametrize(
    "source, needle",
    [
        ("from collections import namedtuple\ndef run(): pass", "`from collections import namedtuple`"),
        ("import collections\ndef run():\n    return collections.namedtuple", "`collections.namedtuple`"),
        ("from typing import NamedTuple\ndef run(): pass", "`from typing import NamedTuple`"),
        ("from dataclasses import dataclass\ndef run(): pass", "import of `dataclasses` is not allowed"),
    ],
    ids=["from-collections", "collections-attribute", "typing", "dataclasses"],
)
def test_code_generating_names_are_off_the_allow_list(source: str, needle: str) -> None:
    with pytest.raises(UnsafeCodeError, match="is not allowed") as info:
        sandbox.validate_tool_code(source)
    assert needle in str(info.value)


# ------------------------------------------------------------------ the mechanical checks

CANARY = "zq_canary"

# Run in a fresh interpreter started as the child is: call every allowed callable (and the public
# methods of what it returns, and of the object itself) with string data, and subscript it; the
# audit hook sees every code object exec/eval runs, and one built from the data is a finding. So
# is a call that returns the real builtins, or eval/exec/getattr... themselves.
PROBE = r"""
import builtins, importlib, json, signal, sys

CANARY = sys.argv[2]
allowed = json.loads(sys.argv[1])
risky = "eval exec compile open __import__ getattr setattr delattr vars globals locals breakpoint".split()
dangerous = {id(builtins), id(vars(builtins))} | {id(getattr(builtins, n)) for n in risky}
code_type = type(compile("", "", "exec"))
found = set()
calling = [""]


def from_canary(code):
    todo = [code]
    while todo:
        c = todo.pop()
        if any(CANARY in n for n in c.co_names + c.co_varnames + c.co_freevars + c.co_cellvars):
            return True
        for k in c.co_consts:
            if type(k) is str and CANARY in k:
                return True
            if type(k) is code_type:
                todo.append(k)
    return False


def hook(event, args):
    if event == "exec" and calling[0] and from_canary(args[0]):
        found.add(calling[0] + ": runs code built from its string arguments")


def alarm(signum, frame):
    raise TimeoutError


def probe_class():
    return type("Probe", (), {"__annotations__": {CANARY: int, "value": CANARY}, CANARY: 0})


def arguments():
    return [(), (CANARY,), (CANARY, CANARY), (CANARY, CANARY, CANARY), ([CANARY],), (CANARY, [CANARY]),
            (CANARY, [(CANARY, int)]), (CANARY, {CANARY: int}), ({CANARY: int},), (probe_class(),)]


def call(label, fn, argument_sets=None):
    values = []
    for args in argument_sets or arguments():
        calling[0] = label
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        try:
            value = fn(*args)
        except BaseException:
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            calling[0] = ""
        if id(value) in dangerous:
            found.add(f"{label}: returns {value!r}")
        values.append(value)
    return values


def methods(label, obj):
    for attr in dir(obj):
        if not attr.startswith("_"):
            try:
                value = getattr(obj, attr)
            except Exception:
                continue
            if id(value) in dangerous:
                found.add(f"{label}.{attr}: is {value!r}")
            elif callable(value):
                call(f"{label}.{attr}", value)


sys.addaudithook(hook)
signal.signal(signal.SIGALRM, alarm)
for module_name, names in sorted(allowed.items()):
    module = importlib.import_module(module_name)
    for name in sorted(names):
        obj, label = getattr(module, name), f"{module_name}.{name}"
        if callable(obj):
            for value in call(label, obj):
                if isinstance(obj, type) and type(value) is obj:
                    methods(label + "()", value)
        methods(label, obj)
        if hasattr(obj, "__getitem__") or hasattr(obj, "__class_getitem__"):  # typing's forms, in brackets
            call(f"{label}[...]", lambda key: obj[key], [(CANARY,), ((CANARY, CANARY),)])
print(json.dumps(sorted(found)))
"""


def test_no_allowed_callable_runs_code_built_from_its_string_arguments() -> None:
    """Catches a module or name added to the list that compiles strings it is given (dataclasses,
    namedtuple and typing.NamedTuple were found by this)."""
    allowed = {module: sorted(names) for module, names in sandbox.ALLOWED_IMPORTS.items()}
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-W", "ignore", "-c", PROBE]
    done = subprocess.run(
        argv + [json.dumps(allowed), CANARY], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# Every exec/eval/compile/__import__ (or `.import_module`) in the Python code the sandbox's
# interpreter has loaded once every allowed module is imported, and why the tool cannot make it
# run text of its choosing. `off_list` names what would reach it: none of it may be on the list.
REVIEWED: dict[str, tuple[str, tuple[str, ...]]] = {
    "collections:namedtuple:eval": (
        "evaluates a lambda built from the field names; stdlib modules call it at import with their own "
        "names, the tool cannot call it",
        ("collections.namedtuple", "typing.NamedTuple"),
    ),
    "typing:ForwardRef.__init__:compile": (
        "compiles a string annotation (Optional['x']) into a code object and runs nothing; only "
        "ForwardRef._evaluate runs it",
        (),
    ),
    "typing:ForwardRef._evaluate:eval": (
        "runs a string annotation; reached through get_type_hints or a ForwardRef's private method",
        ("typing.get_type_hints", "typing.ForwardRef"),
    ),
    "encodings:search_function:__import__": (
        "imports `encodings.<codec name>` for str.encode/bytes.decode; names with a dot are skipped, "
        "so only the stdlib's codec modules",
        (),
    ),
    "warnings:_getcategory:__import__": (
        "parses -W options and PYTHONWARNINGS, which the child (-I, no -W) never has",
        ("warnings",),
    ),
}
# The import system runs module files it finds on sys.path, for names the tool's `__import__` lets
# through (the views) or the stdlib imports itself; it never runs a string.
IMPORT_SYSTEM = ("importlib", "_frozen_importlib", "_frozen_importlib_external", "zipimport")

LOADED = r"""
import datetime, importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
datetime.datetime.strptime("2024-02-03", "%Y-%m-%d")  # the lazy imports an allowed call makes
print(json.dumps({name: getattr(module, "__file__", None) for name, module in sys.modules.items()}))
"""
CODE_BUILDERS = frozenset({"exec", "eval", "compile", "__import__"})


def _code_builders(name: str, path: str) -> set[str]:
    """`module:qualname:builtin` for each use of a code-building builtin in the module's source."""
    found: set[str] = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Name) and child.id in CODE_BUILDERS:
                found.add(f"{name}:{where or '<module>'}:{child.id}")
            elif isinstance(child, ast.Attribute) and child.attr in CODE_BUILDERS - {"compile"} | {
                "import_module"
            }:
                found.add(f"{name}:{where or '<module>'}:{child.attr}")
            visit(child, inner)

    visit(ast.parse(Path(path).read_text(encoding="utf-8")), "")
    return found


def test_every_code_builder_the_allowed_modules_load_is_reviewed() -> None:
    """Catches a newly added module (or a new Python) whose code turns strings into code."""
    allowed = sorted(sandbox.ALLOWED_IMPORTS)
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", LOADED, json.dumps(allowed)],
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found: set[str] = set()
    for name, path in json.loads(done.stdout).items():
        if path and path.endswith(".py") and name.partition(".")[0] not in IMPORT_SYSTEM:
            found |= _code_builders(name, path)
    assert sorted(found - set(REVIEWED)) == [], (
        "review each: take its module or names off the list, or list it"
    )
    on_list = []
    for key in sorted(found):
        for entry in REVIEWED[key][1]:
            module, _, attr = entry.rpartition(".") if entry.count(".") else (entry, "", "")
            if (attr and attr in sandbox.ALLOWED_IMPORTS.get(module, ())) or (
                not attr and module in sandbox.ALLOWED_IMPORTS
            ):
                on_list.append(f"{entry} reaches {key}")
    assert on_list == []
