/* The live dashboard: polls GET /v1/stats twice a second and draws it with uPlot.
 *
 * The server keeps the recent past (a minute of per-second samples, the last steps of
 * each replica), so the charts are full as soon as the page opens; the latency
 * percentiles are kept here as they arrive (one point per poll). Steps are fetched
 * incrementally (`steps_since`), so each poll carries only the steps run since the last.
 */
(() => {
  "use strict";
  const POLL_MS = 500;
  const KEEP_S = 300;          // latency history kept in the page
  const KEEP_STEPS = 300;      // steps kept per replica
  const COLORS = {
    running: "#1f5fa8", waiting: "#c2410c", kv: "#7c3aed", tps: "#0f766e",
    p50: "#1f5fa8", p95: "#c2410c", slo: "#b42318",
    decode: "#1f5fa8", prefill: "#ea8a2e", padding: "#9aa5b1", time: "#1c2230",
    budget: "#b42318",
  };
  // The rules that size a step's prompt chunks (scheduler/policy.py, STEP_PLANS), in words.
  const PLANS = {
    "itl-target": "within the ITL target",
    "itl-derived": "decodes fill the ITL target: the learned costs' share",
    "ttft": "grown for a first token due",
    "rare-question": "a rare question whole",
    "prefill-only": "prompts only",
    "decode-only": "decodes only",
    "itl-strict": "strict ITL target",
    "unpaced": "unpaced",
  };
  const pools = new Map();     // name -> view
  let paused = false;
  let lastOk = 0;

  const $ = (sel, root = document) => root.querySelector(sel);
  const fmt = {
    int: (v) => (v == null ? "–" : Math.round(v).toLocaleString()),
    rate: (v) => (v == null ? "–" : v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)),
    pct: (v) => (v == null ? "–" : `${(100 * v).toFixed(0)} %`),
    s: (v) => (v == null ? "–" : v >= 10 ? `${v.toFixed(0)} s` : v >= 1 ? `${v.toFixed(2)} s` : `${(v * 1000).toFixed(0)} ms`),
  };

  function setStat(view, key, text, value, bad = false) {
    const tile = $(`[data-stat="${key}"]`, view.root);
    const dd = $("dd", tile);
    if (dd.textContent !== text) dd.textContent = text;
    tile.dataset.value = value == null ? "" : String(value);
    tile.classList.toggle("over", bad);
  }

  // -- charts ---------------------------------------------------------------------------
  function chartWidth(el) { return Math.max(200, el.clientWidth || el.parentElement.clientWidth - 24); }

  const cssVar = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  // axes drawn in the page's own colours (light or dark)
  const themed = (axis) => ({
    stroke: cssVar("--muted") || "#566072",
    ticks: { stroke: cssVar("--border") || "#d5dbe3", width: 1 },
    ...axis,
    grid: { stroke: cssVar("--border") || "#d5dbe3", width: 1, ...(axis.grid || {}) },
  });

  function makeChart(el, series, opts = {}) {
    const u = new uPlot({
      width: chartWidth(el), height: opts.height || 150,
      legend: { live: false },
      cursor: { show: false },
      scales: { x: { time: false }, ...(opts.scales || {}) },
      axes: (opts.axes || [
        { values: (u, vals) => vals.map((v) => `${v}s`), size: 28 },
        { size: 64 },
      ]).map(themed),
      series: [{}, ...series],
    }, [[], ...series.map(() => [])], el);
    new ResizeObserver(() => {
      const w = chartWidth(el);
      if (Math.abs(w - u.width) > 2) u.setSize({ width: w, height: u.height });
    }).observe(el);
    return u;
  }

  const line = (label, stroke, extra = {}) => ({ label, stroke, width: 2, points: { show: false }, ...extra });
  const sloLine = (label) => line(label, COLORS.slo, { dash: [6, 4], width: 1.5 });

  function buildPool(name) {
    const root = $("#pool-template").content.firstElementChild.cloneNode(true);
    root.dataset.pool = name;
    $(".pool-name", root).textContent = name;
    $("#pools").appendChild(root);
    const chart = (key) => $(`[data-chart="${key}"]`, root);
    const msAxis = [{ values: (u, v) => v.map((x) => `${x}s`), size: 28 },
      { size: 64, values: (u, v) => v.map((x) => `${x} ms`) }];
    const sAxis = [{ values: (u, v) => v.map((x) => `${x}s`), size: 28 },
      { size: 64, values: (u, v) => v.map((x) => `${x} s`) }];
    const bars = uPlot.paths.bars({ size: [0.9, 12], align: 1 });
    const view = {
      root, latency: [], replica: 0, lastStep: new Map(),
      queue: makeChart(chart("queue"), [line("running", COLORS.running), line("waiting", COLORS.waiting)]),
      kv: makeChart(chart("kv"), [line("pages in use", COLORS.kv, { fill: "rgba(124,58,237,.12)" })], { height: 110 }),
      tps: makeChart(chart("tps"), [line("tokens/s", COLORS.tps, { fill: "rgba(15,118,110,.12)" })]),
      refusals: makeChart(chart("refusals"), [line("refused (429)", COLORS.slo), line("shed", COLORS.waiting)],
        { scales: { y: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1] } } }),
      ttft: makeChart(chart("ttft"), [line("p50", COLORS.p50), line("p95", COLORS.p95), sloLine("SLO")],
        { axes: sAxis, scales: { y: { range: (u, lo, hi) => [0, Math.max(hi, 0.1) * 1.1] } } }),
      itl: makeChart(chart("itl"), [line("p50", COLORS.p50), line("p95", COLORS.p95), sloLine("SLO")],
        { axes: msAxis, scales: { y: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1] } } }),
      steps: makeChart(chart("steps"), [
        // drawn back to front, each the running total: the bars read as a stack
        { label: "padding", fill: COLORS.padding, stroke: COLORS.padding, paths: bars, points: { show: false } },
        { label: "prefill tokens", fill: COLORS.prefill, stroke: COLORS.prefill, paths: bars, points: { show: false } },
        { label: "decode rows", fill: COLORS.decode, stroke: COLORS.decode, paths: bars, points: { show: false } },
        line("step time (ms)", COLORS.time, { scale: "ms", width: 1 }),
        line("ITL budget (ms)", COLORS.budget, { scale: "ms", width: 1, dash: [4, 3] }),
      ], {
        height: 170,
        scales: { ms: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1] } },
        axes: [
          { values: (u, v) => v.map((x) => `#${x}`), size: 28 },
          { size: 52, label: "tokens", labelSize: 14 },
          { scale: "ms", side: 1, size: 64, grid: { show: false }, values: (u, v) => v.map((x) => `${x} ms`) },
        ],
      }),
    };
    view.stepsData = new Map();
    const pick = $(".replica", root);
    pick.addEventListener("change", () => { view.replica = Number(pick.value); drawSteps(view); });
    pools.set(name, view);
    return view;
  }

  // -- one poll -------------------------------------------------------------------------
  function sinceParam() {
    const parts = [];
    for (const [name, view] of pools) {
      for (const [r, idx] of view.lastStep) parts.push(`${name}/${r}:${idx}`);
    }
    return parts.join(",");
  }

  async function poll() {
    if (paused) return;
    const since = sinceParam();
    const url = "/v1/stats?window_s=60" + (since ? `&steps_since=${encodeURIComponent(since)}` : "");
    let stats;
    try {
      stats = await window.sluice.fetchJSON(url);
    } catch (err) {
      status(err.status === 401 ? `${err.message} Type the key above.` : `Cannot read /v1/stats: ${err.message}`, true);
      return;
    }
    lastOk = Date.now();
    render(stats);
  }

  function status(text, bad = false) {
    const el = $("#dash-status");
    el.textContent = text;
    el.classList.toggle("error", bad);
  }

  function render(stats) {
    const warm = stats.warmup_remaining ? ` · ${stats.warmup_remaining} step shapes still compiling` : "";
    status(`${stats.phase} · up ${fmt.s(stats.uptime_s)} · rates over the last ${Math.round(stats.window_s)} s${warm}` +
      ` · updated ${new Date(stats.time * 1000).toLocaleTimeString()}`);
    document.body.dataset.phase = stats.phase;
    for (const p of stats.pools) renderPool(pools.get(p.name) || buildPool(p.name), p, stats.time);
    renderTenants(stats.tenants);
    renderBatches(stats.batches);
  }

  function renderPool(view, p, now) {
    $(".pool-model", view.root).textContent =
      p.model + (p.adapters.length ? ` + ${p.adapters.length} adapter${p.adapters.length > 1 ? "s" : ""}` : "");
    setStat(view, "running", fmt.int(p.running), p.running);
    setStat(view, "waiting", fmt.int(p.waiting), p.waiting);
    setStat(view, "oldest_wait", fmt.s(p.oldest_waiting_age_s), p.oldest_waiting_age_s);
    setStat(view, "ttft_p95", fmt.s(p.ttft.p95), p.ttft.p95, p.ttft.p95 > p.slo.ttft_s);
    setStat(view, "itl_p95", fmt.s(p.itl.p95), p.itl.p95, p.itl.p95 > p.slo.itl_s);
    setStat(view, "tokens_per_s", fmt.rate(p.output_tokens_per_s), p.output_tokens_per_s);
    setStat(view, "useful_busy", fmt.pct(p.useful_busy_fraction), p.useful_busy_fraction);
    const refused = Object.values(p.refused_per_s).reduce((a, b) => a + b, 0);
    setStat(view, "refused", fmt.rate(refused), refused, refused > 0);
    setStat(view, "shed", fmt.rate(p.shed_per_s), p.shed_per_s, p.shed_per_s > 0);
    setStat(view, "prefix_hits", fmt.pct(p.prefix_cache_hit_rate), p.prefix_cache_hit_rate);
    const reasons = Object.entries(p.refused_per_s).filter(([, v]) => v > 0)
      .map(([k, v]) => `${k} ${fmt.rate(v)}/s`);
    $(".refusal-reasons", view.root).textContent = reasons.length ? `Refused by reason: ${reasons.join(", ")}` : "";

    // the minute of per-second samples the server kept
    const x = p.series.ago_s.map((a) => -a);
    view.queue.setData([x, p.series.running, p.series.waiting]);
    view.kv.setData([x, p.series.kv_pages_in_use]);
    view.tps.setData([x, p.series.output_tokens_per_s]);
    view.refusals.setData([x, p.series.refused_per_s, p.series.shed_per_s]);
    const kv = p.kv_pages, total = Math.max(1, kv.total);
    $(".kv-use", view.root).style.width = `${(100 * kv.in_use) / total}%`;
    $(".kv-cached", view.root).style.width = `${(100 * kv.cached) / total}%`;
    $(".kv-legend", view.root).textContent =
      `${kv.in_use} in use · ${kv.cached} cached (prefix) · ${kv.free} free of ${kv.total}`;
    // the tiers below the device pool (host RAM, disk), where the pool keeps them
    const tiers = p.kv_tiers, tierLine = $(".kv-tiers", view.root);
    tierLine.hidden = !tiers;
    if (tiers) {
      const hits = Object.entries(tiers.hit_rate_by_tier).map(([k, v]) => `${k} ${fmt.pct(v)}`);
      const mb = (b) => `${(b / 1e6).toFixed(1)} MB`;
      tierLine.textContent = [
        `host ${tiers.host_pages} / ${tiers.host_slots} pages`,
        tiers.disk_pages === null ? "no disk tier"
          : `disk ${tiers.disk_pages} pages (${mb(tiers.disk_bytes)} of ${mb(tiers.disk_capacity_bytes)})`,
        hits.length ? `hits by tier: ${hits.join(", ")}` : "no lookups in the window",
        `copied up ${mb(tiers.copy_up_bytes_per_s)}/s, down ${mb(tiers.copy_down_bytes_per_s)}/s`,
      ].join(" · ");
    }

    // sliding-window layers' own pages (Gemma 3), bounded per sequence by the window
    const win = p.kv_window, winLine = $(".kv-window", view.root);
    winLine.hidden = !win;
    if (win) {
      winLine.textContent = [
        `sliding layers (${win.window}-key window): ${win.in_use} in use · ${win.cached} cached of ${win.total} pages`,
        `at most ${win.max_pages_per_seq} a sequence (now ${win.most_pages_held}, ever ${win.most_pages_held_ever})`,
      ].join(" · ");
    }

    // speculative decoding, where the pool proposes tokens
    const spec = p.speculative, specLine = $(".spec", view.root);
    specLine.hidden = !spec;
    if (spec) {
      specLine.textContent = spec.acceptance_rate === null
        ? `speculative (${spec.mode}): no proposals verified in the window`
        : [`speculative (${spec.mode}): ${spec.drafts_per_s.toFixed(1)} verifies/s`,
           `${fmt.pct(spec.acceptance_rate)} of proposals accepted`,
           `${spec.mean_accepted_length.toFixed(2)} tokens a verify`,
           `by position ${spec.acceptance_by_position.map(fmt.pct).join(" / ")}`].join(" · ");
    }

    // latency percentiles, one point per poll
    view.latency.push([now, p.ttft.p50, p.ttft.p95, p.itl.p50, p.itl.p95]);
    while (view.latency.length && view.latency[0][0] < now - KEEP_S) view.latency.shift();
    const lx = view.latency.map((r) => +(r[0] - now).toFixed(1));
    const col = (i, k = 1) => view.latency.map((r) => (r[i] == null ? null : r[i] * k));
    view.ttft.setData([lx, col(1), col(2), lx.map(() => p.slo.ttft_s)]);
    view.itl.setData([lx, col(3, 1000), col(4, 1000), lx.map(() => p.slo.itl_s * 1000)]);

    // steps, per replica
    for (const r of p.replicas) {
      const kept = view.stepsData.get(r.replica) || [];
      for (const s of r.steps) kept.push(s);
      while (kept.length > KEEP_STEPS) kept.shift();
      view.stepsData.set(r.replica, kept);
      view.lastStep.set(r.replica, r.last_step_index);
    }
    const pick = $(".replica", view.root);
    if (p.replicas.length > 1 && pick.options.length !== p.replicas.length) {
      pick.replaceChildren(...p.replicas.map((r) => new Option(`${r.replica}`, r.replica)));
      $(".replica-pick", view.root).hidden = false;
    }
    drawSteps(view);
    renderPlans(view, p);
    renderReplicas(view, p);
  }

  function drawSteps(view) {
    const steps = view.stepsData.get(view.replica) || [];
    const x = steps.map((s) => s.index);
    const decode = steps.map((s) => s.decode_rows);
    const prefill = steps.map((s) => s.decode_rows + s.prefill_tokens);
    const padding = steps.map((s) => s.decode_rows + s.prefill_tokens + s.padding_tokens);
    const ms = steps.map((s) => +(s.duration_s * 1000).toFixed(1));
    const budget = steps.map((s) => (s.budget_s ? +(s.budget_s * 1000).toFixed(1) : null));
    view.steps.setData([x, padding, prefill, decode, ms, budget]);
    const chart = $('[data-chart="steps"]', view.root);
    chart.dataset.lastStep = x.length ? String(x[x.length - 1]) : "";
  }

  function renderPlans(view, p) {
    const el = $(".step-plans", view.root);
    const shares = Object.entries(p.step_plans || {}).sort((a, b) => b[1] - a[1]);
    el.dataset.plans = shares.map(([k, v]) => `${k}=${v}`).join(",");
    el.textContent = "Why the steps were built so: " + (shares.length
      ? shares.map(([k, v]) => `${PLANS[k] || k} ${fmt.pct(v)}`).join(" · ") : "–");
  }

  function renderReplicas(view, p) {
    const table = $(".replicas", view.root);
    table.hidden = p.replicas.length < 2;
    if (table.hidden) return;
    $("tbody", table).replaceChildren(...p.replicas.map((r) => row([
      r.replica, r.alive ? "yes" : "no", r.running, r.waiting,
      `${r.kv_pages.in_use} / ${r.kv_pages.total}`, fmt.pct(r.busy_fraction)])));
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      if (c instanceof Node) td.appendChild(c); else td.textContent = String(c);
      tr.appendChild(td);
    }
    return tr;
  }

  function meter(value, max, label) {
    const m = document.createElement("meter");
    m.min = 0; m.max = Math.max(1, max); m.value = Math.min(value, m.max);
    m.high = m.max * 0.9;
    m.setAttribute("aria-label", label);
    m.title = label;
    return m;
  }

  function renderTenants(tenants) {
    const panel = $("#tenants-panel");
    panel.hidden = !tenants.length;
    $("#tenants").replaceChildren(...tenants.map((t) => row([
      t.name, t.priority,
      t.max_concurrency == null ? t.in_flight : `${t.in_flight} / ${t.max_concurrency}`,
      t.quota_tokens_per_min == null ? fmt.int(t.tokens_per_min) : `${fmt.int(t.tokens_per_min)} / ${fmt.int(t.quota_tokens_per_min)}`,
      t.quota_tokens_per_min == null ? "no quota"
        : meter(t.tokens_per_min, t.quota_tokens_per_min, `${t.name}: tokens per minute against quota`),
    ])));
  }

  function renderBatches(batches) {
    const panel = $("#batches-panel");
    panel.hidden = batches == null;
    if (batches == null) return;
    $("#batches-empty").hidden = batches.length > 0;
    $("#batches").replaceChildren(...batches.map((b) => {
      const done = b.completed + b.failed;
      const wrap = document.createElement("span");
      wrap.className = "progress";
      wrap.append(meter(done, b.total, `${b.id}: ${done} of ${b.total} done`),
        ` ${done} / ${b.total}${b.failed ? ` (${b.failed} failed)` : ""}`);
      return row([b.id, b.tenant, wrap, b.running, b.priority_level,
        `${fmt.s(b.expires_in_s)}${b.at_risk ? " · at risk" : ""}`]);
    }));
  }

  // -- start ------------------------------------------------------------------------------
  function start() {
    $("#pause").addEventListener("change", (e) => { paused = e.target.checked; });
    window.addEventListener("sluice:apikey", () => poll());
    const tick = async () => {
      const t0 = Date.now();
      await poll();
      if (!paused && lastOk && Date.now() - lastOk > 5000) status("No answer from the server for 5 s…", true);
      setTimeout(tick, Math.max(0, POLL_MS - (Date.now() - t0)));
    };
    tick();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
