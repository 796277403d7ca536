// The status page: reads /api/status and /api/history every few seconds and redraws. Text from the swarm is only
// ever set as textContent (never parsed as HTML): names and ids come from peers.
"use strict";

const REFRESH_MS = 3000;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function si(value) {
  for (const [factor, suffix] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (Math.abs(value) >= factor) return (value / factor).toFixed(1) + suffix;
  }
  return Math.abs(value) >= 10 || value === 0 ? value.toFixed(0) : value.toFixed(1);
}
const tokens = (v) => `${si(v)} tok/s`;
const checks = (v) => `${si(v)} checks/s`;
const ago = (now, then) => {
  const s = Math.max(0, now - then);
  return s < 120 ? `${s.toFixed(0)}s ago` : s < 7200 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
};
const until = (now, then) => {
  const s = then - now;
  return s <= 0 ? "expired" : s < 7200 ? `in ${(s / 60).toFixed(0)}m` : `in ${(s / 3600).toFixed(1)}h`;
};

function who(names, peer, shortId) {
  const name = names[peer];
  return name ? `${name} (${shortId})` : shortId;
}

function shortOf(peer) {
  return peer.length <= 14 ? peer : `${peer.slice(0, 6)}..${peer.slice(-4)}`;
}

function replicaItem(replica) {
  const state = replica.excluded ? "excluded" : replica.state;
  const item = el(
    "li",
    { class: state, "data-peer": replica.peer_id },
    el("span", { class: "who" }, replica.name ? `${replica.name} ` : "", replica.short_id),
    " ",
    el("span", { class: "fig" }, `${tokens(replica.throughput)} compute, ${tokens(replica.network)} served`),
  );
  if (replica.excluded) item.append(el("span", { class: "tag" }, "EXCLUDED"));
  else if (replica.state !== "online") item.append(el("span", { class: "tag" }, replica.state));
  return item;
}

function renderMap(status) {
  const map = document.getElementById("map");
  const health = status.health;
  const verifiers = Object.fromEntries(status.verifiers.map((v) => [v.peer_id, v]));
  const parts = [];
  for (const stage of status.stage_totals) {
    const verdict = health.stages[stage.stage].verdict;
    const card = el(
      "div",
      { class: `card stage ${verdict}`, "data-stage": String(stage.stage) },
      el("h3", {}, `stage ${stage.stage}`, el("span", { class: `verdict ${verdict}` }, verdict)),
      el(
        "div",
        { class: "sum" },
        `${stage.live_replicas} live, ${tokens(stage.throughput)}, step ${stage.step < 0 ? "-" : stage.step}`,
      ),
      el("ul", {}, ...stage.replicas.map(replicaItem)),
    );
    if (!stage.replicas.length) card.querySelector("ul").append(el("li", {}, "nobody serves this stage"));
    parts.push(card);
    const boundary = status.boundaries[stage.stage];
    if (boundary) {
      const bVerdict = health.boundaries[boundary.boundary].verdict;
      const list = boundary.verifiers.map((peer) => {
        const v = verifiers[peer];
        return el(
          "li",
          { "data-peer": peer },
          el("span", { class: "who" }, v && v.name ? `${v.name} ` : "", v ? v.short_id : shortOf(peer)),
          " ",
          el("span", { class: "fig" }, v ? checks(v.throughput) : ""),
        );
      });
      if (!list.length) list.push(el("li", {}, "no verifier"));
      parts.push(
        el(
          "div",
          { class: `card boundary ${bVerdict}`, "data-boundary": String(boundary.boundary) },
          el("h3", {}, `boundary ${boundary.boundary}|${boundary.boundary + 1}`, el("span", { class: `verdict ${bVerdict}` }, bVerdict)),
          el("ul", {}, ...list),
        ),
      );
    }
  }
  map.replaceChildren(...parts);
  document.getElementById("health").textContent = health.summary;
}

function fillTable(id, headers, rows, empty) {
  const table = document.getElementById(id);
  const head = el("tr", {}, ...headers.map((h) => el("th", {}, h)));
  const body = rows.length
    ? rows
    : [el("tr", {}, el("td", { class: "empty", colspan: String(headers.length) }, empty))];
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...body));
}

function renderTables(status) {
  const now = status.time;
  const names = {};
  for (const list of [status.verifiers, status.trainers, ...Object.values(status.stages)]) {
    for (const a of list) if (a.name) names[a.peer_id] = a.name;
  }
  fillTable(
    "trainers",
    ["trainer", "state", "step", "loss", "validation loss", "trained"],
    status.trainers.map((t) =>
      el(
        "tr",
        {},
        el("td", { class: "mono" }, who(names, t.peer_id, t.short_id)),
        el("td", {}, t.excluded ? "EXCLUDED" : t.state),
        el("td", {}, t.global_step),
        el("td", {}, t.loss === null ? "-" : t.loss.toFixed(4)),
        el("td", {}, t.val_loss === null || t.val_loss === undefined ? "-" : t.val_loss.toFixed(4)),
        el("td", {}, tokens(t.throughput)),
      ),
    ),
    "no trainer announced",
  );
  const bans = Object.values(status.bans);
  fillTable(
    "bans",
    ["peer", "stage", "reason", "boundary", "direction", "banned", "expires", "votes", "voters"],
    bans.map((b) =>
      el(
        "tr",
        { "data-peer": b.peer },
        el("td", { class: "mono" }, b.name ? `${b.name} (${b.short_id})` : b.short_id),
        el("td", {}, b.stage === null ? "-" : b.stage),
        el("td", {}, b.reason),
        el("td", {}, `${b.boundary}|${b.boundary + 1}`),
        el("td", {}, b.direction),
        el("td", {}, ago(now, b.since)),
        el("td", {}, until(now, b.expires)),
        el("td", {}, `${b.votes}/${b.quorum}`),
        el("td", { class: "mono" }, b.voters.map((v) => who(names, v, shortOf(v))).join(", ")),
      ),
    ),
    "no peer is excluded",
  );
  const strikes = Object.values(status.strikes).flat();
  fillTable(
    "strikes",
    ["accused", "verifier", "boundary", "direction", "strikes", "flags / checks", "banned", "vote", "age", "last metrics"],
    strikes.map((r) =>
      el(
        "tr",
        { "data-peer": r.accused },
        el("td", { class: "mono" }, who(names, r.accused, shortOf(r.accused))),
        el("td", { class: "mono" }, who(names, r.verifier, shortOf(r.verifier))),
        el("td", {}, `${r.boundary}|${r.boundary + 1}`),
        el("td", {}, r.direction),
        el("td", {}, r.strikes),
        el("td", {}, `${r.flags} / ${r.checks}`),
        el("td", {}, r.banned ? el("span", { class: "tag bad" }, "banned") : "no"),
        el("td", {}, r.vote ? "yes" : "no"),
        el("td", {}, ago(now, r.time)),
        el(
          "td",
          { class: "mono" },
          Object.entries(r.metrics)
            .sort()
            .map(([m, v]) => `${m} ${v.toPrecision(3)}` + (m in (r.thresholds || {}) ? ` / ${r.thresholds[m].toPrecision(3)}` : ""))
            .join("  "),
        ),
      ),
    ),
    "no strike records",
  );
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function drawChart(id, series) {
  // series: [{points: [[x, y]...], class, dots}]
  const svg = document.getElementById(id);
  const [W, H, L, R, T, B] = [480, 220, 46, 10, 10, 26];
  const all = series.flatMap((s) => s.points);
  const children = [];
  if (!all.length) {
    children.push(svgEl("text", { x: W / 2 - 60, y: H / 2 }));
    children[0].textContent = "no step seen yet";
    svg.replaceChildren(...children);
    return;
  }
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) [y0, y1] = [y0 - 1, y1 + 1];
  const pad = (y1 - y0) * 0.08;
  [y0, y1] = [y0 - pad, y1 + pad];
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  children.push(svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  children.push(svgEl("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    const label = svgEl("text", { x: 2, y: Y(y) + 3 });
    label.textContent = si(y);
    children.push(label, svgEl("line", { class: "axis", x1: L - 3, y1: Y(y), x2: L, y2: Y(y) }));
  }
  for (const x of [x0, Math.round((x0 + x1) / 2), x1]) {
    const label = svgEl("text", { x: X(x) - 8, y: H - 8 });
    label.textContent = `step ${Math.round(x)}`;
    children.push(label);
  }
  for (const s of series) {
    if (!s.points.length) continue;
    children.push(svgEl("polyline", { class: s.class, points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") }));
    if (s.dots) for (const p of s.points) children.push(svgEl("circle", { class: s.dots, cx: X(p[0]), cy: Y(p[1]), r: 2.5 }));
  }
  svg.replaceChildren(...children);
}

function renderHistory(history) {
  const points = history.points;
  const loss = points.filter((p) => p.loss !== null).map((p) => [p.step, p.loss]);
  const val = points.filter((p) => p.val_loss !== null);
  const valByStep = new Map(val.map((p) => [p.step, p.val_loss]));
  drawChart("loss-chart", [
    { points: loss, class: "train" },
    { points: [...valByStep.entries()], class: "val", dots: "valdot" },
  ]);
  drawChart("rate-chart", [{ points: points.map((p) => [p.step, p.tokens_per_s]), class: "rate" }]);
}

async function refresh() {
  try {
    const [statusResponse, historyResponse] = await Promise.all([fetch("/api/status"), fetch("/api/history")]);
    const status = await statusResponse.json();
    if (status.error) throw new Error(status.error);
    document.getElementById("swarm").textContent = `${status.swarm} (config ${status.config_hash})`;
    const badge = document.getElementById("verdict");
    badge.textContent = status.health.verdict;
    badge.className = `badge ${status.health.verdict}`;
    const read = status.read || {};
    document.getElementById("meta").textContent =
      `read ${new Date(status.time * 1000).toISOString().replace("T", " ").slice(0, 19)} UTC in ` +
      `${(read.seconds || 0).toFixed(1)}s, every ${read.every}s` + (read.error ? ` (last read failed: ${read.error})` : "");
    document.getElementById("quorum").textContent = `${Object.keys(status.bans).length} excluded`;
    renderMap(status);
    renderTables(status);
    renderHistory(await historyResponse.json());
    document.body.dataset.loaded = "yes";
  } catch (error) {
    document.getElementById("verdict").textContent = "unreadable";
    document.getElementById("meta").textContent = String(error);
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
