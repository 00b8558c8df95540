/* seedfed dashboard: reads the coordinator's JSON API and draws tasks, rounds and devices.
 *
 * Auth (see docs/dashboard.md): the HTML shell and these scripts are public and hold no data;
 * every data request carries `Authorization: Bearer <token>`, the admin token typed once and
 * kept in sessionStorage, so it lives only as long as the tab and is never put in a URL the
 * server sees. A `#token=...` fragment is accepted once (fragments are not sent to the server)
 * and then removed from the address bar. With the coordinator's `public_stats` setting the
 * reads need no token, and the page never asks for one.
 */
(function () {
  "use strict";

  const C = window.SeedfedCharts;
  const TOKEN_KEY = "seedfed.dashboard.token";
  const MAX_CHART_ROUNDS = 200; // charts show the most recent rounds; the table lists all
  // Poll period: the page's default, or `?refresh=SECONDS` (at least 1) in the address.
  const refreshParam = Number(new URLSearchParams(window.location.search).get("refresh"));
  const refreshMs = refreshParam >= 1 ? refreshParam * 1000
    : Number(document.body.dataset.refreshMs) || 5000;

  const state = { selected: null, timer: null, busy: false, refreshes: 0, token: null };

  class AuthError extends Error {}

  // --- token -------------------------------------------------------------------------------

  function readToken() {
    const m = /(?:^|[#&])token=([^&]+)/.exec(window.location.hash);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      const rest = window.location.hash.replace(/(^#|&)token=[^&]+/, "").replace(/^#&/, "#");
      history.replaceState(null, "", window.location.pathname + window.location.search +
        (rest === "#" ? "" : rest));
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function selectedFromHash() {
    const m = /(?:^|[#&])task=([^&]+)/.exec(window.location.hash);
    return m ? decodeURIComponent(m[1]) : null;
  }

  // --- API ---------------------------------------------------------------------------------

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (state.token) headers.Authorization = "Bearer " + state.token;
    const res = await fetch(path, { headers: headers, cache: "no-store", credentials: "omit" });
    if (res.status === 401 || res.status === 403) {
      throw new AuthError(await detail(res));
    }
    if (!res.ok) throw new Error(path + ": HTTP " + res.status + " " + (await detail(res)));
    return res.json();
  }

  async function detail(res) {
    try {
      const body = await res.json();
      return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail || body);
    } catch (e) {
      return res.statusText;
    }
  }

  // --- normalization: one place that knows the API's field names ----------------------------

  function first(obj, names, fallback) {
    for (const n of names) {
      if (obj && obj[n] !== undefined && obj[n] !== null) return obj[n];
    }
    return fallback === undefined ? null : fallback;
  }

  // TaskStatus, the items of GET v1/tasks; see server/schemas.py.
  function taskOf(t) {
    return {
      id: String(first(t, ["task_id", "id"])),
      name: first(t, ["name"], ""),
      scope: first(t, ["scope"], ""),
      scopeNumel: first(t, ["scope_numel"]),
      format: first(t, ["format"], ""),
      aggregation: first(t, ["aggregation"], ""),
      version: first(t, ["version", "current_version"]),
      checksum: first(t, ["checksum"]),
      round: first(t, ["round"]),
      roundState: first(t, ["state"]),
      devices: first(t, ["devices"]),
      devicesSeen: first(t, ["devices_seen"]),
      quorum: first(t, ["quorum"]),
      roundTimeout: first(t, ["round_timeout_s"]) === null ? null : t.round_timeout_s + " s",
      epsilon: first(t, ["epsilon"]),
      delta: first(t, ["delta"]),
      closeError: first(t, ["close_error"]),
      closeAttempts: first(t, ["close_attempts"], 0),
      closeRetryAt: first(t, ["close_retry_at"]),
      closePermanent: first(t, ["close_permanent"], false),
      // Who opens rounds, and what the task waits for (a keyword and the coordinator's words).
      schedule: first(t, ["schedule"]),
      maxRounds: first(t, ["max_rounds"]),
      waitingFor: first(t, ["waiting_for"]),
      waiting: first(t, ["waiting"]),
      uploads: first(t, ["uploads"], 0),
      abandonedRound: first(t, ["abandoned_round"]),
      abandonReason: first(t, ["abandon_reason"]),
    };
  }

  // The tasks table's short form of what a task waits for.
  function waitingShort(t) {
    if (!t.waitingFor) return "–";
    if (t.waitingFor === "uploads") return "uploads " + t.uploads + "/" + t.quorum;
    return t.waitingFor.replace("_", " ");
  }

  // RoundMetrics (TaskStats.rounds): `version` is the version the round produced (null while
  // open or when it expired), `base_version` the one its devices started from.
  function roundOf(r) {
    return {
      round: first(r, ["round", "number"]),
      state: first(r, ["state"], ""),
      base: first(r, ["base_version"]),
      result: first(r, ["version"]),
      participants: first(r, ["participants"], 0),
      quorum: first(r, ["quorum"]),
      loss: first(r, ["loss"]),
      accuracy: first(r, ["accuracy"]),
      upload: first(r, ["upload_bytes"]),
      download: first(r, ["download_bytes"]),
      fedavg: first(r, ["fedavg_bytes"]),
      aggregationSeconds: first(r, ["aggregation_seconds"]),
      opened: first(r, ["opened_at"]),
      closed: first(r, ["closed_at"]),
      abandonReason: first(r, ["abandon_reason"]),
      // The devices' held-out accuracies reported for the round (DeviceMetrics): fleet mean
      // and worst decile, shared model over every reporting device, personalized over those
      // with a personal part.
      metricDevices: first(r, ["metric_devices"], 0),
      personalDevices: first(r, ["personal_devices"], 0),
      sharedMean: first(r, ["shared_accuracy_mean"]),
      sharedWorst: first(r, ["shared_accuracy_worst_decile"]),
      personalMean: first(r, ["personal_accuracy_mean"]),
      personalWorst: first(r, ["personal_accuracy_worst_decile"]),
    };
  }

  // DeviceSummary (TaskStats.devices): the most recently seen devices of the task.
  function deviceOf(d) {
    return {
      id: String(first(d, ["device_id", "id"])),
      enrolled: first(d, ["enrolled_at"]),
      lastSeen: first(d, ["last_seen_at"]),
      uploads: first(d, ["uploads"], 0),
      lastRound: first(d, ["last_round"]),
      revoked: first(d, ["revoked_at"]) !== null,
    };
  }

  function listOf(payload, key) {
    if (Array.isArray(payload)) return payload;
    return (payload && payload[key]) || [];
  }

  // --- rendering helpers -------------------------------------------------------------------

  const $ = (sel, root) => (root || document).querySelector(sel);

  function setField(name, content, raw) {
    const node = $('[data-field="' + name + '"]');
    node.textContent = content;
    if (raw !== undefined && raw !== null) node.dataset.value = String(raw);
    else delete node.dataset.value;
  }

  function cell(tr, content, raw, cls) {
    const td = document.createElement("td");
    td.textContent = content === null || content === undefined ? "–" : String(content);
    if (raw !== undefined && raw !== null) td.dataset.value = String(raw);
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  function when(iso) {
    if (!iso) return "–";
    const d = new Date(iso);
    if (isNaN(d.getTime())) return String(iso);
    return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
  }

  function sum(values) {
    return values.reduce((a, v) => a + (typeof v === "number" && isFinite(v) ? v : 0), 0);
  }

  // --- rendering ---------------------------------------------------------------------------

  function renderTasks(tasks) {
    const body = $("#tasks tbody");
    // Rows are rebuilt on every refresh: keep the keyboard focus on the same task's row.
    const focused = body.contains(document.activeElement) ? document.activeElement.dataset.taskId
      : null;
    body.textContent = "";
    $("#no-tasks").hidden = tasks.length > 0;
    for (const t of tasks) {
      const tr = document.createElement("tr");
      tr.dataset.taskId = t.id;
      if (t.id === state.selected) tr.className = "selected";
      cell(tr, t.name && t.name !== t.id ? t.id + " · " + t.name : t.id, null, "mono");
      cell(tr, t.scope || "–");
      cell(tr, t.format || "–");
      cell(tr, t.aggregation || "–");
      cell(tr, t.version, t.version);
      cell(tr, t.round === null ? "–" : t.round + (t.roundState ? " (" + t.roundState + ")" : "") +
        (t.closeError ? " · close failing" : ""), t.round, t.closeError ? "close-failing" : null);
      cell(tr, waitingShort(t), t.waitingFor,
        "waiting-for " + (t.waitingFor === "operator" ? "operator" : "")).title = t.waiting || "";
      cell(tr, t.devices, t.devices);
      cell(tr, t.devicesSeen, t.devicesSeen);
      tr.tabIndex = 0; // rows are the task picker: reachable and usable from the keyboard
      tr.addEventListener("click", () => select(t.id));
      tr.addEventListener("keydown", (ev) => {
        if (ev.key === "Enter" || ev.key === " ") {
          ev.preventDefault();
          select(t.id);
        }
      });
      body.appendChild(tr);
      if (t.id === focused) tr.focus();
    }
  }

  function renderTask(t, stats) {
    const rounds = listOf(stats, "rounds").map(roundOf)
      .sort((a, b) => a.round - b.round);
    // The device list is optional in the stats; without it the section shows counts only.
    const devices = listOf(stats && stats.devices ? stats : [], "devices").map(deviceOf);
    $("#devices-section").hidden = devices.length === 0;
    // Version and checksum from the same TaskStatus, so they always belong together.
    const version = t.version;
    const checksum = t.checksum;
    const current = rounds.length ? rounds[rounds.length - 1] : null;

    $("#task").hidden = false;
    $("#task-title").textContent = t.name && t.name !== t.id ? t.id + " · " + t.name : t.id;
    setField("version", version === null ? "–" : String(version), version);
    setField("checksum", checksum || "–", checksum);
    $('[data-field="checksum"]').title = checksum || "";
    setField("round", current ? String(current.round) : "–", current ? current.round : null);
    // A failing close is named with its error: retried with backoff by the coordinator, or,
    // when it fails on every attempt, left for an operator to abandon the round.
    setField("round-state", !t.closeError ? (current ? current.state : "no round yet")
      : t.closePermanent
        ? "close fails on every attempt (not retried; abandon the round): " + t.closeError
        : "close failing (attempt " + t.closeAttempts + ", retry " + (t.closeRetryAt || "soon") +
          "): " + t.closeError);
    renderWaiting(t);
    const seen = first(stats, ["devices_seen"], t.devicesSeen);
    const enrolled = first(stats, ["devices_enrolled"], t.devices);
    const revoked = first(stats, ["devices_revoked"], 0);
    setField("devices", seen === null ? "–" : String(seen), seen);
    setField("devices-note", (enrolled === null ? "" : enrolled + " enrolled") +
      (revoked ? ", " + revoked + " revoked" : ""));
    const numel = first(stats, ["scope_numel"], t.scopeNumel);
    const eps = first(stats, ["epsilon"], t.epsilon);
    const facts = [
      ["scope", t.scope + (numel !== null ? " (" + numel.toLocaleString("en-US") +
        " trainable values)" : "")],
      ["format", t.format], ["aggregation", t.aggregation],
      ["quorum", t.quorum], ["round timeout", t.roundTimeout],
      ["rounds", t.schedule === null ? null : t.schedule === "manual" ? "opened by hand"
        : "automatic" + (t.maxRounds !== null ? " until v" + t.maxRounds : "")],
      ["DP", eps !== null ? "ε = " + C.formatNumber(eps, 3) +
        (t.delta !== null ? ", δ = " + t.delta : "") : "off"],
    ];
    const dl = $("#facts");
    dl.textContent = "";
    for (const [k, v] of facts) {
      if (v === null || v === undefined || v === "") continue;
      const span = document.createElement("span");
      span.dataset.fact = k;
      span.textContent = k + ": " + v;
      dl.appendChild(span);
    }
    state.quorum = t.quorum;
    renderBytes(rounds);

    renderCharts(rounds);
    renderRounds(rounds);
    renderDevices(devices);
    $("#devices-list-note").textContent = enrolled !== null && devices.length < enrolled
      ? "(the " + devices.length + " most recently seen of " + enrolled + ")" : "";
  }

  // What the task waits for, in the coordinator's words, and its latest abandoned round.
  function renderWaiting(t) {
    const box = $("#waiting");
    box.hidden = !t.waiting;
    box.dataset.waitingFor = t.waitingFor || "";
    setField("waiting", t.waiting || "", t.waitingFor);
    const abandoned = $("#abandoned");
    abandoned.hidden = t.abandonedRound === null;
    abandoned.textContent = t.abandonedRound === null ? ""
      : "round " + t.abandonedRound + " was abandoned: " + (t.abandonReason || "no reason given");
  }

  // Bytes moved against FedAvg's, each direction on its own: FedAvg's participants download
  // and upload the fp32 trainable tensors, half of `fedavg_bytes` each way.
  function renderBytes(rounds) {
    const up = sum(rounds.map((r) => r.upload));
    const down = sum(rounds.map((r) => r.download));
    const fed = sum(rounds.map((r) => r.fedavg));
    const ratio = (ours, theirs, what) => (ours > 0 && theirs > 0
      ? "FedAvg " + what + " " + C.formatRatio(theirs / ours) + "× more" : "");
    setField("upload-bytes", C.formatBytes(up), up);
    setField("upload-saving", ratio(up, fed / 2, "uploads"), up > 0 ? fed / 2 / up : null);
    setField("download-bytes", C.formatBytes(down), down);
    setField("download-saving", ratio(down, fed / 2, "downloads"),
      down > 0 ? fed / 2 / down : null);
    setField("fedavg-bytes", C.formatBytes(fed), fed);
    setField("saving", up + down > 0 && fed > 0
      ? C.formatRatio(fed / (up + down)) + "× what seedfed moved" : "",
    up + down > 0 && fed > 0 ? fed / (up + down) : null);
  }

  function renderCharts(allRounds) {
    state.rounds = allRounds;
    const rounds = allRounds.slice(-MAX_CHART_ROUNDS);
    const categories = rounds.map((r) => r.round);
    $("#rounds-note").textContent = allRounds.length > rounds.length
      ? "(charts show the last " + rounds.length + " of " + allRounds.length + ")" : "";
    // Rounds may carry their own quorum; otherwise the task's applies to every round.
    const quorums = rounds.map((r) => r.quorum).filter((q) => q !== null);
    const quorum = quorums.length ? quorums[quorums.length - 1] : state.quorum;
    C.barChart($("#chart-participation"), {
      title: "participation", categories: categories, xTitle: "round", yTitle: "devices",
      integer: true, emptyMessage: "no rounds yet",
      series: [{ name: "participants", cls: "participants", values: rounds.map((r) => r.participants) }],
      refLine: quorum !== null ? { value: quorum, name: "quorum", cls: "quorum" } : null,
    });
    const acc = rounds.map((r) => r.accuracy);
    const hasAcc = acc.some((v) => v !== null);
    const lossSeries = [{ name: "loss", cls: "loss", values: rounds.map((r) => r.loss) }];
    if (hasAcc) lossSeries.push({ name: "accuracy", cls: "accuracy", values: acc, axis: "right" });
    $("#acc-note").textContent = hasAcc ? "and accuracy" : "";
    C.lineChart($("#chart-loss"), {
      title: "loss", categories: categories, xTitle: "round", yTitle: "loss",
      rightTitle: "accuracy", rightDomain: [0, 1], emptyMessage: "no uploads yet",
      formatRight: (v) => Math.round(v * 100) + "%", series: lossSeries,
    });
    renderPersonal(rounds, categories);
    const bytes = [{ name: "uploaded", cls: "upload", values: rounds.map((r) => r.upload) }];
    if (rounds.some((r) => r.download !== null)) {
      bytes.push({ name: "downloaded", cls: "download", values: rounds.map((r) => r.download) });
    }
    bytes.push({ name: "FedAvg would move", cls: "fedavg", values: rounds.map((r) => r.fedavg) });
    C.barChart($("#chart-bytes"), {
      title: "bytes", categories: categories, xTitle: "round", yTitle: "bytes", log: true,
      formatY: C.formatBytes, series: bytes, emptyMessage: "no bytes moved yet",
    });
  }

  // Shared vs personalized accuracy across the fleet: shown once any device reported.
  function renderPersonal(rounds, categories) {
    const reported = rounds.filter((r) => r.sharedMean !== null);
    $("#personal-figure").hidden = reported.length === 0;
    if (!reported.length) return;
    const last = reported[reported.length - 1];
    $("#personal-note").textContent = "(round " + last.round + ": " + last.metricDevices +
      " devices reported, " + last.personalDevices + " with a personal part)";
    const pct = (v) => Math.round(v * 100) + "%";
    C.lineChart($("#chart-personal"), {
      title: "held-out accuracy", categories: categories, xTitle: "round",
      yTitle: "accuracy", domain: [0, 1], formatY: pct, emptyMessage: "no device reported yet",
      series: [
        { name: "shared, mean", cls: "shared-mean", values: rounds.map((r) => r.sharedMean) },
        { name: "shared, worst decile", cls: "shared-worst",
          values: rounds.map((r) => r.sharedWorst) },
        { name: "personalized, mean", cls: "personal-mean",
          values: rounds.map((r) => r.personalMean) },
        { name: "personalized, worst decile", cls: "personal-worst",
          values: rounds.map((r) => r.personalWorst) },
      ].filter((s) => s.values.some((v) => v !== null)), // a fleet without personal parts
    });
  }

  function accuracyCell(r) {
    if (r.sharedMean === null) return "–";
    const pct = (v) => (v * 100).toFixed(1) + "%";
    return pct(r.sharedMean) + (r.personalMean === null ? "" : " → " + pct(r.personalMean));
  }

  function renderRounds(rounds) {
    const body = $("#rounds tbody");
    body.textContent = "";
    for (const r of rounds.slice().reverse()) {
      const tr = document.createElement("tr");
      tr.dataset.round = String(r.round);
      cell(tr, r.round, r.round);
      cell(tr, r.state, r.state, "state-" + r.state);
      cell(tr, r.base + " → " + (r.result === null ? "…" : r.result), r.result);
      cell(tr, r.participants, r.participants);
      cell(tr, r.loss === null ? "–" : C.formatNumber(r.loss, 5), r.loss);
      cell(tr, accuracyCell(r), r.personalMean !== null ? r.personalMean : r.sharedMean);
      cell(tr, C.formatBytes(r.upload), r.upload);
      cell(tr, C.formatBytes(r.download), r.download);
      cell(tr, C.formatBytes(r.fedavg), r.fedavg);
      cell(tr, r.aggregationSeconds === null ? "–" : C.formatNumber(r.aggregationSeconds, 3) + " s",
        r.aggregationSeconds);
      cell(tr, when(r.opened), r.opened);
      cell(tr, when(r.closed), r.closed);
      cell(tr, r.abandonReason || "", r.abandonReason, "note");
      body.appendChild(tr);
    }
  }

  function renderDevices(devices) {
    const body = $("#devices tbody");
    body.textContent = "";
    for (const d of devices) {
      const tr = document.createElement("tr");
      tr.dataset.deviceId = d.id;
      cell(tr, d.id, d.id, "mono");
      cell(tr, when(d.enrolled), d.enrolled);
      cell(tr, when(d.lastSeen), d.lastSeen);
      cell(tr, d.uploads, d.uploads);
      cell(tr, d.lastRound, d.lastRound);
      cell(tr, d.revoked ? "revoked" : "active", null, d.revoked ? "revoked" : "");
      body.appendChild(tr);
    }
  }

  // --- control flow ------------------------------------------------------------------------

  function showAuth(message) {
    $("#auth").hidden = false;
    $("#main").hidden = true;
    $("#forget-token").hidden = !state.token;
    $("#auth-error").textContent = message || "";
    document.body.dataset.state = "auth";
    $("#status-text").textContent = "token needed";
    $("#token-input").focus();
  }

  function showError(message) {
    const box = $("#error");
    box.hidden = !message;
    box.textContent = message || "";
  }

  async function refresh() {
    if (state.busy) return;
    state.busy = true;
    try {
      const tasks = listOf(await api("v1/tasks"), "tasks").map(taskOf);
      if (!tasks.some((t) => t.id === state.selected)) {
        state.selected = tasks.length ? tasks[0].id : null;
      }
      // Shown before drawing: charts size themselves to their (visible) container.
      $("#auth").hidden = true;
      $("#main").hidden = false;
      renderTasks(tasks);
      if (state.selected) {
        // The list already carries each task's full status (version, checksum, state), so
        // two requests per refresh suffice, both readable with `public_stats` on.
        const stats = await api("v1/tasks/" + encodeURIComponent(state.selected) + "/stats");
        renderTask(tasks.find((t) => t.id === state.selected), stats);
      } else {
        $("#task").hidden = true;
      }
      $("#forget-token").hidden = !state.token;
      showError(null);
      state.refreshes += 1;
      document.body.dataset.refreshes = String(state.refreshes);
      document.body.dataset.state = "ready";
      $("#status-text").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      if (e instanceof AuthError) {
        showAuth(state.token ? "token refused: " + e.message : "");
      } else {
        document.body.dataset.state = "error";
        showError("Could not load data: " + e.message);
        $("#status-text").textContent = "error, retrying";
      }
    } finally {
      state.busy = false;
      schedule();
    }
  }

  function schedule() {
    clearTimeout(state.timer);
    const auto = $("#auto-refresh").checked;
    if (auto && document.body.dataset.state !== "auth") {
      // A hidden tab does not poll; it refreshes when it becomes visible again.
      state.timer = setTimeout(() => (document.hidden ? schedule() : refresh()), refreshMs);
    }
  }

  function select(id) {
    state.selected = id;
    history.replaceState(null, "", "#task=" + encodeURIComponent(id));
    refresh();
  }

  function init() {
    state.token = readToken();
    state.selected = selectedFromHash();
    $("#auth-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      state.token = $("#token-input").value.trim();
      sessionStorage.setItem(TOKEN_KEY, state.token);
      $("#token-input").value = "";
      refresh();
    });
    $("#forget-token").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      state.token = null;
      clearTimeout(state.timer);
      showAuth("");
    });
    $("#refresh-now").addEventListener("click", refresh);
    $("#auto-refresh").addEventListener("change", schedule);
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) refresh();
    });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => state.rounds && renderCharts(state.rounds), 150);
    });
    window.seedfedDashboard = { refresh: refresh, state: state };
    refresh();
  }

  init();
})();
