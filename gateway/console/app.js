// The gateway's web console: plain ES2020, no build step, no dependency.
// Served with `Content-Security-Policy: default-src 'self'`: no inline script or style, no eval.
// Every value from the server reaches the page as text (textContent, createElement, append of a
// string), never as markup: a model named `<img src=x onerror=...>` shows as those characters.
"use strict";

(() => {
  // The key lives in this closure only: never in storage, a cookie or a URL. It is sent as
  // `Authorization: Bearer` on each /admin call, and forgotten at log out or on a reload.
  let key = null;
  let role = null;
  let generation = 0; // bumped on each view change and at log out: late answers are dropped
  let timer = null; // the current view's next refresh
  const REFRESH_MS = 5000;
  const DASH = "—";

  const $ = (sel) => document.querySelector(sel);

  // el("td", {className: "num"}, "text", node, [more]): props are set as DOM properties
  // (`on...` ones as listeners), children appended as nodes or text nodes.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (k === "dataset") Object.assign(node.dataset, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node[k] = v;
    }
    node.append(...flat(children));
    return node;
  }

  // Nodes and strings (as text) from nested arrays; null, undefined and false are skipped.
  const flat = (children) => children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false)
    .map((c) => (c instanceof Node ? c : String(c)));

  // Replaces what `node` holds by `children` (as el() takes them).
  function fill(node, ...children) {
    node.replaceChildren(...flat(children));
    return node;
  }

  const pad = (n) => String(n).padStart(2, "0");
  function fmtTime(s) {
    if (s === null || s === undefined) return DASH;
    const d = new Date(s * 1000);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function fmtNum(v, digits = 1) {
    if (v === null || v === undefined) return DASH;
    if (typeof v !== "number") return String(v);
    return Number.isInteger(v) ? String(v) : v.toFixed(digits);
  }
  const fmtPct = (v) => (v === null || v === undefined ? DASH : `${(v * 100).toFixed(1)} %`);
  function fmtUsd(v) {
    if (v === null || v === undefined) return DASH;
    const n = Number(v);
    return n === 0 || n >= 0.01 ? `$${n.toFixed(2)}` : `$${n.toPrecision(2)}`;
  }
  function fmtValue(v) {
    if (v === null || v === undefined) return DASH;
    if (Array.isArray(v) && v.every((x) => typeof x === "string")) return v.length ? v.join(", ") : DASH;
    return typeof v === "object" ? JSON.stringify(v) : String(v);
  }
  // {a: 1, b: {c: 2}} -> "a=1 b.c=2": limits and load readings in one cell.
  function compact(v) {
    if (v === null || v === undefined) return DASH;
    if (typeof v !== "object") return String(v);
    const parts = [];
    const walk = (o, path) => {
      for (const [k, x] of Object.entries(o)) {
        const p = path ? `${path}.${k}` : k;
        if (x && typeof x === "object" && !Array.isArray(x)) walk(x, p);
        else parts.push(`${p}=${Array.isArray(x) ? x.join(",") : x}`);
      }
    };
    walk(v, "");
    return parts.length ? parts.join(" ") : DASH;
  }

  const num = (v, digits) => el("td", { className: "num" }, fmtNum(v, digits));
  const cell = (c) => (c instanceof HTMLTableCellElement ? c : el("td", {}, c));
  const row = (cells, props) => el("tr", props, cells.map(cell));
  const table = (heads, rows) =>
    el("table", {}, el("thead", {}, el("tr", {}, heads.map((h) => el("th", { scope: "col" }, h)))), el("tbody", {}, rows));
  const stat = (label, value) => el("div", {}, el("dt", {}, label), el("dd", {}, value));
  const health = (state) => (state === null || state === undefined ? DASH
    : el("span", { className: "health", dataset: { health: String(state) } }, state));
  const byName = ([a], [b]) => a.localeCompare(b);
  const label = (text, control) => el("label", {}, el("span", {}, text), control);
  function say(node, message, kind = "error") {
    node.className = kind;
    node.textContent = message;
  }

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // One /admin call with the key. JSON answers are parsed (`as: "blob"` for a download); an error
  // answer throws ApiError with the API's message; a 401 after login logs out.
  async function api(path, { method = "GET", json, text, type, as = "json" } = {}) {
    const sent = key;
    const headers = { Authorization: `Bearer ${sent}` };
    let body;
    if (json !== undefined) {
      body = JSON.stringify(json);
      headers["Content-Type"] = "application/json";
    } else if (text !== undefined) {
      body = text;
      headers["Content-Type"] = type;
    }
    const r = await fetch(path, { method, headers, body, cache: "no-store", credentials: "omit" });
    if (!r.ok) {
      let message = `${r.status} ${r.statusText}`;
      try {
        const e = await r.json();
        if (e && e.error && e.error.message) message = String(e.error.message);
      } catch (_) {
        // not JSON: the status line says it
      }
      if (r.status === 401 && path !== "/admin/whoami" && key !== null && key === sent) {
        logout(`Logged out: the key is no longer accepted (${message}).`);
      }
      throw new ApiError(r.status, message);
    }
    if (r.status === 204) return null;
    return as === "blob" ? r.blob() : r.json();
  }

  // Runs `load` now and again every REFRESH_MS while the view that started it is shown.
  function every(alive, load) {
    const tick = async () => {
      await load();
      if (alive()) timer = setTimeout(tick, REFRESH_MS);
    };
    tick();
  }

  // A view's parts: a note line (errors, last update) above a box its loads replace.
  function panel(view) {
    const note = el("p", { className: "note", role: "status" });
    const box = el("div", {}, "Loading…");
    view.append(note, box);
    return { note, box, updated: () => say(note, `Updated ${fmtTime(Date.now() / 1000)}`, "note") };
  }

  function overview(view, alive) {
    const { note, box, updated } = panel(view);
    every(alive, async () => {
      try {
        const [ov, bk] = await Promise.all([api("/admin/overview"), api("/admin/backends")]);
        if (!alive()) return;
        const states = bk.backends || {};
        const stats = ov.backends || {};
        // The policy's backends, then any other name the log counts (a backend a reload
        // removed): those have no health.
        const names = Object.keys(states).sort();
        const others = Object.keys(stats).filter((n) => !(n in states)).sort();
        fill(box,
          el("dl", { className: "stats" },
            stat(`Requests (last ${ov.window_s} s)`, fmtNum(ov.requests)),
            stat("Rate", `${fmtNum(ov.rate_per_s, 2)} /s`),
            stat("Errors", fmtNum(ov.errors)),
            "client_errors" in ov ? stat("Client errors", fmtNum(ov.client_errors)) : null,
            stat("Error ratio", fmtPct(ov.error_ratio)),
            stat("Cache hit ratio", fmtPct(ov.cache_hit_ratio)),
            stat("Unrouted", fmtNum(ov.unrouted)),
            stat("Policy generation", fmtNum(bk.policy_generation))),
          table(["Backend", "Health", "Ejections in a row", "Requests", "Errors", "TTFT p50 (ms)", "TTFT p95 (ms)",
            "Latency p50 (ms)", "Latency p95 (ms)"],
            [...names, ...others].map((n) => {
              const h = states[n] || {};
              const s = stats[n] || {};
              return row([n, health(h.health), num(h.ejections_in_a_row), num(s.requests), num(s.errors),
                num(s.ttft_ms_p50), num(s.ttft_ms_p95), num(s.latency_ms_p50), num(s.latency_ms_p95)],
                { className: n in states ? "" : "other" });
            })),
          ov.sampled ? el("p", { className: "hint" }, "Figures from a sample of the log's entries.") : null);
        updated();
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    });
  }

  function backends(view, alive) {
    const { note, box, updated } = panel(view);
    const queued = (q) => (q && typeof q === "object" ? Object.values(q).reduce((a, b) => a + b, 0) : q);
    every(alive, async () => {
      try {
        const bk = await api("/admin/backends");
        if (!alive()) return;
        const a = bk.admission || {};
        fill(box,
          el("dl", { className: "stats" },
            stat("Policy generation", fmtNum(bk.policy_generation)),
            stat("Workers", fmtNum(bk.workers_total)),
            stat("Admission in flight", `${fmtNum(a.inflight)} / ${fmtNum(a.max_inflight)}`),
            stat("Admission queued", fmtNum(queued(a.queued)))),
          table(["Backend", "URL", "Health", "Consecutive failures", "Ejections in a row", "Cooling (s)", "In flight",
            "Queued", "Max concurrency", "Local", "Models", "Load"],
            Object.entries(bk.backends || {}).sort(byName).map(([n, b]) => row([
              n, b.url, health(b.health), num(b.consecutive_failures), num(b.ejections_in_a_row), num(b.cooling_s),
              num(b.inflight), num(queued(b.queued)), num(b.max_concurrency), b.local ? "yes" : "no",
              Object.entries(b.models || {}).map(([m, s]) => `${m}: ${s.health}`).join(", ") || DASH,
              compact(b.load),
            ]))));
        updated();
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    });
  }

  function tenants(view, alive) {
    const { note, box, updated } = panel(view);
    const use = (u) => el("ul", { className: "plain" }, Object.entries(u || {}).map(([scope, x]) =>
      el("li", {}, `${scope}: ${x.requests_60s} req and ${x.tokens_60s} tokens in 60 s, ${x.inflight} in flight, ${x.tokens_today} tokens today`)));
    every(alive, async () => {
      try {
        const t = await api("/admin/tenants");
        if (!alive()) return;
        fill(box, table(["Tenant", "Limits", "Use", "Spend today"],
          Object.entries(t.tenants || {}).sort(byName).map(([n, x]) => row([
            n, x.limits ? compact(x.limits) : "no limits", x.use ? use(x.use) : DASH,
            x.use && x.use.tenant ? fmtUsd(x.use.tenant.spend_today_usd) : DASH,
          ]))));
        updated();
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    });
  }

  async function keys(view, alive) {
    const admin = role === "admin";
    const note = el("p", { className: "note", role: "status" });
    const secret = el("div", { className: "secret", hidden: true });
    const list = el("div", {}, "Loading…");
    const st = { before: null, next: null, older: [] }; // the listing's pages, as the request log's
    const filter = el("select", { name: "tenant-filter", onchange: () => { Object.assign(st, { before: null, older: [] }); load(); } },
      el("option", { value: "" }, "All tenants"));
    const newer = el("button", { type: "button", disabled: true, onclick: () => { st.before = st.older.pop() ?? null; load(); } }, "Newer");
    const next = el("button", { type: "button", disabled: true, onclick: () => { st.older.push(st.before); st.before = st.next; load(); } }, "Next page");
    let names = [];
    try {
      names = Object.keys((await api("/admin/tenants")).tenants || {}).sort();
    } catch (err) {
      say(note, err.message);
    }
    if (!alive()) return;
    filter.append(...names.map((n) => el("option", { value: n }, n)));

    // A new secret, shown once: it lives in this box only, gone when the view is left.
    function reveal(title, k) {
      const copy = el("button", { type: "button" }, "Copy");
      copy.addEventListener("click", () => {
        const failed = () => { copy.textContent = "Copy failed: select the text"; };
        // navigator.clipboard exists only in a secure context (https, or localhost)
        if (!navigator.clipboard) failed();
        else navigator.clipboard.writeText(k.key).then(() => { copy.textContent = "Copied"; }, failed);
      });
      fill(secret,
        el("h3", {}, title),
        el("p", {}, "Copy this key now: it will not be shown again."),
        el("code", { className: "key" }, k.key),
        el("p", {}, `id ${k.id}, tenant ${k.tenant}, name ${k.name}, expires ${fmtTime(k.expires_at)}, models ${k.models ? k.models.join(", ") : "all"}`),
        copy,
        el("button", { type: "button", onclick: () => { fill(secret); secret.hidden = true; } }, "Hide"));
      secret.hidden = false;
    }

    async function act(promise, title) {
      try {
        const k = await promise;
        if (!alive()) return;
        if (k) reveal(title, k);
        await load();
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    }

    function actions(k) {
      const box = el("span", { className: "actions" });
      const path = `/admin/keys/${encodeURIComponent(k.id)}`;
      const idle = () => fill(box,
        el("button", { type: "button", onclick: confirmRotate }, "Rotate"),
        el("button", { type: "button", onclick: confirmRevoke }, "Revoke"));
      // A rotation ends the old secret (at once, or after an hour's grace): asked like a revoke.
      const rotate = (grace) => act(api(`${path}/rotate`, { method: "POST", json: { grace_s: grace } }), `Rotated key ${k.name}`);
      function confirmRotate() {
        fill(box,
          el("span", {}, "New secret; the old one stops:"),
          el("button", { type: "button", className: "danger", onclick: () => rotate(0) }, "Confirm"),
          el("button", { type: "button", onclick: () => rotate(3600) }, "In 1 hour"),
          el("button", { type: "button", onclick: idle }, "Cancel"));
      }
      function confirmRevoke() {
        fill(box,
          el("span", {}, "Revoke it?"),
          el("button", { type: "button", className: "danger", onclick: () => act(api(path, { method: "DELETE" })) }, "Confirm"),
          el("button", { type: "button", onclick: idle }, "Cancel"));
      }
      idle();
      return box;
    }

    function keyRow(k) {
      const expired = k.expires_at !== null && k.expires_at !== undefined && k.expires_at * 1000 < Date.now();
      const status = k.revoked ? "revoked" : expired ? "expired" : "active";
      const cells = [k.id, k.tenant, k.name, fmtTime(k.created_at), fmtTime(k.expires_at), fmtTime(k.last_used_at),
        el("span", { className: "status", dataset: { status } }, k.previous_secret_until && !k.revoked
          ? `${status} (previous secret until ${fmtTime(k.previous_secret_until)})` : status),
        k.models ? k.models.join(", ") : "all"];
      if (admin) cells.push(k.revoked ? "" : actions(k));
      return row(cells, { dataset: { key: k.id } });
    }

    async function load() {
      try {
        const q = new URLSearchParams({ limit: "100" });
        if (filter.value) q.set("tenant", filter.value);
        if (st.before !== null) q.set("before", st.before);
        const page = await api(`/admin/keys?${q}`);
        if (!alive()) return;
        st.next = page.next ?? null;
        next.disabled = st.next === null;
        newer.disabled = st.older.length === 0;
        const data = page.data || [];
        const heads = ["ID", "Tenant", "Name", "Created", "Expires", "Last used", "Status", "Models"];
        if (admin) heads.push("Actions");
        fill(list, data.length ? table(heads, data.map(keyRow)) : el("p", {}, "No keys."));
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    }

    view.append(note, secret);
    if (admin) view.append(createForm(names, (k) => act(Promise.resolve(k), `New key ${k.name}`)));
    view.append(label("Show tenant", filter), list, el("div", { className: "pager" }, newer, next));
    await load();
  }

  function createForm(names, created) {
    const tenant = el("select", { name: "tenant", required: true }, names.map((n) => el("option", { value: n }, n)));
    const name = el("input", { name: "name", required: true, maxLength: 200, autocomplete: "off" });
    const expires = el("input", { name: "expires_in_s", type: "number", min: "1", step: "1", placeholder: "never" });
    const models = el("input", { name: "models", placeholder: "all models", autocomplete: "off" });
    const error = el("p", { className: "error", role: "alert" });
    const submit = el("button", { type: "submit" }, "Create key");
    const form = el("form", { className: "create" }, el("h3", {}, "Create a key"),
      label("Tenant", tenant), label("Name", name), label("Expires in (s, optional)", expires),
      label("Models (comma-separated, optional)", models), submit, error);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = { tenant: tenant.value, name: name.value.trim() };
      if (expires.value) body.expires_in_s = Number(expires.value);
      const list = models.value.split(",").map((m) => m.trim()).filter(Boolean);
      if (list.length) body.models = list;
      error.textContent = "";
      submit.disabled = true;
      try {
        const k = await api("/admin/keys", { method: "POST", json: body });
        form.reset();
        await created(k);
      } catch (err) {
        error.textContent = err.message;
      } finally {
        submit.disabled = false;
      }
    });
    return form;
  }

  function requests(view, alive) {
    const FILTERS = ["tenant", "model", "status"];
    const st = { before: null, next: null, older: [] }; // older: the cursors of the pages before this one
    const inputs = Object.fromEntries(FILTERS.map((f) => [f, el("input", { name: f, autocomplete: "off", placeholder: "any" })]));
    const note = el("p", { className: "note", role: "status" });
    const list = el("div", {}, "Loading…");
    const details = el("section", { className: "details", hidden: true });
    const newer = el("button", { type: "button", disabled: true, onclick: () => { st.before = st.older.pop() ?? null; load(); } }, "Newer");
    const next = el("button", { type: "button", disabled: true, onclick: () => { st.older.push(st.before); st.before = st.next; load(); } }, "Next page");
    const form = el("form", { className: "filters" }, FILTERS.map((f) => label(f[0].toUpperCase() + f.slice(1), inputs[f])),
      el("button", { type: "submit" }, "Apply"), el("button", { type: "button", onclick: download }, "Export"));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      Object.assign(st, { before: null, older: [] });
      load();
    });
    view.append(form, note, list, el("div", { className: "pager" }, newer, next), details);

    function query(extra) {
      const q = new URLSearchParams();
      for (const f of FILTERS) if (inputs[f].value.trim()) q.set(f, inputs[f].value.trim());
      for (const [k, v] of Object.entries(extra)) if (v !== null) q.set(k, v);
      return q.toString();
    }

    async function load() {
      try {
        const page = await api(`/admin/requests?${query({ limit: "50", before: st.before })}`);
        if (!alive()) return;
        st.next = page.next ?? null;
        next.disabled = st.next === null;
        newer.disabled = st.older.length === 0;
        const data = page.data || [];
        fill(list, data.length ? table(["Time", "ID", "Tenant", "Model", "Backend", "Status", "Class", "Cache",
          "TTFT (ms)", "Duration (ms)", "Tokens in/out", "Cost"], data.map((e) => row([
          fmtTime(e.time), el("td", { className: "id" }, e.id), e.tenant ?? DASH, e.model ?? DASH, e.backend ?? DASH,
          num(e.status), e.class ?? DASH, e.cache ?? DASH, num(e.ttft_ms), num(e.duration_ms),
          `${fmtNum(e.prompt_tokens)} / ${fmtNum(e.completion_tokens)}`, fmtUsd(e.cost_usd),
        ], { tabIndex: 0, className: e.error ? "failed" : "", onclick: () => show(e), onkeydown: (ev) => ev.key === "Enter" && show(e) })))
          : el("p", {}, "No requests match."));
        say(note, `Updated ${fmtTime(Date.now() / 1000)}`, "note");
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    }

    function show(e) {
      const skip = new Set(["reasons", "prompt", "answer"]);
      fill(details,
        el("h3", {}, `Request ${e.id}`),
        el("dl", { className: "fields" }, Object.entries(e).filter(([k]) => !skip.has(k)).map(([k, v]) =>
          stat(k, k === "time" ? fmtTime(v) : fmtValue(v)))),
        el("h4", {}, "Route explanation"),
        e.reasons && e.reasons.length ? el("ol", { className: "reasons" }, e.reasons.map((r) => el("li", {}, r)))
          : el("p", {}, "No reasons recorded."),
        ["prompt", "answer"].filter((k) => e[k] !== null && e[k] !== undefined).map((k) => [el("h4", {}, k[0].toUpperCase() + k.slice(1)),
          el("pre", {}, typeof e[k] === "string" ? e[k] : JSON.stringify(e[k], null, 2))]));
      details.hidden = false;
    }

    // The export needs the bearer header: fetched here, handed to the browser as a blob: URL.
    async function download() {
      try {
        const blob = await api(`/admin/requests/export?${query({})}`, { as: "blob" });
        const url = URL.createObjectURL(blob);
        const a = el("a", { href: url, download: `requests-${Date.now()}.jsonl` });
        document.body.append(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 60000);
      } catch (err) {
        if (alive()) say(note, err.message);
      }
    }

    load();
  }

  async function policy(view, alive) {
    const note = el("p", { className: "note", role: "status" });
    const pre = el("pre", { className: "policy" }, "Loading…");
    const area = el("textarea", { name: "policy", rows: 14, spellcheck: false, placeholder: "version: 1\nbackends: ..." });
    const out = el("div", { className: "check" });
    const form = el("form", {}, el("h3", {}, "Check a policy"),
      el("p", { className: "hint" }, "Paste a policy (YAML) to validate it; nothing is applied."),
      area, el("button", { type: "submit" }, "Check"), out);
    const items = (title, xs) => (xs && xs.length ? [el("h4", {}, title), el("ul", {}, xs.map((x) => el("li", {}, x)))] : null);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      try {
        const res = await api("/admin/policy/check", { method: "POST", text: area.value, type: "application/yaml" });
        if (!alive()) return;
        fill(out, el("p", { className: res.ok ? "ok" : "error" }, res.ok ? "The policy is valid." : "The policy is rejected."),
          items("Errors", res.errors), items("Warnings", res.warnings));
      } catch (err) {
        if (alive()) fill(out, el("p", { className: "error", role: "alert" }, err.message));
      }
    });
    view.append(note, el("h3", {}, "In force"), pre, form);
    try {
      const p = await api("/admin/policy");
      if (!alive()) return;
      say(note, `Policy generation ${p.policy_generation}`, "note");
      pre.textContent = JSON.stringify(p.policy, null, 2);
    } catch (err) {
      if (alive()) say(note, err.message);
    }
  }

  const VIEWS = { Overview: overview, Backends: backends, Tenants: tenants, Keys: keys, Requests: requests, Policy: policy };

  function stop() {
    generation += 1;
    if (timer !== null) clearTimeout(timer);
    timer = null;
  }

  function showView(name) {
    stop();
    const gen = generation;
    for (const b of document.querySelectorAll("#nav button")) {
      if (b.dataset.view === name) b.setAttribute("aria-current", "page");
      else b.removeAttribute("aria-current");
    }
    const view = $("#view");
    fill(view, el("h2", {}, name));
    VIEWS[name](view, () => gen === generation && key !== null);
  }

  function signedIn(on) {
    $("#login").hidden = on;
    $("#nav").hidden = !on;
    $("#logout").hidden = !on;
    $("#view").hidden = !on;
  }

  function logout(message) {
    key = null;
    role = null;
    stop();
    fill($("#view"));
    $("#who").textContent = "";
    signedIn(false);
    $("#login-error").textContent = message || "";
    const input = $("#login-form").elements.namedItem("key");
    input.value = "";
    input.focus();
  }

  async function login(ev) {
    ev.preventDefault();
    const input = ev.target.elements.namedItem("key");
    const candidate = input.value.trim();
    input.value = "";
    const error = $("#login-error");
    error.textContent = "";
    if (!candidate) return;
    key = candidate;
    try {
      role = (await api("/admin/whoami")).role;
    } catch (err) {
      key = null;
      error.textContent = err.status === 401 ? `Key not accepted: ${err.message}` : err.message;
      input.focus();
      return;
    }
    $("#who").textContent = `Signed in as ${role}`;
    signedIn(true);
    showView("Overview");
  }

  $("#login-form").addEventListener("submit", login);
  $("#logout").addEventListener("click", () => logout(""));
  $("#nav").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-view]");
    if (b && key !== null) showView(b.dataset.view);
  });
  signedIn(false);
  $("#login-form").elements.namedItem("key").focus();
})();
