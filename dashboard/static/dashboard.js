// Promote / Reject / Retire / Rollback: each button posts to the HTTP API the CLI's path uses
// (`POST /api/skills/NAME/ACTION` or `/api/adapters/VERSION/ACTION` → ratchet.decisions.decide),
// with `expect` set to the status this page shows, so a decision someone else made meanwhile
// comes back as 409, not a double change. A row says what it decides on: data-kind (skills or
// adapters) and data-candidate (the name or version).
//
// A change needs the data dir's token (dashboard/auth.py says why this way): `ratchet dashboard`
// prints the URL with `?token=…`; when the server says it is the right one (data-token-link on
// <body>), this origin's localStorage keeps it, the address bar loses it, and every decision
// sends it as `Authorization: Bearer`. The browser never sends it by itself.
"use strict";

const TOKEN_KEY = "ratchet.token";
const OPEN_URL = "open the URL `ratchet dashboard` printed (…/?token=…)";

const ACTIONS = JSON.parse(document.getElementById("actions")?.textContent || "{}");
const who = document.getElementById("who");
const why = document.getElementById("why");
const message = document.getElementById("decision-message");

if (who && localStorage.getItem("ratchet.who")) who.value = localStorage.getItem("ratchet.who");

function say(text, isError) {
  if (!message) return;
  message.textContent = text;
  message.className = isError ? "error" : "ok";
}

const link = new URL(location.href);
if (link.searchParams.has("token")) {
  if (document.body.dataset.tokenLink === "ok") localStorage.setItem(TOKEN_KEY, link.searchParams.get("token"));
  link.searchParams.delete("token");
  history.replaceState(history.state, "", link.pathname + link.search + link.hash);
}
if (document.body.dataset.tokenLink === "wrong") {
  say(`The token in that link is not this dashboard's: ${OPEN_URL}`, true);
}

function showStatus(row, status) {
  row.dataset.status = status;
  const cell = row.querySelector("td.status");
  cell.textContent = status;
  cell.className = `status status-${status}`;
  const actions = row.querySelector("td.actions");
  actions.replaceChildren(
    ...(ACTIONS[status] || []).map((action) => {
      const b = document.createElement("button");
      b.type = "button";
      b.dataset.action = action;
      b.textContent = action[0].toUpperCase() + action.slice(1);
      return b;
    }),
  );
}

// Which adapter is the champion follows from the decision on another row: ask the API again.
async function showChampion() {
  const response = await fetch("/api/adapters");
  if (!response.ok) return;
  for (const a of await response.json()) {
    const cell = document.querySelector(`tr[data-kind="adapters"][data-candidate="${a.version}"] td.champion`);
    if (cell) cell.textContent = a.champion ? "★" : "";
  }
}

async function decide(row, action) {
  const kind = row.dataset.kind;
  const name = kind === "adapters" ? `adapter v${row.dataset.candidate}` : row.dataset.candidate;
  const url = `/api/${kind}/${encodeURIComponent(row.dataset.candidate)}`;
  const seen = row.dataset.status;
  if (!why.value.trim()) {
    say("Say why first: the reason is kept in the audit log.", true);
    why.focus();
    return;
  }
  if (!who.value.trim()) {
    say("Say who decides.", true);
    who.focus();
    return;
  }
  const token = localStorage.getItem(TOKEN_KEY);
  if (!token) {
    say(`${name}: this tab has no token for deciding: ${OPEN_URL}`, true);
    return;
  }
  localStorage.setItem("ratchet.who", who.value.trim());
  row.querySelectorAll("button").forEach((b) => (b.disabled = true));
  try {
    const response = await fetch(`${url}/${action}`, {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${token}` },
      body: JSON.stringify({ reason: why.value.trim(), by: who.value.trim(), expect: seen }),
    });
    const body = await response.json();
    if (response.ok) {
      showStatus(row, body.status);
      if (kind === "adapters") await showChampion();
      say(`${name}: ${seen} → ${body.status} (policy ${body.policy_before} → ${body.policy_after})`, false);
      return;
    }
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    say(`${name}: ${detail}`, true);
    const now = await fetch(url);
    if (now.ok) showStatus(row, (await now.json()).status); // show what it is now
  } catch (err) {
    say(`${name}: no answer from the dashboard server (${err}); reload to see its status`, true);
  } finally {
    row.querySelectorAll("button").forEach((b) => (b.disabled = false));
  }
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  const row = button?.closest("[data-candidate]");
  if (row) decide(row, button.dataset.action);
});

// The overview follows a running evolution: reload every `data-refresh` seconds, unless a
// person is writing a decision.
const refresh = Number(document.body.dataset.refresh || 0);
if (refresh > 0) {
  setInterval(() => {
    const typing = document.activeElement?.tagName === "INPUT" || (why && why.value.trim());
    if (!typing && !document.hidden) location.reload();
  }, refresh * 1000);
}
