// rbpipe view: one script for the live page (data from /api/..., polled) and the --html file (window.RBPIPE_DATA).
"use strict";
(function () {
  const SNAPSHOT = window.RBPIPE_DATA || null;
  const PAGE = 100;
  const POLL_MS = 1500;
  const $ = (id) => document.getElementById(id);
  const view = { where: "", offset: 0, upto: -1, total: 0, version: null, open: null, seen: -1 };

  async function api(path, params) {
    const query = new URLSearchParams(params || {}).toString();
    const res = await fetch(path + (query ? "?" + query : ""), { cache: "no-store" });
    const doc = await res.json();
    if (!res.ok) throw new Error(doc.error || res.statusText);
    return doc;
  }

  // Where the data comes from: the server (SQL runs there) or the rows embedded in this file.
  const source = SNAPSHOT ? {
    state: async () => SNAPSHOT.state,
    groups: async (p) => ({
      rows: SNAPSHOT.page.rows.slice(p.offset, p.offset + PAGE), total: SNAPSHOT.page.rows.length,
      newer: 0, upto: SNAPSHOT.page.upto, offset: p.offset, where: SNAPSHOT.page.where,
    }),
    group: async (seq) => {
      const doc = SNAPSHOT.groups[String(seq)];
      if (!doc) throw new Error("group seq " + seq + " is not in this file");
      return doc;
    },
    plot: async () => SNAPSHOT.plot,
  } : {
    state: () => api("api/state"),
    groups: (p) => api("api/groups", { where: p.where, offset: p.offset, limit: PAGE, upto: p.upto }),
    group: (seq) => api("api/group", { seq: seq }),
    plot: (where) => api("api/plot", { where: where }),
  };

  function fmt(x) {
    if (x === null || x === undefined) return "null";
    if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(4);
    if (typeof x === "boolean") return x ? "true" : "false";
    if (Array.isArray(x)) return x.map(fmt).join(" ");
    return String(x);
  }

  function cell(tr, text, cls, title) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (title) td.title = title;
    tr.appendChild(td);
    return td;
  }

  function versions(r) {
    if (r.version_min === null || r.version_min === undefined) return "null";
    return r.version_min === r.version_max ? fmt(r.version_min) : fmt(r.version_min) + "–" + fmt(r.version_max);
  }

  function renderGroups(doc, fresh) {
    const body = $("groups").tBodies[0];
    const rows = [];
    for (const r of doc.rows) {
      const tr = document.createElement("tr");
      tr.dataset.groupId = r.group_id === null ? "" : String(r.group_id);
      tr.dataset.seq = String(r.seq);
      tr.dataset.meanReward = r.mean_reward === null ? "" : String(r.mean_reward);
      if (r.seq === view.open) tr.classList.add("open");
      if (fresh && r.seq > view.seen && view.seen >= 0) tr.classList.add("fresh");
      cell(tr, fmt(r.seq), "num");
      cell(tr, fmt(r.group_id), "num");
      cell(tr, r.prompt_kind === "evicted" ? "(evicted)" : r.prompt, "prompt", r.prompt);
      cell(tr, versions(r), "num");
      cell(tr, r.mean_reward === null ? "null" : r.mean_reward.toFixed(4), "num");
      cell(tr, fmt(r.members), "num");
      cell(tr, r.live ? "no" : "evicted");
      tr.addEventListener("click", () => openGroup(r.seq));
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    for (const r of doc.rows) view.seen = Math.max(view.seen, r.seq);
    view.total = doc.total;
    view.upto = doc.upto;
    const last = Math.min(doc.offset + doc.rows.length, doc.total);
    $("page-info").innerHTML = "";
    const info = $("page-info");
    info.append("groups " + (doc.total ? doc.offset + 1 : 0) + "–" + last + " of ");
    const total = document.createElement("span");
    total.id = "total";
    total.textContent = String(doc.total);
    info.append(total, doc.where ? " matching the filter" : "");
    $("prev").disabled = doc.offset === 0;
    $("newest").disabled = doc.offset === 0 && !doc.newer;
    $("next").disabled = last >= doc.total;
    $("newer-note").textContent = doc.newer ? doc.newer + " newer group" + (doc.newer === 1 ? "" : "s") +
      " (Newest shows them)" : "";
  }

  async function loadGroups(fresh) {
    const doc = await source.groups({ where: view.where, offset: view.offset, upto: view.upto });
    renderGroups(doc, fresh);
    return doc;
  }

  async function loadPlot() {
    const p = await source.plot(view.where);
    const div = $("plot");
    if (!window.Plotly) { div.textContent = "plot library not loaded"; return; }
    const traces = [];
    const spec = [["r", "reward", "y", "#1f77b4"], ["a", "advantage", "y2", "#d62728"]];
    for (const [k, name, axis, color] of spec) {
      traces.push({
        type: "box", name: name, x: p.v, q1: p[k + "_q1"], median: p[k + "_med"], q3: p[k + "_q3"],
        lowerfence: p[k + "_min"], upperfence: p[k + "_max"], mean: p[k + "_mean"], yaxis: axis,
        xaxis: axis === "y" ? "x" : "x2", marker: { color: color }, line: { color: color },
        hovertemplate: "version %{x}<br>" + name + " median %{median:.3f}<extra></extra>",
      });
      traces.push({  // the mean as a line: with 0/1 rewards the boxes collapse onto 0 or 1
        type: "scatter", mode: "lines+markers", name: name + " mean", x: p.v, y: p[k + "_mean"], yaxis: axis,
        xaxis: axis === "y" ? "x" : "x2", line: { color: "#444", width: 1 }, marker: { size: 4, color: "#444" },
        hovertemplate: "version %{x}<br>" + name + " mean %{y:.3f}<extra></extra>",
      });
    }
    const n = (p.n || []).reduce((a, b) => a + b, 0);
    const layout = {
      margin: { l: 56, r: 16, t: 30, b: 36 }, showlegend: false,
      title: { text: "reward and advantage per policy version (" + n + " trajectories of live groups" +
        (p.where ? " matching the filter" : "") + ")", font: { size: 13 } },
      grid: { rows: 1, columns: 2, pattern: "independent" },
      xaxis: { title: { text: "policy version" } }, xaxis2: { title: { text: "policy version" } },
      yaxis: { title: { text: "reward" } }, yaxis2: { title: { text: "advantage" } },
    };
    window.Plotly.react(div, traces, layout, { displaylogo: false, responsive: true });
  }

  async function openGroup(seq) {
    view.open = seq;
    for (const tr of $("groups").tBodies[0].rows) tr.classList.toggle("open", tr.dataset.seq === String(seq));
    const sec = $("group");
    sec.hidden = false;
    sec.dataset.seq = String(seq);
    try {
      const doc = await source.group(seq);
      const g = doc.group;
      sec.dataset.groupId = g.group_id === null ? "" : String(g.group_id);
      $("group-title").textContent = "group " + fmt(g.group_id) + " (seq " + g.seq + ", " + g.members +
        " members, mean reward " + (g.mean_reward === null ? "null" : g.mean_reward.toFixed(4)) + (g.live ? "" : ", evicted") + ")";
      $("group-prompt").textContent = (g.prompt_kind === "tokens" ? "prompt token ids: " : "prompt: ") + g.prompt;
      const head = document.createElement("tr");
      for (const c of doc.columns) {
        const th = document.createElement("th");
        th.textContent = c;
        head.appendChild(th);
      }
      $("members").tHead.replaceChildren(head);
      const rows = doc.members.map((m) => {
        const tr = document.createElement("tr");
        tr.dataset.member = String(m.member);
        for (const c of doc.columns) {
          const v = m[c];
          cell(tr, fmt(v), typeof v === "number" ? "num" : "text");
        }
        return tr;
      });
      if (!g.live) $("group-prompt").textContent = "evicted by the store's retention: its members are gone";
      $("members").tBodies[0].replaceChildren(...rows);
    } catch (err) {
      $("group-title").textContent = String(err.message || err);
      $("members").tBodies[0].replaceChildren();
    }
  }

  function showError(msg) {
    const el = $("filter-error");
    el.textContent = msg ? String(msg).split("\n")[0] : "";
    el.hidden = !msg;
  }

  function showState(s) {
    const what = s.groups + " groups (" + s.evicted + " evicted) · " + s.rows + " trajectories";
    $("status").className = "";
    $("status").textContent = SNAPSHOT
      ? "snapshot written " + SNAPSHOT.written + " · " + what + " · this file holds " + SNAPSHOT.page.rows.length +
        " of them" + (SNAPSHOT.page.where ? " (filter " + SNAPSHOT.page.where + ")" : "")
      : "live · " + what + " · checked " + new Date().toLocaleTimeString();
    const run = s.run;
    if (run) {
      const parts = ["run " + run.run_dir];
      for (const k of ["status", "learner_steps", "groups_written", "groups_dropped"]) {
        if (run[k] !== undefined) parts.push(k + " " + fmt(run[k]));
      }
      if (run.groups_dropped !== undefined) parts.push("(dropped groups are never stored, so not listed)");
      $("run").textContent = parts.join(" · ");
    }
  }

  async function apply(where) {
    const before = { where: view.where, offset: view.offset, upto: view.upto };
    Object.assign(view, { where: where, offset: 0, upto: -1 });
    try {
      await loadGroups(false);
      showError("");
      await loadPlot();
    } catch (err) {
      Object.assign(view, before);
      showError(err.message || err);
    }
  }

  async function poll() {
    try {
      const s = await source.state();
      showState(s);
      const version = JSON.stringify(s.version);
      if (version !== view.version) {
        view.version = version;
        if (view.offset === 0) view.upto = -1;  // on the newest page: follow the writers
        await loadGroups(true);
        await loadPlot();
      }
    } catch (err) {
      $("status").className = "error";
      $("status").textContent = "cannot reach rbpipe view (" + (err.message || err) + "); retrying";
    }
    setTimeout(poll, POLL_MS);
  }

  function wire() {
    $("filter-form").addEventListener("submit", (e) => { e.preventDefault(); apply($("filter").value.trim()); });
    $("clear").addEventListener("click", () => { $("filter").value = ""; apply(""); });
    const shown = (promise) => promise.catch((err) => showError(err.message || err));
    $("next").addEventListener("click", () => { view.offset += PAGE; shown(loadGroups(false)); });
    $("prev").addEventListener("click", () => {
      view.offset = Math.max(0, view.offset - PAGE);
      shown(loadGroups(false));
    });
    $("newest").addEventListener("click", () => { view.offset = 0; view.upto = -1; shown(loadGroups(true)); });
    if (SNAPSHOT) {
      $("filter").value = SNAPSHOT.page.where || "";
      $("filter").disabled = $("apply").disabled = $("clear").disabled = true;
      $("filter-note").textContent = "This file is a snapshot: its groups were chosen when it was written (" +
        "rbpipe view PATH --html OUT --where CONDITION); filters run on a live rbpipe view.";
    }
  }

  async function start() {
    wire();
    const initial = SNAPSHOT ? "" : (new URLSearchParams(location.search).get("where") || "");
    if (initial) { $("filter").value = initial; view.where = initial; }
    try {
      const s = await source.state();
      view.version = JSON.stringify(s.version);  // what the first page shows; a poll reloads past it
      showState(s);
      await loadGroups(false);
      await loadPlot();
    } catch (err) {
      showError(err.message || err);
    }
    document.body.dataset.ready = "1";
    if (!SNAPSHOT) setTimeout(poll, POLL_MS);
  }

  start();
})();
