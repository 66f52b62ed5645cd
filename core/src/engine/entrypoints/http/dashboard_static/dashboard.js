// The live view: reads /dashboard/feed (server-sent events, through fetch so that the API key
// can go in a header), keeps the last HISTORY events for the charts, fills the tiles and tables,
// and draws one request's timeline from /dashboard/requests/{rid}.
"use strict";
(function () {
  const HISTORY = 300;
  const KEY_STORE = "engine-dashboard-key";
  const $ = (id) => document.getElementById(id);
  const events = [];
  const charts = {};
  let picked = null;
  let controller = null;

  function headers() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  function setStatus(text, cls) {
    const el = $("status");
    el.textContent = text;
    el.className = "status " + (cls || "");
  }

  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    return Number(v).toFixed(digits === undefined ? 0 : digits);
  }
  const pct = (v) => (v === null || v === undefined ? null : 100 * v);

  function makeChart(id, series) {
    const el = $(id);
    const opts = {
      width: Math.max(300, el.clientWidth || 380), height: 170,
      scales: { x: { time: true } },
      series: [{}].concat(series.map((s) => ({ label: s[0], stroke: s[1], width: 1.5, spanGaps: true, dash: s[3] }))),
      axes: [{}, { size: 50 }],
      legend: { live: false },
    };
    charts[id] = { plot: new uPlot(opts, [[]].concat(series.map(() => [])), el), fields: series.map((s) => s[2]) };
  }

  function initCharts() {
    makeChart("c-load", [["running", "#2f6fdf", (e) => e.running], ["queued", "#e0a21b", (e) => e.queued],
                         ["decode batch", "#3aa35c", (e) => e.decode_batch_size, [5, 4]]]);
    makeChart("c-kv", [["device KV", "#2f6fdf", (e) => pct(e.kv_usage)], ["host KV", "#8c5bd6", (e) => pct(e.host_kv_usage)],
                       ["cache hit", "#3aa35c", (e) => pct(e.cache_hit_rate)]]);
    makeChart("c-tput", [["prefill", "#2f6fdf", (e) => e.prefill_tokens_per_s], ["decode", "#3aa35c", (e) => e.decode_tokens_per_s]]);
    const q = (key, p) => (e) => e[key][p];
    makeChart("c-ttft", [["p50", "#3aa35c", q("ttft", "p50")], ["p90", "#e0a21b", q("ttft", "p90")], ["p99", "#d04545", q("ttft", "p99")]]);
    makeChart("c-itl", [["p50", "#3aa35c", q("itl", "p50")], ["p90", "#e0a21b", q("itl", "p90")], ["p99", "#d04545", q("itl", "p99")]]);
    window.addEventListener("resize", () => {
      for (const id in charts) charts[id].plot.setSize({ width: Math.max(300, $(id).clientWidth), height: 170 });
    });
  }

  function updateCharts() {
    const xs = events.map((e) => e.time);
    for (const id in charts) {
      const c = charts[id];
      const series = c.fields.map((f) => events.map(f));
      c.plot.setData([xs].concat(series));
      // What the chart holds, for scripts and tests reading the page: points, and each series' peak.
      $(id).dataset.points = String(xs.length);
      $(id).dataset.peaks = JSON.stringify(series.map((v) => Math.max(0, ...v.filter((x) => x !== null && x !== undefined))));
    }
  }

  function row(cells, rid) {
    const tr = document.createElement("tr");
    tr.dataset.rid = rid;
    if (rid === picked) tr.className = "picked";
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      if (cls === "state") {
        const s = document.createElement("span");
        s.className = "state " + text;
        s.textContent = text;
        td.appendChild(s);
      } else {
        td.textContent = text;
        if (cls) td.className = cls;
      }
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => pick(rid));
    return tr;
  }

  function updateTables(e) {
    const body = $("inflight").tBodies[0];
    body.replaceChildren(...e.requests.map((r) => row([[r.rid], [r.state, "state"], [fmt(r.age_s, 1), "num"],
      [r.prompt_tokens, "num"], [r.output_tokens, "num"], [r.cached_tokens, "num"]], r.rid)));
    $("n-inflight").textContent = "(" + e.requests.length + ")";
    $("recent").tBodies[0].replaceChildren(...e.recent.map((r) => row([[r.rid], [r.finish_reason || "–"],
      [r.output_tokens, "num"], [fmt(r.latency_s, 2), "num"]], r.rid)));
  }

  function updateTiles(e) {
    $("t-running").textContent = e.running;
    $("t-queued").textContent = e.queued + (e.grammar_queued ? " +" + e.grammar_queued + " grammar" : "");
    $("t-batch").textContent = e.decode_batch_size;
    $("t-kv").textContent = fmt(pct(e.kv_usage), 1) + "%";
    $("t-host").textContent = e.host_kv_usage === null ? "no tier" : fmt(pct(e.host_kv_usage), 1) + "%";
    $("t-hit").textContent = e.cache_hit_rate === null ? "–" : fmt(pct(e.cache_hit_rate), 1) + "%";
    $("t-prefill").textContent = fmt(e.prefill_tokens_per_s);
    $("t-decode").textContent = fmt(e.decode_tokens_per_s);
    const minutes = fmt(e.window_s / 60);
    $("h-ttft").textContent = "Time to first token (s), last " + minutes + " min";
    $("h-itl").textContent = "Inter-token latency (s), last " + minutes + " min";
  }

  function onEvent(e) {
    if (e.error) { setStatus(e.error, "error"); return; }
    setStatus("live", "live");
    events.push(e);
    if (events.length > HISTORY) events.shift();
    document.body.dataset.events = String(Number(document.body.dataset.events) + 1);
    updateTiles(e);
    updateCharts();
    updateTables(e);
    if (picked && e.requests.some((r) => r.rid === picked)) loadTimeline(picked);
  }

  async function connect() {
    if (controller) controller.abort();
    controller = new AbortController();
    let response;
    try {
      response = await fetch("/dashboard/feed", { headers: headers(), signal: controller.signal });
    } catch (err) {
      setStatus("disconnected; retrying", "error");
      setTimeout(connect, 2000);
      return;
    }
    if (response.status === 401) {
      setStatus("this server needs its API key", "error");
      $("keyform").hidden = false;
      return;
    }
    if (!response.ok) {
      setStatus("feed answered " + response.status, "error");
      setTimeout(connect, 5000);
      return;
    }
    $("keyform").hidden = true;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of block.split("\n")) {
            if (line.startsWith("data: ")) onEvent(JSON.parse(line.slice(6)));
          }
        }
      }
    } catch (err) {
      if (err.name === "AbortError") return;
    }
    setStatus("disconnected; retrying", "error");
    setTimeout(connect, 2000);
  }

  const SEGMENT = { arrived: "wait", queued: "wait", scheduled: "wait", grammar: "grammar",
                    prefill_chunk: "prefill", first_token: "decode", retracted: "retracted" };

  function drawTimeline(t) {
    const box = $("timeline");
    box.replaceChildren();
    const head = document.createElement("p");
    head.textContent = t.rid + " — " + t.state + (t.finish_reason ? " (" + t.finish_reason + ")" : "") + ", " +
      t.prompt_tokens + " tokens in (" + t.cached_tokens + " cached), " + t.output_tokens + " out, " +
      fmt(t.age_s, 3) + " s";
    box.appendChild(head);
    const total = Math.max(t.age_s, 1e-6);
    const bar = document.createElement("div");
    bar.className = "bar";
    t.events.forEach((ev, i) => {
      const kind = SEGMENT[ev.stage];
      if (!kind) return;
      const end = i + 1 < t.events.length ? t.events[i + 1].t : t.age_s;
      const seg = document.createElement("div");
      seg.className = "seg " + kind;
      seg.style.left = (100 * ev.t / total) + "%";
      seg.style.width = Math.max(0.3, 100 * (end - ev.t) / total) + "%";
      seg.title = ev.stage + " at " + fmt(ev.t, 4) + " s";
      bar.appendChild(seg);
    });
    box.appendChild(bar);
    const list = document.createElement("ol");
    for (const ev of t.events) {
      const li = document.createElement("li");
      li.dataset.stage = ev.stage;
      li.textContent = "+" + fmt(ev.t * 1000, 1) + " ms  " + ev.stage + (ev.stage === "prefill_chunk" ? " (" + ev.tokens + " tokens)" : "");
      list.appendChild(li);
    }
    box.appendChild(list);
  }

  async function loadTimeline(rid) {
    const r = await fetch("/dashboard/requests/" + encodeURIComponent(rid), { headers: headers() });
    if (r.ok) drawTimeline(await r.json());
    else $("timeline").textContent = (await r.json()).error.message;
  }

  function pick(rid) {
    picked = rid;
    $("rid").value = rid;
    for (const tr of document.querySelectorAll("tbody tr")) tr.classList.toggle("picked", tr.dataset.rid === rid);
    loadTimeline(rid);
  }

  $("pick").addEventListener("submit", (ev) => { ev.preventDefault(); if ($("rid").value) pick($("rid").value.trim()); });
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key").value);
    connect();
  });
  initCharts();
  connect();
})();
