/* Minimal SVG charts for the seedfed dashboard.
 *
 * No dependencies and no network: the coordinator often runs on machines without internet, so
 * the page draws its own charts as inline SVG. Every drawn mark carries data-category and
 * data-value attributes (the raw numbers), which keeps the charts inspectable and testable.
 * Exposed as window.SeedfedCharts; the pure helpers (ticks, formatting) are exported too.
 */
(function (global) {
  "use strict";

  const NS = "http://www.w3.org/2000/svg";
  const DEFAULT_W = 640; // drawn at the container's width in CSS pixels: text stays 11 px
  const H = 250;
  const M = { top: 30, right: 52, bottom: 38, left: 66 };
  const MAX_X_LABELS = 12;

  function el(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, String(v));
    }
    if (parent) parent.appendChild(node);
    return node;
  }

  function text(parent, x, y, content, attrs) {
    const t = el("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    t.textContent = content;
    return t;
  }

  function tooltip(node, content) {
    el("title", {}, node).textContent = content;
  }

  // --- pure helpers ------------------------------------------------------------------------

  /** A "nice" step (1, 2 or 5 times a power of ten) splitting `span` into about `count` parts. */
  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    const nice = norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10;
    return nice * mag;
  }

  /** Ticks covering [lo, hi] at a nice step; the first and last tick bound the axis. */
  function linearTicks(lo, hi, count, integer) {
    if (!isFinite(lo) || !isFinite(hi)) return [0, 1];
    if (hi <= lo) {
      const pad = lo === 0 ? 1 : Math.abs(lo) * 0.1;
      lo -= pad;
      hi += pad;
    }
    let step = niceStep(hi - lo, count || 5);
    if (integer) step = Math.max(1, Math.round(step));
    const start = Math.floor(lo / step) * step;
    const ticks = [];
    for (let v = start; v < hi + step * 0.999; v += step) ticks.push(Number(v.toPrecision(12)));
    if (ticks.length < 2) ticks.push(Number((start + step).toPrecision(12)));
    return ticks;
  }

  /** Powers of ten covering the positive values in [lo, hi] (at most ~8 labelled). */
  function logTicks(lo, hi) {
    let a = Math.floor(Math.log10(lo));
    let b = Math.ceil(Math.log10(hi));
    if (b <= a) b = a + 1;
    const every = Math.max(1, Math.ceil((b - a) / 8));
    a = Math.floor(a / every) * every;
    const ticks = [];
    for (let e = a; e < b + every; e += every) ticks.push(Math.pow(10, e));
    return ticks;
  }

  // SI (powers of 1000) so that the log axis' ticks at powers of ten read 1 kB, 10 kB, 100 kB.
  const UNITS = ["B", "kB", "MB", "GB", "TB", "PB"];

  /** Bytes in SI units, three significant digits: 1536 -> "1.54 kB". */
  function formatBytes(n) {
    if (n === null || n === undefined || !isFinite(n)) return "–";
    if (Math.abs(n) < 1000) return Math.round(n) + " B";
    let i = 0;
    let v = n;
    while (Math.abs(v) >= 1000 && i < UNITS.length - 1) {
      v /= 1000;
      i += 1;
    }
    return String(Number(v.toPrecision(3))) + " " + UNITS[i];
  }

  /** A ratio for people: 3 significant digits, thousands separated (13900, not 1.39e+4). */
  function formatRatio(x) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
    return String(Number(x.toPrecision(3)));
  }

  /** A number with up to `digits` significant digits and no trailing zeros. */
  function formatNumber(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    if (Number.isInteger(x) && Math.abs(x) < 1e15) return String(x);
    return String(Number(Number(x).toPrecision(digits || 4)));
  }

  function finite(values) {
    return values.filter((v) => v !== null && v !== undefined && isFinite(v));
  }

  // --- chart frame -------------------------------------------------------------------------

  function frame(container, kind, opts) {
    const W = Math.max(320, Math.round(container.clientWidth || DEFAULT_W));
    container.textContent = "";
    const svg = el("svg", {
      viewBox: "0 0 " + W + " " + H, role: "img", "data-chart": kind,
      "aria-label": opts.title || kind, preserveAspectRatio: "xMidYMid meet",
    }, container);
    const plot = { x: M.left, y: M.top, w: W - M.left - M.right, h: H - M.top - M.bottom, W: W };
    return { svg: svg, plot: plot };
  }

  function empty(container, message) {
    container.textContent = "";
    const div = document.createElement("div");
    div.className = "empty";
    div.textContent = message || "no data yet";
    container.appendChild(div);
  }

  function bandScale(n, plot) {
    const band = plot.w / Math.max(1, n);
    return { band: band, center: (i) => plot.x + band * (i + 0.5) };
  }

  function drawXAxis(svg, plot, categories, bands, title) {
    const g = el("g", { class: "axis x" }, svg);
    el("line", { x1: plot.x, x2: plot.x + plot.w, y1: plot.y + plot.h, y2: plot.y + plot.h }, g);
    const every = Math.max(1, Math.ceil(categories.length / MAX_X_LABELS));
    categories.forEach((c, i) => {
      if (i % every !== 0) return;
      const x = bands.center(i);
      el("line", { x1: x, x2: x, y1: plot.y + plot.h, y2: plot.y + plot.h + 4 }, g);
      text(g, x, plot.y + plot.h + 16, String(c), { "text-anchor": "middle" });
    });
    if (title) {
      text(g, plot.x + plot.w / 2, H - 4, title, { "text-anchor": "middle", class: "axis-title" });
    }
  }

  function drawYAxis(svg, plot, ticks, scale, fmt, title, side) {
    const right = side === "right";
    const x0 = right ? plot.x + plot.w : plot.x;
    const g = el("g", { class: "axis y " + (side || "left") }, svg);
    el("line", { x1: x0, x2: x0, y1: plot.y, y2: plot.y + plot.h }, g);
    ticks.forEach((t) => {
      const y = scale(t);
      if (!right) el("line", { class: "grid-line", x1: plot.x, x2: plot.x + plot.w, y1: y, y2: y }, svg);
      el("line", { x1: x0, x2: right ? x0 + 4 : x0 - 4, y1: y, y2: y }, g);
      text(g, right ? x0 + 6 : x0 - 6, y + 4, fmt(t), { "text-anchor": right ? "start" : "end" });
    });
    if (title) {
      const tx = right ? plot.W - 6 : 12;
      text(g, tx, plot.y + plot.h / 2, title, {
        "text-anchor": "middle", class: "axis-title",
        transform: "rotate(-90 " + tx + " " + (plot.y + plot.h / 2) + ")",
      });
    }
  }

  function drawLegend(svg, plot, items) {
    const g = el("g", { class: "legend" }, svg);
    let x = plot.x + plot.w;
    // Right-aligned: lay out from the last item backwards, ~6.5 px per character.
    for (let i = items.length - 1; i >= 0; i -= 1) {
      const width = 16 + items[i].name.length * 6.5;
      x -= width + 10;
      el("rect", { class: "swatch " + items[i].cls, x: x, y: 8, width: 11, height: 11, rx: 2 }, g);
      text(g, x + 15, 18, items[i].name);
    }
  }

  function yScale(domain, plot, log) {
    if (log) {
      const a = Math.log10(domain[0]);
      const b = Math.log10(domain[1]);
      return (v) => plot.y + plot.h - ((Math.log10(v) - a) / (b - a)) * plot.h;
    }
    return (v) => plot.y + plot.h - ((v - domain[0]) / (domain[1] - domain[0])) * plot.h;
  }

  // --- bar chart ---------------------------------------------------------------------------

  /**
   * Grouped bars, one group per category.
   * opts: {categories, series: [{name, cls, values}], log, yTitle, xTitle, formatY, integer,
   *        refLine: {value, name, cls}, emptyMessage}
   * A value of null (unknown) or, on a log axis, <= 0 draws no bar.
   */
  function barChart(container, opts) {
    const categories = opts.categories || [];
    const series = opts.series || [];
    const all = [].concat.apply([], series.map((s) => finite(s.values)));
    const positive = all.filter((v) => v > 0);
    if (!categories.length || !all.length || (opts.log && !positive.length)) {
      empty(container, opts.emptyMessage);
      return null;
    }
    const fmt = opts.formatY || ((v) => formatNumber(v, 3));
    const { svg, plot } = frame(container, "bar", opts);
    let ticks;
    if (opts.log) {
      ticks = logTicks(Math.min.apply(null, positive), Math.max.apply(null, positive));
    } else {
      // A reference line (the quorum) always gets headroom above it: drawn on the axis' top
      // it would lie along the top of every bar that reaches it, and vanish.
      const ref = opts.refLine && isFinite(opts.refLine.value) ? opts.refLine.value : null;
      const top = ref === null ? 0 : (opts.integer ? ref + 1 : ref * 1.15);
      ticks = linearTicks(0, Math.max.apply(null, all.concat([top])), 5, opts.integer);
    }
    const domain = [ticks[0], ticks[ticks.length - 1]];
    const y = yScale(domain, plot, opts.log);
    drawYAxis(svg, plot, ticks, y, fmt, opts.yTitle);
    const bands = bandScale(categories.length, plot);
    const inner = bands.band * 0.8;
    const barW = Math.max(0.5, inner / series.length);
    const base = plot.y + plot.h;
    series.forEach((s, si) => {
      const g = el("g", { class: "series " + s.cls, "data-series": s.name }, svg);
      s.values.forEach((v, i) => {
        if (v === null || v === undefined || !isFinite(v) || (opts.log && v <= 0)) return;
        const x = bands.center(i) - inner / 2 + si * barW;
        const top = Math.min(base, y(Math.max(v, domain[0])));
        const rect = el("rect", {
          class: "bar " + s.cls, x: x.toFixed(2), y: top.toFixed(2), width: barW.toFixed(2),
          height: Math.max(0, base - top).toFixed(2), "data-category": categories[i], "data-value": v,
        }, g);
        tooltip(rect, (opts.xTitle || "") + " " + categories[i] + " — " + s.name + ": " + fmt(v));
      });
    });
    if (opts.refLine && isFinite(opts.refLine.value)) {
      // Drawn over the bars, with its name and value written at its right end, so it shows
      // whether the bars stop below, at or above it.
      const ry = y(opts.refLine.value);
      const g = el("g", { class: "ref " + (opts.refLine.cls || "") }, svg);
      const line = el("line", {
        class: "ref-line " + (opts.refLine.cls || ""), x1: plot.x, x2: plot.x + plot.w, y1: ry,
        y2: ry, "data-value": opts.refLine.value,
      }, g);
      tooltip(line, opts.refLine.name + ": " + fmt(opts.refLine.value));
      text(g, plot.x + plot.w - 4, ry - 4, opts.refLine.name + " " + fmt(opts.refLine.value),
        { "text-anchor": "end", class: "ref-label" });
    }
    drawXAxis(svg, plot, categories, bands, opts.xTitle);
    const legend = series.map((s) => ({ name: s.name, cls: s.cls }));
    if (opts.refLine && isFinite(opts.refLine.value)) {
      legend.push({ name: opts.refLine.name, cls: opts.refLine.cls || "" });
    }
    drawLegend(svg, plot, legend);
    return svg;
  }

  // --- line chart --------------------------------------------------------------------------

  /**
   * Lines with points over categories; gaps where a value is null.
   * opts: {categories, series: [{name, cls, values, axis: "left"|"right"}], yTitle, xTitle,
   *        formatY, domain: [lo, hi] (left axis; default: the values, padded), rightTitle,
   *        formatRight, rightDomain: [lo, hi], emptyMessage}
   */
  function lineChart(container, opts) {
    const categories = opts.categories || [];
    const series = opts.series || [];
    const left = series.filter((s) => (s.axis || "left") === "left");
    const right = series.filter((s) => s.axis === "right");
    const leftValues = [].concat.apply([], left.map((s) => finite(s.values)));
    const rightValues = [].concat.apply([], right.map((s) => finite(s.values)));
    if (!categories.length || !(leftValues.length || rightValues.length)) {
      empty(container, opts.emptyMessage);
      return null;
    }
    const { svg, plot } = frame(container, "line", opts);
    const fmt = opts.formatY || ((v) => formatNumber(v, 3));
    const scales = {};
    if (leftValues.length) {
      const lo = Math.min.apply(null, leftValues);
      const hi = Math.max.apply(null, leftValues);
      const pad = (hi - lo) * 0.08;
      // A fixed domain (accuracies: 0..1) keeps rounds comparable as the values move.
      const ticks = opts.domain ? linearTicks(opts.domain[0], opts.domain[1], 5)
        : linearTicks(lo - pad, hi + pad, 5);
      scales.left = yScale([ticks[0], ticks[ticks.length - 1]], plot, false);
      drawYAxis(svg, plot, ticks, scales.left, fmt, opts.yTitle, "left");
    }
    if (rightValues.length) {
      const dom = opts.rightDomain || [Math.min.apply(null, rightValues),
        Math.max.apply(null, rightValues)];
      const ticks = linearTicks(dom[0], dom[1], 4);
      scales.right = yScale([ticks[0], ticks[ticks.length - 1]], plot, false);
      drawYAxis(svg, plot, ticks, scales.right, opts.formatRight || fmt, opts.rightTitle, "right");
    }
    const bands = bandScale(categories.length, plot);
    const radius = categories.length > 60 ? 1.8 : 3.2;
    series.forEach((s) => {
      const y = scales[s.axis || "left"];
      if (!y) return;
      const g = el("g", { class: "series " + s.cls, "data-series": s.name }, svg);
      let d = "";
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined || !isFinite(v)) {
          pen = false;
          return;
        }
        const x = bands.center(i).toFixed(2);
        const yy = y(v).toFixed(2);
        d += (pen ? "L" : "M") + x + " " + yy;
        pen = true;
      });
      if (d) el("path", { class: "line " + s.cls, d: d }, g);
      s.values.forEach((v, i) => {
        if (v === null || v === undefined || !isFinite(v)) return;
        const c = el("circle", {
          class: "pt " + s.cls, cx: bands.center(i).toFixed(2), cy: y(v).toFixed(2), r: radius,
          "data-category": categories[i], "data-value": v,
        }, g);
        const f = s.axis === "right" ? (opts.formatRight || fmt) : fmt;
        tooltip(c, (opts.xTitle || "") + " " + categories[i] + " — " + s.name + ": " + f(v));
      });
    });
    drawXAxis(svg, plot, categories, bands, opts.xTitle);
    drawLegend(svg, plot, series.filter((s) => scales[s.axis || "left"])
      .map((s) => ({ name: s.name, cls: s.cls })));
    return svg;
  }

  global.SeedfedCharts = {
    barChart: barChart, lineChart: lineChart, niceStep: niceStep, linearTicks: linearTicks,
    logTicks: logTicks, formatBytes: formatBytes, formatNumber: formatNumber,
    formatRatio: formatRatio,
  };
})(window);
