"""`ratchet dashboard`: the generations, the champion, the skill library and its decisions.

Server-rendered pages (Jinja templates, matplotlib SVG plots, one small script) on top of
the HTTP API in `dashboard.api`; the Promote / Reject / Retire buttons call that API, the
same audited, race-safe path as `ratchet skills promote`. Every asset ships in this package:
the page loads nothing from the network. Pages need no token; the buttons send the one the
tab was opened with (`?token=`, see `dashboard.auth`).

    /                       generations (plots, table, MLflow and Prefect links), champion
                            history, skill library with A/B evidence, failure clusters
    /skills/NAME            a candidate: text, evidence pairs, provenance, audit history
    /trajectories/ID        one trajectory, step by step
"""

from __future__ import annotations

import getpass
from collections import Counter
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from ratchet.config import Settings
from ratchet.dashboard.api import create_app, detail
from ratchet.dashboard.auth import matches
from ratchet.dashboard.inputs import one_line
from ratchet.dashboard.plots import cost_svg, success_svg
from ratchet.dashboard.views import ACTIONS, DashboardData, NotFound, prefect_ui
from ratchet.errors import RatchetError, SkillStateError, StateFileError
from ratchet.flows.runtime import champion_policy, open_library
from ratchet.memory.trajectory_store import open_store
from ratchet.skills.library import SkillLibrary

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")


def create_dashboard(settings: Settings, library: SkillLibrary | None = None) -> FastAPI:
    lib = library or open_library(settings)
    data = DashboardData(settings, lib, open_store(settings.trajectories_db))
    app = create_app(settings, lib)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def page(request: Request, name: str, evolution: str | None = None, **context: Any) -> HTMLResponse:
        offered = request.query_params.get("token")
        common = {
            # whether this page's link carried the right token (the script keeps it only then)
            "token_link": "" if offered is None else "ok" if matches(app.state.token, offered) else "wrong",
            "evolution": evolution or settings.evolution,
            "evolutions": data.evolutions(),
            "data_dir": settings.data_dir,
            "who": getpass.getuser(),
            "actions": ACTIONS,
        }
        return templates.TemplateResponse(request, name, common | context)

    @app.exception_handler(RatchetError)
    def ratchet_error(request: Request, exc: RatchetError) -> Response:
        """Something the stores do not have (404) or refuse, e.g. a malformed skill file (422):
        one line and the fix."""
        code = 404 if isinstance(exc, NotFound | SkillStateError) else 422
        if request.url.path.startswith("/api/"):
            return detail(code, str(exc))
        problem, fix = one_line(exc.problem), one_line(exc.fix)
        response = page(request, "error.html", status_code=code, problem=problem, fix=fix)
        response.status_code = code
        return response

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request, evolution: str | None = None) -> HTMLResponse:
        s = data.for_evolution(evolution)
        runs = data.generation_runs(s)  # one MLflow search for the table's links and the clusters
        try:
            generations, journal_error = data.generations(s, runs), ""
        except StateFileError as exc:  # the rest of the page (skills, decisions) still works
            generations, journal_error = [], one_line(str(exc))
        rows = [g.row for g in generations]
        skills, skill_errors = data.skills()
        live = Counter(v.skill.kind for v in skills if v.skill.status == "promoted")
        return page(
            request,
            "overview.html",
            s.evolution,
            generations=generations,
            journal_error=journal_error,
            success_svg=success_svg(rows),
            cost_svg=cost_svg(rows),
            policy=champion_policy(s, lib),
            live=sorted(live.items()),
            champion_history=data.champion_history(s),
            agent_urls=data.agent_urls(s),
            adapters=data.adapters(s),
            skills=skills,
            skill_errors=skill_errors,
            clusters=data.clusters(runs),
            mlflow_url=settings.dashboard.mlflow_url,
            mlflow_uri=settings.mlflow_uri,
            prefect_url=prefect_ui(settings),
            prefect_home=settings.prefect_home,
        )

    @app.get("/skills/{name}", response_class=HTMLResponse)
    def skill_page(request: Request, name: str) -> HTMLResponse:
        view, history, provenance = data.skill(name)
        return page(request, "skill.html", view=view, history=history, provenance=provenance)

    @app.get("/trajectories/{trajectory_id}", response_class=HTMLResponse)
    def trajectory_page(request: Request, trajectory_id: str) -> HTMLResponse:
        return page(request, "trajectory.html", t=data.trajectory(trajectory_id))

    return app
