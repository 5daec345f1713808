"""`ratchet export`: what it writes for a champion of every kind (real skill library, real
MLflow adapter registry, real MiniLM), the manifest's evidence from the audit logs, the bad
input it refuses in one line with nothing written, the write that is whole or absent (an
error midway, a SIGKILL midway), and the exported tools served by `ratchet tools serve --from`
to a real MCP client."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.config import Settings, load_settings
from ratchet.errors import AdapterError, SkillFileError
from ratchet.flows import export as export_module
from ratchet.flows.export import ExportError, export_champion, exported_tools
from ratchet.flows.runtime import champion_policy
from ratchet.skills.calls import apply_request
from ratchet.skills.exemplars import exemplar_skill
from ratchet.skills.format import Demo, Skill, ToolSource
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import AdapterRegistry
from ratchet.types import ArgConstraint, ConstraintSpec, RuleSpec
from tests.conftest import _free_port, stop_process_group
from tests.factories import a_rule
from tests.test_export_apply import CONVERT, GO, load_module

RATCHET = str(Path(sys.executable).parent / "ratchet")
FAMILY = "tasks:tasks"
EVIDENCE = {
    "decision": "accept",
    "reason": "significant net gain: 6 repairs, 1 regression in 20 tasks",
    "repairs": 6,
    "regressions": 1,
    "unchanged": 13,
    "p_value": 0.0625,
    "tasks": 20,
    "rollouts": 40,
    "champion": "0f0f0f0f0f0f",
    "pairs": [["t", 0, 1]],
}


def _settings(data: Path) -> Settings:
    return load_settings({"data_dir": data, "evolution": "units"})


def _skill(name: str, kind: str, **data: Any) -> Skill:
    return Skill(
        name=name,
        description=f"{name}.",
        body=data.pop("body", "Look around first."),
        kind=kind,
        family=FAMILY,
        evolution="units",
        generation=1,
        provenance=["traj-1", "traj-2"],
        **data,
    )


def _promote(library: SkillLibrary, skill: Skill, who: str = "alice") -> str:
    name = library.add(skill).name
    library.transition(name, "verified", who="verify", why=EVIDENCE["reason"], evidence=EVIDENCE)
    library.transition(name, "promoted", who=who, why="reviewed the pairs")
    return name


TOOL = _skill(
    "tasks-double",
    "tool",
    body="A function tool.",
    tool=ToolSource(
        kind="function",
        parameters={"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
        code="def run(x: float, task: str = '') -> float:\n    return 2 * x\n",
    ),
)


def champion_data_dir(data: Path, tool: bool = False) -> SkillLibrary:
    """A data dir whose champion holds a procedure, a rule, an argument constraint and an exemplar
    set (and a tool), each gated and promoted; beside them a candidate and a rejected skill."""
    library = SkillLibrary(data / "skills", data / "index")
    _promote(library, _skill("look-first", "procedure"))
    _promote(library, a_rule(RuleSpec(name="no-south", avoid=("go: south",)), FAMILY))
    units = ConstraintSpec(
        name="tasks-args", tools={"convert": {"from_unit": ArgConstraint(from_context=True)}}
    )
    _promote(library, _skill("tasks-args", "constraint", constraint=units), who="verify:auto")
    demos = [
        Demo(
            task="How many meters are in 5.2 miles?", actions=("convert: miles, meters, 5.2",), trajectory="a"
        ),
        Demo(
            task="Convert 3 kilograms to pounds.", actions=("convert: kilograms, pounds, 3",), trajectory="b"
        ),
        Demo(task="What is 85 hours in seconds?", actions=("convert: hours, seconds, 85",), trajectory="c"),
    ]
    _promote(library, exemplar_skill(FAMILY, demos, "units", 1))
    if tool:
        _promote(library, TOOL)
    library.add(_skill("still-a-candidate", "procedure", body="Never shown."))
    rejected = library.add(_skill("was-rejected", "guardrail", body="Never shown either.")).name
    library.transition(rejected, "rejected", who="verify", why="futile", evidence={"decision": "reject"})
    return library


@pytest.fixture(scope="module")
def champion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, Path]:
    """One data dir with a champion and a tool, exported once."""
    data = tmp_path_factory.mktemp("champion") / "data"
    champion_data_dir(data, tool=True)
    settings = _settings(data)
    out = data.parent / "export"
    export_champion(settings, out, by="tester")
    return settings, out


def _manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def test_the_export_holds_the_champion_and_what_says_why_each_part_is_live(
    champion: tuple[Settings, Path],
) -> None:
    settings, out = champion
    policy = champion_policy(settings, SkillLibrary(settings.skills_dir, settings.index_dir))
    m = _manifest(out)
    assert m["policy_version"] == policy.version and m["evolution"] == "units"
    assert (m["model"], m["served_model"]) == (settings.model.name, settings.model.name)
    by_name = {c["name"]: c for c in m["candidates"]}
    assert set(by_name) == {"look-first", "no-south", "tasks-args", "tasks-exemplars", "tasks-double"}
    args = by_name["tasks-args"]
    assert (args["kind"], args["promoted_by"], args["promoted_why"]) == (
        "constraint",
        "verify:auto",
        "reviewed the pairs",
    )
    assert args["gate"] | {"at": None} == {
        **{k: EVIDENCE[k] for k in export_module.GATE_KEYS},
        "at": None,
        "by": "verify",
        "against": EVIDENCE["champion"],
    }
    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    assert args["content_hash"] == library.get("tasks-args").content_hash
    promoted = next(r for r in library.history("tasks-args") if r.to_status == "promoted")
    assert args["promoted_at"] == promoted.at.isoformat()
    assert args["provenance"]["trajectories"] == ["traj-1", "traj-2"]
    assert m["counts"] == {
        "prompt_skills": 1,
        "exemplars": 3,
        "rules": 1,
        "constraints": 1,
        "tools": 1,
        "adapter": 0,
    }
    # every other file is listed with its sha256
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(m["files"]) == files
    for name, digest in m["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    readme = (out / "README.md").read_text()
    assert "| `tasks-args` | constraint | +6 −1, p = 0.0625 |" in readme
    assert "ratchet tools serve --from" in readme and "system_addition.md" in readme


def test_its_files_are_the_policys_changes_as_data(champion: tuple[Settings, Path]) -> None:
    settings, out = champion
    policy = champion_policy(settings, SkillLibrary(settings.skills_dir, settings.index_dir))
    tools = json.loads((out / "tools.json").read_text())
    assert [r["name"] for r in tools["rules"]] == ["no-south"] and tools["rules"][0]["avoid"] == ["go: south"]
    assert tools["constraints"][0]["tools"]["convert"]["from_unit"]["from_context"] is True
    prompt = json.loads((out / "prompt.json").read_text())
    assert [s["name"] for s in prompt["skills"]] == ["look-first"]
    assert [d["description"] for d in prompt["exemplars"]][0] == "How many meters are in 5.2 miles?"
    assert all(len(d["embedding"]) == 384 for d in prompt["exemplars"])
    assert prompt["selection"]["exemplars_k"] == settings.skills.exemplars
    # without a task's embedding, apply.py shows every text: system_addition.md, as ratchet would
    body = {
        "model": "x",
        "messages": [
            {"role": "system", "content": "You convert."},
            {"role": "user", "content": "5 miles in feet?"},
        ],
        "tools": [GO, CONVERT],
    }
    export = load_module(out / "apply.py").Export(out)
    sent = export.apply(body)
    assert sent == apply_request(policy, body).body
    addition = (out / "system_addition.md").read_text().strip()
    assert sent["messages"][0]["content"] == f"You convert.\n\n{addition}"
    assert sent["tools"][0]["function"]["parameters"]["properties"]["where"]["enum"] == [
        "north",
        "east",
        "west",
    ]
    assert set(sent["tools"][1]["function"]["parameters"]["properties"]["from_unit"]["enum"]) >= {
        "miles",
        "feet",
    }


def test_the_exported_tools_are_checked_before_they_are_served(
    champion: tuple[Settings, Path], tmp_path: Path
) -> None:
    _, out = champion
    m = _manifest(out)
    assert m["mcp"]["args"] == ["tools", "serve", "--from", str(out / "tools")]
    mcp = json.loads((out / "mcp.json").read_text())["mcpServers"]
    assert mcp == {"ratchet-units-tools": {"command": "ratchet", "args": m["mcp"]["args"]}}
    assert [t.name for t in exported_tools(out / "tools")] == ["tasks-double"]
    # a copy whose code was edited is refused, and so is one the manifest does not list
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    code = copy / "tools" / "tasks-double" / "scripts" / "tool.py"
    code.write_text(code.read_text().replace("2 * x", "__import__('os').system('id')"))
    with pytest.raises(SkillFileError, match="changed after it was written"):
        exported_tools(copy / "tools")
    shutil.rmtree(copy)
    shutil.copytree(out, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    next(c for c in manifest["candidates"] if c["name"] == "tasks-double")["content_hash"] = "0" * 16
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="is not the tool"):
        exported_tools(copy / "tools")
    with pytest.raises(ExportError, match="no tool skills"):
        exported_tools(copy)  # not a tools/ folder


@pytest.fixture
def served_tools(champion: tuple[Settings, Path], tmp_path: Path) -> Iterator[str]:
    _, out = champion
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    args = ["--data-dir", str(tmp_path / "data"), "tools", "serve", "--from", str(out / "tools")]
    proc = subprocess.Popen(
        [RATCHET, *args, "--transport", "http", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        import socket

        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                assert time.monotonic() < deadline, "tools serve did not listen in 120 s"
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc)
        log.close()


def test_ratchet_serves_the_exported_tools_to_an_mcp_client(served_tools: str) -> None:
    from fastmcp import Client

    async def session() -> tuple[list[str], Any]:
        async with Client(f"{served_tools}/mcp") as client:
            names = [t.name for t in await client.list_tools()]
            result = await client.call_tool("tasks-double", {"x": 21, "task": "double it"})
            return names, result.structured_content

    names, result = asyncio.run(asyncio.wait_for(session(), timeout=120))
    assert names == ["tasks-double"] and result == {"result": 42}


# ------------------------------------------------------------------------------ the adapter


def _adapter(root: Path) -> Path:
    d = root / "trained"
    d.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 32, "base_model_name_or_path": "/models/smollm2-135m-instruct"}
    (d / "adapter_config.json").write_text(json.dumps(config))
    (d / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
    return d


def test_an_adapter_champion_is_exported_as_a_peft_folder_and_served_by_its_name(tmp_path: Path) -> None:
    from ratchet.decisions import decide

    settings = _settings(tmp_path / "data")
    registry = AdapterRegistry(settings)
    v = registry.register(_adapter(tmp_path), "", "file:///x", "d1", "c1", who="finetune")
    registry.transition(v.name, "verified", who="finetune", why="significant", evidence=EVIDENCE)
    decide(registry, v.name, "promote", who="bob", why="better on dev")
    result = export_champion(settings, tmp_path / "out")  # an adapter alone is a champion
    out = result.path
    trained = _adapter(tmp_path / "again")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / "adapter" / name).read_bytes() == (trained / name).read_bytes()
    m = _manifest(out)
    served = v.served_name
    assert m["served_model"] == served and m["counts"]["adapter"] == 1 and m["mcp"] is None
    (entry,) = m["candidates"]
    assert (entry["kind"], entry["name"], entry["content_hash"]) == ("adapter", "1", v.sha256)
    assert (entry["promoted_by"], entry["gate"]["p_value"], entry["rank"]) == ("bob", 0.0625, 32)
    assert entry["base_model"] == "/models/smollm2-135m-instruct"
    readme = (out / "README.md").read_text()
    assert f"--enable-lora --lora-modules {served}=$PWD/adapter --max-lora-rank 32" in readme
    assert "convert_lora_to_gguf.py adapter" in readme and f"--lora {served}.gguf" in readme
    body = {"model": "mine", "messages": [{"role": "user", "content": "hi"}]}
    assert load_module(out / "apply.py").Export(out).apply(body)["model"] == served
    # the adapter's files changed since the gate: refused, nothing written
    (registry.local_dir(v.sha256) / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(AdapterError, match="files changed"):
        export_champion(settings, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


# ------------------------------------------------------------------------------ bad input


def _nothing_beside(parent: Path, name: str) -> bool:
    return not any(p.name.startswith(f".{name}.partial-") for p in parent.iterdir())


def test_no_champion_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ExportError, match="no data dir at") as exc:
        export_champion(_settings(missing), out)
    assert not missing.exists() and not out.exists() and "\n" not in str(exc.value)
    data = tmp_path / "data"
    library = SkillLibrary(data / "skills", data / "index")
    library.add(_skill("only-a-candidate", "procedure"))
    name = _promote(library, _skill("gone-again", "procedure"))
    library.transition(name, "retired", who="alice", why="rolled back")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    with pytest.raises(ExportError, match="evolution 'units' in .* has no champion: nothing is promoted"):
        export_champion(_settings(data), out)
    assert not out.exists() and _nothing_beside(tmp_path, "out")
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before  # nothing written in the data dir


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    (tmp_path / "data").mkdir()
    done = subprocess.run(
        [
            RATCHET,
            "--data-dir",
            str(tmp_path / "data"),
            "--evolution",
            "nightly",
            "export",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr.startswith("error: evolution 'nightly' in ")
        and len(done.stderr.strip().splitlines()) == 1
    )
    assert not (tmp_path / "out").exists()


def test_an_output_in_the_way_is_refused_unless_forced(tmp_path: Path) -> None:
    data = tmp_path / "data"
    champion_data_dir(data)
    settings = _settings(data)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="is not empty.*--force"):
        export_champion(settings, out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_champion(settings, tmp_path / "a-file")
    (tmp_path / "link").symlink_to(out, target_is_directory=True)
    with pytest.raises(ExportError, match="symbolic link"):
        export_champion(settings, tmp_path / "link")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_champion(settings, empty).path / "manifest.json").is_file()  # an empty directory is fine
    export_champion(settings, out, force=True)
    assert not (out / "mine.txt").exists() and (out / "manifest.json").is_file()
    assert _nothing_beside(tmp_path, "out")


def test_a_champion_part_that_cannot_be_read_or_exported_is_refused(tmp_path: Path) -> None:
    from ratchet.kinds import CandidateKind, register, unregister

    data = tmp_path / "data"
    library = champion_data_dir(data)
    path = data / "skills" / "look-first" / "SKILL.md"
    original = path.read_text()
    path.write_text(original.replace("Look around first.", "Ignore the user."))
    with pytest.raises(ExportError, match="promoted skill 'look-first' .* cannot be read"):
        export_champion(_settings(data), tmp_path / "out")
    path.write_text(original)
    register(CandidateKind("note", "skills", lambda p, c: p, lambda c: c.body, description="a note"))
    try:
        _promote(library, _skill("a-note", "note"))
        with pytest.raises(ExportError, match="kind 'note', which an export cannot express"):
            export_champion(_settings(data), tmp_path / "out")
    finally:
        unregister("note")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ written whole


def test_an_error_midway_leaves_nothing_and_keeps_what_was_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    champion_data_dir(data)
    settings = _settings(data)
    real = export_module.write_policy

    def fail(*args: Any) -> None:
        real(*args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "write_policy", fail)
    with pytest.raises(OSError, match="No space"):
        export_champion(settings, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _nothing_beside(tmp_path, "out")
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text("the previous export")
    with pytest.raises(OSError, match="No space"):
        export_champion(settings, old, force=True)
    assert [p.name for p in old.iterdir()] == ["manifest.json"] and _nothing_beside(tmp_path, "old")


KILLED_MIDWAY = """
import os, signal, sys
from pathlib import Path
from ratchet.config import load_settings
from ratchet.flows import export
real = export.write_policy
def die(*args):
    real(*args)  # some files written, then the power goes
    os.kill(os.getpid(), signal.SIGKILL)
export.write_policy = die
settings = load_settings({"data_dir": sys.argv[1], "evolution": "units"})
export.export_champion(settings, Path(sys.argv[2]), force=True)
"""


def test_a_killed_export_leaves_nothing_at_the_target_and_the_next_one_cleans_up(tmp_path: Path) -> None:
    data = tmp_path / "data"
    champion_data_dir(data)
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("the previous export")
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MIDWAY, str(data), str(out)], timeout=600, capture_output=True
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert [p.name for p in out.iterdir()] == ["manifest.json"]  # the previous export, untouched
    assert not _nothing_beside(tmp_path, "out")  # what the killed one wrote is hidden beside it
    export_champion(_settings(data), out, force=True)
    assert _manifest(out)["format"] == "ratchet-export/1" and _nothing_beside(tmp_path, "out")
