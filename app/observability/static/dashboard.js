"use strict";
// Live charts of /dashboard/events (one JSON snapshot per second), drawn on plain canvases.
// Each canvas carries data-points, the number of points it drew, and the body carries
// data-snapshots, the number of snapshots received: what a test (or a curious operator) can read.
(() => {
  const WINDOW_S = 300; // five minutes of history; older points fall off
  const MIN_SPAN_S = 30; // a young chart spans its own history, at least this, until it has five minutes
  const TICK_STEPS_S = [5, 10, 15, 30, 60];
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
  const MARGIN = { left: 48, right: 12, top: 10, bottom: 22 };

  // The smallest 1, 2, 4 or 8 times a power of ten that is at least value: its quarters are round too.
  function niceCeiling(value) {
    if (value <= 0) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 4, 8, 10]) {
      if (step * power >= value) return step * power;
    }
    return 10 * power;
  }

  function formatNumber(value) {
    if (Math.abs(value) >= 100 || Number.isInteger(value)) return String(Math.round(value));
    return String(Number(value.toFixed(Math.abs(value) >= 10 ? 1 : 2)));
  }

  function formatAge(seconds) {
    if (seconds === 0) return "now";
    return seconds % 60 === 0 ? `-${seconds / 60} min` : `-${seconds} s`;
  }

  class LineChart {
    constructor(canvas, legend, options = {}) {
      this.canvas = canvas;
      this.legend = legend;
      this.fixedMax = options.fixedMax ?? null; // a y-axis top that does not move (percentages)
      this.minMax = options.minMax ?? 1; // the lowest y-axis top (4 keeps whole-number ticks for counts)
      this.legendValue = options.legendValue ?? ((points) => formatNumber(points[points.length - 1][1]));
      this.series = new Map(); // name -> { color, points: [[time, value], ...] }
    }

    push(name, time, value) {
      let series = this.series.get(name);
      if (series === undefined) {
        series = { color: PALETTE[this.series.size % PALETTE.length], points: [] };
        this.series.set(name, series);
      }
      series.points.push([time, value]);
      while (series.points.length > 0 && series.points[0][0] < time - WINDOW_S) series.points.shift();
    }

    draw(now) {
      const { ctx, width, height } = this.prepareCanvas();
      const plot = { x: MARGIN.left, y: MARGIN.top, w: width - MARGIN.left - MARGIN.right,
                     h: height - MARGIN.top - MARGIN.bottom };
      let highest = 0;
      let oldest = now;
      for (const series of this.series.values()) {
        for (const [time, value] of series.points) {
          highest = Math.max(highest, value);
          oldest = Math.min(oldest, time);
        }
      }
      const top = this.fixedMax ?? Math.max(this.minMax, niceCeiling(highest * 1.1));
      const span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, now - oldest));
      const xOf = (time) => plot.x + plot.w * (1 - (now - time) / span);
      const yOf = (value) => plot.y + plot.h * (1 - Math.min(value, top) / top);
      this.drawAxes(ctx, plot, top, span);
      let count = 0;
      for (const series of this.series.values()) {
        count += series.points.length;
        this.drawSeries(ctx, series, xOf, yOf);
      }
      this.canvas.dataset.points = String(count);
      this.drawLegend();
    }

    prepareCanvas() {
      const ratio = window.devicePixelRatio || 1;
      const width = this.canvas.clientWidth;
      const height = this.canvas.clientHeight;
      if (this.canvas.width !== Math.round(width * ratio) || this.canvas.height !== Math.round(height * ratio)) {
        this.canvas.width = Math.round(width * ratio);
        this.canvas.height = Math.round(height * ratio);
      }
      const ctx = this.canvas.getContext("2d");
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      ctx.clearRect(0, 0, width, height);
      return { ctx, width, height };
    }

    drawAxes(ctx, plot, top, span) {
      ctx.font = "11px system-ui, sans-serif";
      ctx.lineWidth = 1;
      ctx.fillStyle = "#687385";
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (let i = 0; i <= 4; i++) {
        const y = plot.y + plot.h * (1 - i / 4);
        ctx.strokeStyle = i === 0 ? "#9aa4b2" : "#e6e9ef";
        ctx.beginPath();
        ctx.moveTo(plot.x, Math.round(y) + 0.5);
        ctx.lineTo(plot.x + plot.w, Math.round(y) + 0.5);
        ctx.stroke();
        ctx.fillText(formatNumber((top * i) / 4), plot.x - 6, y);
      }
      ctx.textAlign = "center";
      ctx.textBaseline = "top";
      const step = TICK_STEPS_S.find((s) => span / s <= 6) ?? 60;
      for (let age = 0; age <= span; age += step) {
        const x = plot.x + plot.w * (1 - age / span);
        ctx.fillText(formatAge(age), Math.max(plot.x + 14, Math.min(x, plot.x + plot.w - 12)), plot.y + plot.h + 5);
      }
    }

    drawSeries(ctx, series, xOf, yOf) {
      const points = series.points;
      ctx.strokeStyle = series.color;
      ctx.fillStyle = series.color;
      ctx.lineWidth = 2;
      if (points.length === 1) {
        ctx.beginPath();
        ctx.arc(xOf(points[0][0]), yOf(points[0][1]), 2.5, 0, 2 * Math.PI);
        ctx.fill();
        return;
      }
      ctx.beginPath();
      points.forEach(([time, value], i) => {
        if (i === 0) ctx.moveTo(xOf(time), yOf(value));
        else ctx.lineTo(xOf(time), yOf(value));
      });
      ctx.stroke();
    }

    drawLegend() {
      const items = [];
      for (const [name, series] of this.series) {
        const item = document.createElement("span");
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = series.color;
        item.append(swatch, `${name}: ${this.legendValue(series.points)}`);
        items.push(item);
      }
      this.legend.replaceChildren(...items);
    }
  }

  const byId = (id) => document.getElementById(id);
  const charts = {
    tokens: new LineChart(byId("chart-tokens"), byId("legend-tokens")),
    queues: new LineChart(byId("chart-queues"), byId("legend-queues"), { minMax: 4 }),
    memory: new LineChart(byId("chart-memory"), byId("legend-memory"), {
      fixedMax: 100, legendValue: (points) => `${points[points.length - 1][1].toFixed(1)} %`,
    }),
    preemptions: new LineChart(byId("chart-preemptions"), byId("legend-preemptions"), {
      minMax: 4,
      legendValue: (points) => `${points.reduce((sum, [, value]) => sum + value, 0)} in the last 5 min`,
    }),
  };
  let latestTime = 0;
  let numSnapshots = 0;

  function renderTenants(tenants) {
    const rows = tenants.map((tenant) => {
      const row = document.createElement("tr");
      const cells = [tenant.tenant, formatNumber(tenant.generation_tokens_per_s),
                     formatNumber(tenant.prompt_tokens_per_s), tenant.queued.interactive, tenant.queued.batch,
                     formatNumber(tenant.vtc.interactive), formatNumber(tenant.vtc.batch)];
      for (const value of cells) {
        const cell = document.createElement("td");
        cell.textContent = String(value);
        row.append(cell);
      }
      return row;
    });
    byId("tenant-rows").replaceChildren(...rows);
  }

  function update(snapshot) {
    const time = snapshot.time;
    for (const tenant of snapshot.tenants) charts.tokens.push(tenant.tenant, time, tenant.generation_tokens_per_s);
    let swapped = 0;
    for (const [name, counts] of Object.entries(snapshot.classes)) {
      charts.queues.push(name, time, counts.waiting);
      swapped += counts.swapped;
    }
    charts.queues.push("swapped out", time, swapped);
    charts.memory.push("KV cache", time, 100 * snapshot.kv_cache_usage);
    charts.memory.push("CPU swap pool", time, 100 * snapshot.cpu_swap_usage);
    for (const [mode, counts] of Object.entries(snapshot.preemptions)) charts.preemptions.push(mode, time, counts.new);
    latestTime = time;
    redraw();
    renderTenants(snapshot.tenants);
    numSnapshots += 1;
    document.body.dataset.snapshots = String(numSnapshots);
  }

  function redraw() {
    if (latestTime === 0) return;
    for (const chart of Object.values(charts)) chart.draw(latestTime);
  }

  const status = byId("status");
  const source = new EventSource("/dashboard/events");
  source.onopen = () => {
    status.textContent = "live";
    status.className = "live";
  };
  source.onerror = () => {
    status.textContent = "reconnecting…";
    status.className = "";
  };
  source.onmessage = (message) => update(JSON.parse(message.data));
  window.addEventListener("resize", redraw);
})();
