// The pagedserve dashboard: polls dashboard/state once a second and draws it.
// No dependencies and no external URL. The API key comes from the URL fragment
// (/dashboard#key=KEY) or the key box, stays in sessionStorage (this tab only), and is
// sent as "Authorization: Bearer KEY"; a 401 stops polling until a key is entered.
"use strict";

(() => {
  const POLL_MS = 1000;
  const KEY_ITEM = "pagedserve.dashboard.key";
  const MAX_ROWS = 200; // table rows drawn; the rest are counted below the table
  const MAP_MAX_HEIGHT = 320; // CSS pixels the block map may take
  const MAX_CELL = 22; // CSS pixels of a block's square at most
  const STATE_NAMES = {
    free: "free",
    cached: "cached-free (evictable prefix)",
    used: "in use",
    shared: "shared by several sequences",
  };

  const $ = (id) => document.getElementById(id);
  const style = getComputedStyle(document.documentElement);
  const color = (name) => style.getPropertyValue("--" + name).trim();

  let latest = null; // the last state drawn, drawn again when the window is resized
  let generation = 0; // bumped by restart(), so that at most one poll loop runs
  let timer = null;

  // --- the API key ---------------------------------------------------------------------

  function takeKeyFromFragment() {
    const key = new URLSearchParams(location.hash.slice(1)).get("key");
    if (key !== null) {
      sessionStorage.setItem(KEY_ITEM, key);
      // Out of the address bar, so that it is neither bookmarked nor shown.
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  const apiKey = () => sessionStorage.getItem(KEY_ITEM) || "";

  // --- polling -------------------------------------------------------------------------

  function setStatus(text, kind) {
    const status = $("status");
    status.textContent = text;
    status.className = kind;
  }

  async function poll(mine) {
    const key = apiKey();
    const headers = key ? { Authorization: "Bearer " + key } : {};
    try {
      const response = await fetch("dashboard/state", { headers, cache: "no-store" });
      if (mine !== generation) return;
      if (response.status === 401) {
        setStatus(
          key
            ? "401: the API key was refused; enter the server's api_key"
            : "401: this server requires an API key; open /dashboard#key=KEY or enter it",
          "error",
        );
        return;
      }
      if (response.ok) {
        const state = await response.json();
        if (mine !== generation) return;
        latest = state;
        render(state);
        setStatus("live · " + new Date(state.time * 1000).toLocaleTimeString(), "ok");
      } else {
        const body = await response.json().catch(() => null);
        const message = body && body.error ? body.error.message : response.statusText;
        setStatus(`${response.status}: ${message}`, "error");
      }
    } catch (error) {
      if (mine !== generation) return;
      setStatus("cannot reach the server: " + error.message, "error");
    }
    timer = setTimeout(poll, POLL_MS, mine);
  }

  function restart() {
    generation += 1;
    clearTimeout(timer);
    poll(generation);
  }

  // --- drawing -------------------------------------------------------------------------

  function render(state) {
    $("model").textContent = state.model;
    renderTotals(state);
    renderBlocks(state.blocks);
    renderCharts(state.history);
    renderSequences(state.sequences, state.scheduling_policy);
  }

  const percent = (ratio) => (ratio === null ? "–" : (100 * ratio).toFixed(1) + " %");
  const seconds = (value) =>
    value < 1 ? (1000 * value).toFixed(0) + " ms" : value.toFixed(value < 10 ? 2 : 1) + " s";
  const mebibytes = (bytes) => (bytes / 1048576).toFixed(0) + " MiB";
  const count = (value) => (Number.isInteger(value) ? String(value) : value.toFixed(1));

  function renderTotals(state) {
    const totals = state.totals;
    const samples = state.history.samples;
    const last = samples[samples.length - 1];
    const ttft = samples.filter((sample) => sample.time_to_first_token !== null).pop();
    $("running").textContent = totals.num_running;
    $("waiting").textContent = totals.num_waiting;
    $("tokens-per-s").textContent = last ? last.generation_tokens_per_s.toFixed(1) : "–";
    $("ttft").textContent = ttft ? seconds(ttft.time_to_first_token) : "–";
    $("kv-usage").textContent = percent(totals.kv_usage);
    $("hit-rate").textContent = percent(state.prefix_cache_hit_rate);
    const tier = totals.tier;
    $("tier-tile").hidden = !tier;
    if (tier) {
      $("tier-medium").textContent = tier.medium;
      $("tier").textContent =
        percent(tier.bytes_used / tier.capacity) + " of " + mebibytes(tier.capacity) +
        ", " + totals.external_prefix_cache_hits;
    }
    const accepted = state.acceptance_length;
    $("acceptance").textContent = accepted === null ? "–" : accepted.toFixed(2);
  }

  // A canvas of `height` CSS pixels (its CSS width is the page's), sharp on any display.
  function sized(canvas, height) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.height = height + "px";
    const context = canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    return { context, width };
  }

  function renderBlocks(blocks) {
    const states = blocks.states;
    const perCell = drawBlockMap($("blocks"), states, blocks.legend);
    let info = `· ${states.length} blocks of ${blocks.block_size} tokens`;
    if (perCell > 1) info += ` · a square is ${perCell} blocks, in the state of most of them`;
    $("block-info").textContent = info;
    const items = Object.entries(blocks.counts).map(([name, blockCount]) => {
      const item = document.createElement("li");
      item.dataset.state = name;
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = color(name);
      const number = document.createElement("b");
      number.textContent = blockCount;
      const share = ((100 * blockCount) / states.length).toFixed(0);
      item.append(swatch, STATE_NAMES[name] + ": ", number, ` (${share} %)`);
      return item;
    });
    $("legend").replaceChildren(...items);
  }

  // One square per block (per `perCell` blocks when even 1-pixel squares do not fit),
  // row by row in block-id order; returns `perCell`.
  function drawBlockMap(canvas, states, legend) {
    const blockCount = states.length;
    const width = canvas.clientWidth;
    const fit = Math.floor(Math.sqrt((width * MAP_MAX_HEIGHT) / blockCount));
    const cell = Math.min(MAX_CELL, Math.max(1, fit));
    const columns = Math.max(1, Math.floor(width / cell));
    const perCell = Math.ceil(blockCount / (columns * Math.floor(MAP_MAX_HEIGHT / cell)));
    const cells = Math.ceil(blockCount / perCell);
    const { context } = sized(canvas, Math.ceil(cells / columns) * cell);
    const gap = cell >= 4 ? 1 : 0;
    const paths = new Map(Object.keys(legend).map((code) => [code, new Path2D()]));
    for (let index = 0; index < cells; index++) {
      const code =
        perCell === 1
          ? states[index]
          : mostCommon(states.slice(index * perCell, (index + 1) * perCell));
      const x = (index % columns) * cell;
      const y = Math.floor(index / columns) * cell;
      paths.get(code).rect(x, y, cell - gap, cell - gap);
    }
    for (const [code, path] of paths) {
      context.fillStyle = color(legend[code]);
      context.fill(path);
    }
    return perCell;
  }

  function mostCommon(text) {
    const seen = {};
    let best = text[0];
    for (const character of text) {
      seen[character] = (seen[character] || 0) + 1;
      if (seen[character] > seen[best]) best = character;
    }
    return best;
  }

  function renderCharts(history) {
    const samples = history.samples;
    // The time axis spans the samples there are: a minute at least, the window at most.
    const end = samples.length ? samples[samples.length - 1].time : Date.now() / 1000;
    const start = samples.length ? samples[0].time : end;
    const span = Math.min(history.window, Math.max(60, end - start));
    const range = { start: end - span, end };
    const tokens = [{ key: "generation_tokens_per_s", color: "tokens" }];
    drawChart($("chart-tokens"), samples, range, tokens, { format: count });
    const ttft = [{ key: "time_to_first_token", color: "ttft", dots: true }];
    drawChart($("chart-ttft"), samples, range, ttft, { format: seconds });
    const queue = [
      { key: "waiting", color: "waiting" },
      { key: "running", color: "running" },
    ];
    drawChart($("chart-queue"), samples, range, queue, { format: count });
    const cache = [
      { key: "prefix_cache_hit_rate", color: "hit-rate", dots: true },
      { key: "kv_usage", color: "kv-usage" },
    ];
    const ratio = (value) => (100 * value).toFixed(0) + " %";
    drawChart($("chart-cache"), samples, range, cache, { top: 1, format: ratio });
  }

  // Lines over time (a gap where a value is null); `options.top` fixes the y axis' top,
  // else it is the next 1, 2 or 5 x 10^k above the largest value.
  function drawChart(canvas, samples, range, series, options) {
    const height = canvas.clientHeight;
    const { context, width } = sized(canvas, height);
    const left = 52;
    const right = 8;
    const top = 8;
    const bottom = 18;
    let max = options.top;
    if (max === undefined) {
      const values = samples.flatMap((sample) => series.map((line) => sample[line.key]));
      max = niceCeiling(Math.max(0, ...values.filter((value) => value !== null)));
    }
    const span = range.end - range.start;
    const x = (time) => left + ((time - range.start) / span) * (width - left - right);
    const y = (value) => top + (height - top - bottom) * (1 - Math.min(value, max) / max);
    context.font = "11px system-ui, sans-serif";
    context.lineWidth = 1;
    context.strokeStyle = color("line");
    context.fillStyle = color("muted");
    context.textAlign = "right";
    context.textBaseline = "middle";
    for (const value of [0, max / 2, max]) {
      const level = Math.round(y(value)) + 0.5;
      context.beginPath();
      context.moveTo(left, level);
      context.lineTo(width - right, level);
      context.stroke();
      context.fillText(options.format(value), left - 6, level);
    }
    context.textBaseline = "alphabetic";
    context.fillText("now", width - right, height - 4);
    context.textAlign = "left";
    const ago = span >= 120 ? `${Math.round(span / 60)} min` : `${Math.round(span)} s`;
    context.fillText("−" + ago, left, height - 4);
    context.lineWidth = 1.5;
    for (const line of series) {
      context.strokeStyle = context.fillStyle = color(line.color);
      context.beginPath();
      let drawing = false;
      for (const sample of samples) {
        const value = sample[line.key];
        if (value === null) {
          drawing = false;
          continue;
        }
        const px = x(sample.time);
        const py = y(value);
        if (drawing) context.lineTo(px, py);
        else context.moveTo(px, py);
        drawing = true;
        if (line.dots) context.fillRect(px - 1.5, py - 1.5, 3, 3);
      }
      context.stroke();
    }
  }

  function niceCeiling(value) {
    if (value <= 0) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    return [1, 2, 5, 10].map((step) => step * power).find((ceiling) => ceiling >= value);
  }

  function cell(text, className, field) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    if (field) td.dataset.field = field;
    return td;
  }

  function stateCell(seq) {
    let label = "waiting";
    if (seq.status === "running") {
      // A decoding sequence has computed all but the token it sampled last.
      const prefill = seq.computed_tokens + 1 < seq.prompt_tokens + seq.output_tokens;
      label = prefill ? "prefill" : "decode";
    }
    if (seq.preemptions) label += ` · preempted ${seq.preemptions}×`;
    const badge = document.createElement("span");
    badge.className = "state " + seq.status;
    badge.textContent = label;
    const td = document.createElement("td");
    td.append(badge);
    return td;
  }

  function progressCell(seq) {
    const bar = document.createElement("progress");
    bar.max = seq.max_tokens;
    bar.value = seq.output_tokens;
    const td = cell("", "", "progress");
    const share = ((100 * seq.output_tokens) / seq.max_tokens).toFixed(0);
    td.append(bar, `${seq.output_tokens} / ${seq.max_tokens} (${share} %)`);
    return td;
  }

  const POLICY_NOTES = {
    fcfs: "· waiting ones in arrival order (fcfs)",
    priority: "· waiting ones by priority (lower first), then arrival",
  };

  function renderSequences(sequences, policy) {
    $("policy").textContent = POLICY_NOTES[policy] || policy;
    const rows = sequences.slice(0, MAX_ROWS).map((seq) => {
      const row = document.createElement("tr");
      row.dataset.seqId = seq.seq_id;
      const id = cell(seq.seq_id, "id");
      id.title = `${seq.seq_id} (request ${seq.request_id})`;
      const ttft = seq.time_to_first_token;
      row.append(
        id,
        stateCell(seq),
        cell(seq.priority, "num", "priority"),
        cell(seq.prompt_tokens, "num"),
        cell(seq.cached_tokens, "num"),
        cell(seq.output_tokens, "num", "generated"),
        progressCell(seq),
        cell(seconds(seq.age), "num"),
        cell(ttft === null ? "–" : seconds(ttft), "num"),
      );
      return row;
    });
    $("sequences").replaceChildren(...rows);
    const hidden = sequences.length - rows.length;
    let note = "";
    if (!sequences.length) note = "No request in flight.";
    else if (hidden) note = `and ${hidden} more`;
    $("sequences-note").textContent = note;
  }

  // --- start ---------------------------------------------------------------------------

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_ITEM, $("key").value);
    $("key").value = "";
    restart();
  });
  window.addEventListener("hashchange", () => {
    takeKeyFromFragment();
    restart();
  });
  window.addEventListener("resize", () => latest && render(latest));
  takeKeyFromFragment();
  restart();
})();
