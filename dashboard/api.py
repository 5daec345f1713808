"""HTTP API for people deciding on candidates (skills and adapters): list, show, promote,
reject, retire, rollback.

The dashboard calls it; anything else may too (it binds to 127.0.0.1, and `dashboard.hosts`
refuses foreign Host names and cross-origin changes: DNS rebinding, CSRF). A change needs the
data dir's token (`dashboard.auth`: `Authorization: Bearer TOKEN`) and a body of at most
`hosts.MAX_BODY`; reads need neither. Every change goes through `ratchet.decisions.decide`,
in the kind's lifecycle, with `expect` set to the status the caller saw, so two people acting
on the same candidate at once get one success and one `409 Conflict`, never a double change.
Errors are one line in `{"detail": ...}`: a refused decision (any `RatchetError`) is a 4xx,
never a 500.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import AfterValidator, BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ratchet.config import Settings
from ratchet.dashboard.auth import TokenRequired, ensure_token
from ratchet.dashboard.hosts import BodyLimit, LoopbackOnly
from ratchet.dashboard.inputs import name_problem, one_line, plain_lines, plain_text
from ratchet.decisions import Action, Candidates
from ratchet.decisions import decide as apply_decision
from ratchet.errors import CandidateStateError, RatchetError, SkillFileError, SkillStateError
from ratchet.flows import agent_versions
from ratchet.flows.runtime import champion_policy, open_library
from ratchet.lifecycle import Status
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import AdapterRegistry, AdapterVersion

Lines = Annotated[str, AfterValidator(plain_lines)]  # text, newlines and tabs allowed
Line = Annotated[str, AfterValidator(plain_text)]  # one line of text


class Decision(BaseModel):
    reason: Lines = Field(min_length=1, max_length=500, description="why (kept in the audit log)")
    by: Line = Field(min_length=1, max_length=100, description="who decides")
    expect: Status | None = Field(default=None, description="the status you saw; a mismatch is a 409")


def create_app(settings: Settings, library: SkillLibrary | None = None) -> FastAPI:
    lib = library or open_library(settings)
    agent_versions.follow(settings, lib)  # MLflow's agent versions and prompts follow every decision
    # No Swagger UI or ReDoc: their pages load scripts from a CDN (no integrity check) on this
    # origin, whose localStorage holds the token. The API's description stays, as JSON.
    app = FastAPI(title="ratchet", docs_url=None, redoc_url=None, openapi_url="/api/openapi.json")
    # outermost last: Host/Origin, then the token, then the body's size, all before the body is read
    app.state.token = ensure_token(settings.data_dir)
    app.add_middleware(BodyLimit)
    app.add_middleware(TokenRequired, token=app.state.token)
    app.add_middleware(LoopbackOnly)
    app.add_middleware(PageHeaders)

    @app.get("/api/docs", include_in_schema=False)
    def docs() -> RedirectResponse:
        """Where `ratchet dashboard` and `ratchet api` point: the description, not a page."""
        return RedirectResponse("/api/openapi.json")

    @app.exception_handler(RatchetError)
    def ratchet_error(request: Request, exc: RatchetError) -> Response:
        """A store or the lifecycle refused (a malformed file, a bad name or reason): 422, or
        404 for a skill that is not there; one line, never a 500."""
        return detail(404 if isinstance(exc, SkillStateError) else 422, str(exc))

    @app.exception_handler(RequestValidationError)
    def invalid(request: Request, exc: RequestValidationError) -> Response:
        """pydantic's list of errors as one line, without echoing the input (it may hold
        text no JSON answer can carry)."""
        lines = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
        return detail(422, "; ".join(lines))

    @app.exception_handler(StarletteHTTPException)
    def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return detail(exc.status_code, str(exc.detail), exc.headers)

    def live() -> str:
        return champion_policy(settings, lib).version

    def load(name: str) -> Any:
        if (problem := name_problem(name)) is not None:
            raise HTTPException(404, problem)
        try:
            return lib.get(name)
        except SkillStateError as exc:
            raise HTTPException(404, str(exc)) from None
        except SkillFileError as exc:
            raise HTTPException(422, str(exc)) from None

    @app.get("/api/skills")
    def skills(status: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        found, _ = lib.scan()
        return [
            {
                "name": s.name,
                "kind": s.kind,
                "status": s.status,
                "family": s.family,
                "generation": s.generation,
                "description": s.description,
                "provenance": len(s.provenance),
            }
            for s in found
            if (status is None or s.status == status) and (kind is None or s.kind == kind)
        ]

    @app.get("/api/skills/{name}")
    def skill(name: str) -> dict[str, Any]:
        s = load(name)
        history = [r.model_dump(mode="json") for r in lib.history(name)]
        return s.model_dump(mode="json") | {"content_hash": s.content_hash, "history": history}

    @app.get("/api/policy")
    def policy() -> dict[str, Any]:
        p = champion_policy(settings, lib)
        return {
            "version": p.version,
            "adapter": p.adapter,
            "promoted": [s.name for s in lib.list(status="promoted")],
        }

    def adapter_json(v: AdapterVersion) -> dict[str, Any]:
        return {
            "version": v.version,
            "status": v.status,
            "champion": v.champion,
            "sha256": v.sha256,
            "dataset": v.dataset,
            "evidence": {k: x for k, x in v.evidence.items() if k != "pairs"},
        }

    def load_adapter(version: int) -> tuple[AdapterRegistry, AdapterVersion]:
        registry = AdapterRegistry(settings)
        try:
            return registry, registry.get(version)
        except CandidateStateError as exc:
            raise HTTPException(404, str(exc)) from None

    @app.get("/api/adapters")
    def adapters() -> list[dict[str, Any]]:
        return [adapter_json(v) for v in AdapterRegistry(settings).list()]

    @app.get("/api/adapters/{version}")
    def adapter(version: int) -> dict[str, Any]:
        registry, v = load_adapter(version)
        history = [r.model_dump(mode="json") for r in registry.lifecycle.records(v.name)]
        return adapter_json(v) | {"history": history}

    def decide(candidates: Candidates, name: str, action: Action, decision: Decision) -> dict[str, Any]:
        before = live()
        try:
            changed = apply_decision(candidates, name, action, decision.by, decision.reason, decision.expect)
        except CandidateStateError as exc:
            raise HTTPException(409, str(exc)) from None
        except RatchetError as exc:  # the lifecycle refused the name, reason or who
            raise HTTPException(422, str(exc)) from None
        return {"changed": changed, "policy_before": before, "policy_after": live()}

    @app.post("/api/skills/{name}/{action}")
    def decide_skill(name: str, action: Action, decision: Decision) -> dict[str, Any]:
        load(name)
        return decide(lib, name, action, decision) | {"status": lib.get(name).status}

    @app.post("/api/adapters/{version}/{action}")
    def decide_adapter(version: int, action: Action, decision: Decision) -> dict[str, Any]:
        registry, _ = load_adapter(version)
        return decide(registry, str(version), action, decision) | {"status": registry.get(version).status}

    return app


# Every answer's: scripts, styles and fetches only from this origin (inline styles: the
# plots are inline SVG), no plug-ins, no framing (a framed page's buttons could be clicked
# for the user), no <base> rewriting where the script comes from.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
PAGE_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
]


class PageHeaders:
    """ASGI middleware: `PAGE_HEADERS` on every answer, refusals included, so a browser
    itself refuses any script from elsewhere on this origin."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in PAGE_HEADERS if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)


def detail(code: int, text: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer: `{"detail": one line}`."""
    return JSONResponse({"detail": one_line(text)}, status_code=code, headers=headers)
