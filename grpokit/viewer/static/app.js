/* grpokit trajectory viewer (grpokit/viewer, docs/viewer.md): curves drawn with uPlot, a browser over steps and
   groups with per-token colouring. Reads the JSON inlined as #grpokit-data; in --serve mode polls ./version and
   reloads ./data.json when the run has written more. No network beyond that server, nothing else fetched. */
(function () {
  "use strict";
  let DATA = null; // the inlined data, type-checked (checked() below) before the first render
  const LIVE = document.body.dataset.live === "1";
  const state = { step: null, filter: "all", sort: "group", search: "", colour: "logprob", follow: true };
  const charts = [];
  // a link may choose the view: report.html#step=3&colour=entropy&filter=zero&sort=high&q=text
  for (const [k, v] of new URLSearchParams(location.hash.slice(1))) {
    if (k === "step" && /^\d+$/.test(v)) { state.step = Number(v); state.follow = false; }
    else if (k === "colour" && ["logprob", "entropy", "advantage", "mask"].includes(v)) state.colour = v;
    else if (k === "filter" && ["all", "signal", "zero", "truncated"].includes(v)) state.filter = v;
    else if (k === "sort" && ["group", "high", "low"].includes(v)) state.sort = v;
    else if (k === "q") state.search = v.toLowerCase();
  }

  // -- the data, type-checked: every row is untrusted (a run's own completions can hold anything) ----------------
  function checked(d) {
    const obj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
    const out = {
      run: typeof d.run === "string" ? d.run : "run", version: typeof d.version === "string" ? d.version : "",
      args: obj(d.args) ? d.args : {}, logs: Array.isArray(d.logs) ? d.logs.filter(obj) : [],
      completion_steps: obj(d.completion_steps) ? d.completion_steps : {}, completions: {},
      skipped_rows: obj(d.skipped_rows) ? d.skipped_rows : {},
    };
    let dropped = 0;
    for (const [step, rows] of Object.entries(obj(d.completions) ? d.completions : {})) {
      if (!/^\d+$/.test(step) || !Array.isArray(rows)) continue;
      out.completions[step] = [];
      for (const r of rows) {
        const row = obj(r) ? checkedRow(r) : null;
        if (row) out.completions[step].push(row); else dropped += 1;
      }
    }
    if (dropped) out.skipped_rows = Object.assign({}, out.skipped_rows, { "page (wrong shape)": dropped });
    return out;
  }

  function checkedRow(r) {
    const str = (v) => (typeof v === "string" ? v : undefined);
    const nums = (v, n) => Array.isArray(v) && v.length === n && v.every((x) => x === null || typeof x === "number");
    const row = Object.assign({}, r, {
      prompt: str(r.prompt) || "", completion: str(r.completion) || "",
      group: typeof r.group === "string" || typeof r.group === "number" ? String(r.group) : undefined,
      truncated: r.truncated === true, tokens: null,
      advantage: isNum(r.advantage) ? r.advantage : undefined, reward: isNum(r.reward) ? r.reward : undefined,
      thumbnails: Array.isArray(r.thumbnails) ? r.thumbnails.filter((u) => typeof u === "string") : [],
      messages: Array.isArray(r.messages) ? r.messages.filter((m) => m !== null && typeof m === "object" && typeof m.role === "string") : undefined,
    });
    const t = r.tokens;
    if (t && typeof t === "object" && Array.isArray(t.text) && t.text.every((x) => typeof x === "string")) {
      const n = t.text.length;
      if (nums(t.logprob, n) && nums(t.mask, n) && (t.entropy === undefined || t.entropy === null || nums(t.entropy, n))) {
        row.tokens = { text: t.text, logprob: t.logprob, mask: t.mask, entropy: t.entropy || null, cut: isNum(t.cut) ? t.cut : 0 };
      }
    }
    return row;
  }

  // -- helpers ---------------------------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }
  const fmt = (v, d = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const tick = (v) => (v === null ? "" : v !== 0 && Math.abs(v) < 1e-2 ? v.toExponential(1) : String(+v.toPrecision(3)));

  function rewardNames() {
    const names = new Set();
    for (const row of DATA.logs) for (const k of Object.keys(row)) {
      const m = /^rewards\/(.+)\/mean$/.exec(k);
      if (m) names.add(m[1]);
    }
    return [...names];
  }

  // -- curves ----------------------------------------------------------------------------------------------------
  const PALETTE = ["#2f6fdf", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c", "#5c940d", "#495057"];

  function curveGroups(keys) {
    const has = (k) => keys.includes(k);
    const starts = (p, s = "") => keys.filter((k) => k.startsWith(p) && k.endsWith(s)).sort();
    const groups = [
      { id: "reward", title: "reward (weighted) and reward per function", keys: [...(has("reward") ? ["reward"] : []), ...starts("rewards/", "/mean")] },
      { id: "loss", title: "loss", keys: ["loss", "chord/sft_loss"].filter(has) },
      { id: "kl", title: "KL(policy ‖ ref)", keys: ["kl"].filter(has) },
      { id: "lengths", title: "completion length (tokens)", keys: ["completions/mean_length", "completions/max_length", "completions/min_length"].filter(has) },
      { id: "clip", title: "clip and truncation rates", keys: [...starts("clip_ratio/"), ...["completions/clipped_ratio", "frac_reward_zero_std"].filter(has)] },
      { id: "time", title: "time split (s per step)", keys: starts("timing/") },
      { id: "entropy", title: "entropy", keys: ["entropy"].filter(has) },
      { id: "eval", title: "evaluation", keys: starts("eval/") },
      { id: "grad_norm", title: "gradient norm (before clipping)", keys: ["grad_norm"].filter(has) },
      { id: "learning_rate", title: "learning rate", keys: ["learning_rate"].filter(has) },
    ];
    return groups.filter((g) => g.keys.length);
  }

  function mergedSteps() {
    const byStep = new Map();
    for (const row of DATA.logs) {
      if (!isNum(row.step)) continue;
      byStep.set(row.step, Object.assign(byStep.get(row.step) || {}, row));
    }
    return [...byStep.entries()].sort((a, b) => a[0] - b[0]);
  }

  function drawCharts() {
    const box = document.getElementById("charts");
    for (const c of charts.splice(0)) c.destroy();
    box.replaceChildren();
    const steps = mergedSteps();
    if (!steps.length) { box.append(el("p", { class: "empty", text: "logging.jsonl has no rows yet" })); return; }
    const keys = new Set();
    for (const [, row] of steps) for (const [k, v] of Object.entries(row)) if (k !== "step" && isNum(v)) keys.add(k);
    const xs = steps.map(([s]) => s);
    for (const g of curveGroups([...keys])) {
      const ys = g.keys.map((k) => steps.map(([, row]) => (isNum(row[k]) ? row[k] : null)));
      const div = el("div", { class: "chart", "data-key": g.id, "data-series": g.keys.join(","), "data-points": String(xs.length) },
        el("h3", { text: g.title }));
      box.append(div);
      const opts = {
        width: 430, height: 210,
        scales: { x: { time: false } },
        series: [{ label: "step", value: (u, v) => (v === null ? "–" : String(v)) },
          ...g.keys.map((k, i) => ({ label: k, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
            points: { show: xs.length < 60 }, value: (u, v) => (v === null ? "–" : Number(v).toPrecision(4)) }))],
        axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] }, { size: 60, values: (u, splits) => splits.map(tick) }],
      };
      let u;
      try { u = new uPlot(opts, [xs, ...ys], div); } catch (e) { div.append(el("p", { class: "empty", text: "this curve could not be drawn" })); continue; }
      charts.push(u);
      // the legend shows the last step's values (uPlot writes them at the cursor's index)
      u.setCursor({ left: u.valToPos(xs[xs.length - 1], "x"), top: 10 });
      div.dataset.last = JSON.stringify(ys.map((y) => y[y.length - 1]));
    }
  }

  // -- the browser over steps and groups -------------------------------------------------------------------------
  function completionSteps() {
    return Object.keys(DATA.completions).map(Number).sort((a, b) => a - b);
  }

  function buildControls() {
    const c = document.getElementById("controls");
    const steps = completionSteps();
    const sel = el("select", { id: "step-select", onchange: (e) => { state.step = Number(e.target.value); state.follow = state.step === steps[steps.length - 1]; renderStep(); } });
    for (const s of steps) sel.append(el("option", { value: String(s), text: `step ${s}` }));
    const move = (d) => () => {
      const i = steps.indexOf(state.step) + d;
      if (i >= 0 && i < steps.length) { state.step = steps[i]; sel.value = String(state.step); state.follow = i === steps.length - 1; renderStep(); }
    };
    const choice = (id, key, options) => {
      const s = el("select", { id, onchange: (e) => { state[key] = e.target.value; renderStep(); } });
      for (const [v, t] of options) s.append(el("option", { value: v, text: t }));
      s.value = state[key];
      return s;
    };
    c.replaceChildren(
      el("button", { id: "prev-step", onclick: move(-1), text: "◀" }), sel, el("button", { id: "next-step", onclick: move(1), text: "▶" }),
      el("label", { text: "show " }, choice("filter", "filter", [["all", "all groups"], ["signal", "groups with signal"], ["zero", "zero-signal groups"], ["truncated", "truncated completions"]])),
      el("label", { text: "order " }, choice("sort", "sort", [["group", "as generated"], ["high", "highest reward first"], ["low", "lowest reward first"]])),
      el("label", { text: "colour tokens by " }, choice("colour", "colour", [["logprob", "logprob"], ["entropy", "entropy"], ["advantage", "advantage"], ["mask", "loss mask"]])),
      el("input", { type: "search", id: "search", placeholder: "search prompts and completions", value: state.search,
        oninput: (e) => { state.search = e.target.value.toLowerCase(); renderStep(); } }),
      el("span", { class: "legend-scale", id: "colour-legend" }));
    if (!steps.length) return;
    if (state.step === null || state.follow || !steps.includes(state.step)) state.step = steps[steps.length - 1];
    sel.value = String(state.step);
  }

  function groupsOf(rows) {
    const groups = new Map();
    rows.forEach((row, i) => {
      const g = row.group !== undefined ? String(row.group) : row.prompt;
      if (!groups.has(g)) groups.set(g, { id: g, prompt: row.prompt, rows: [] });
      groups.get(g).rows.push(Object.assign({ _index: i }, row));
    });
    for (const g of groups.values()) {
      const r = g.rows.map(rowReward);
      g.mean = r.reduce((a, b) => a + b, 0) / r.length;
      g.zero = r.every((v) => v === r[0]);
    }
    return [...groups.values()];
  }

  function rowReward(row) {
    if (isNum(row.reward)) return row.reward;
    return rewardNames().reduce((a, n) => a + (isNum(row[n]) ? row[n] : 0), 0);
  }

  const COLOURS = {
    logprob: { legend: "white = likely, red = unlikely (p = e^logprob)", bg: (t, row) => `rgba(224,49,49,${(1 - Math.exp(t.v)).toFixed(3)})`, value: (tok, i) => tok.logprob[i] },
    entropy: { legend: "blue = high entropy (relative to the step's highest)", bg: (t, row, scale) => t.v === null ? "transparent" : `rgba(47,111,223,${Math.min(1, t.v / scale.entropy).toFixed(3)})`, value: (tok, i) => (tok.entropy ? tok.entropy[i] : null) },
    advantage: { legend: "green = positive advantage, red = negative (trained tokens)", bg: (t, row, scale) => t.m ? (row.advantage >= 0 ? `rgba(43,138,62,${Math.min(1, Math.abs(row.advantage) / scale.advantage).toFixed(3)})` : `rgba(224,49,49,${Math.min(1, Math.abs(row.advantage) / scale.advantage).toFixed(3)})`) : "transparent", value: (tok, i, row) => tok.mask[i] ? row.advantage : 0 },
    mask: { legend: "green = trained (loss mask 1), grey = masked (prompt-side, tool or environment output)", bg: (t) => t.m ? "rgba(43,138,62,0.30)" : "rgba(134,142,150,0.30)", value: (tok, i) => tok.mask[i] },
  };

  function tokenSpans(row, scale) {
    const tok = row.tokens;
    const mode = COLOURS[state.colour];
    const box = el("div", { class: "tokens" });
    tok.text.forEach((piece, i) => {
      const t = { v: mode.value(tok, i, row), m: tok.mask[i] };
      box.append(el("span", {
        class: "tok" + (t.m ? "" : " masked"), "data-i": String(i), "data-v": String(t.v), "data-mask": String(t.m),
        style: `background:${mode.bg(t, row, scale)}`,
        title: `${JSON.stringify(piece)}  logprob ${fmt(tok.logprob[i])}  entropy ${fmt(tok.entropy ? tok.entropy[i] : null)}  ${t.m ? "trained" : "masked (not trained)"}`,
        text: piece }));
    });
    if (tok.cut) box.append(el("div", { class: "cut", text: `… ${tok.cut} more tokens (beyond --log_completions_max_tokens)` }));
    return box;
  }

  function turns(row) {
    if (!Array.isArray(row.messages)) return null;
    const start = row.messages.findIndex((m) => m.role === "assistant");
    if (start < 0) return null;
    const list = el("details", { class: "turns" }, el("summary", { text: `conversation: ${row.messages.length - start} turns after the prompt` }));
    for (const m of row.messages.slice(start)) {
      const trained = m.role === "assistant";
      const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
      list.append(el("div", { class: "turn " + (trained ? "trained" : "masked"), "data-role": m.role },
        el("span", { class: "role", text: `${m.role}${trained ? "" : " · masked (not trained)"}: ` }), content));
    }
    list.open = true;
    return list;
  }

  function completionCard(row, names, scale) {
    const adv = isNum(row.advantage) ? row.advantage : 0;
    const scores = el("div", { class: "scores" },
      el("span", { class: "badge", text: `reward ${fmt(rowReward(row))}` }),
      el("span", { class: "badge " + (adv > 0 ? "pos" : adv < 0 ? "neg" : ""), text: `advantage ${fmt(adv)}` }),
      ...names.filter((n) => n in row).map((n) => el("span", { class: "badge", "data-reward": n, text: `${n} ${fmt(row[n])}` })),
      row.truncated ? el("span", { class: "badge trunc", text: "truncated" }) : null);
    const thumbs = Array.isArray(row.thumbnails) && row.thumbnails.length
      ? el("div", { class: "thumbs" }, ...row.thumbnails.filter((u) => typeof u === "string" && u.startsWith("data:image/")).map((u) => el("img", { src: u, alt: "image" })))
      : null;
    const body = row.tokens ? tokenSpans(row, scale) : el("div", { class: "text", text: row.completion || "" });
    return el("div", { class: "completion", "data-index": String(row._index), "data-reward": String(rowReward(row)), "data-advantage": String(adv),
      "data-truncated": row.truncated ? "1" : "0" }, scores, thumbs, body, turns(row));
  }

  function drawnAlone(row, names, scale) {
    // one row that still cannot be drawn is shown as such; the step's other rows draw
    try { return completionCard(row, names, scale); }
    catch (e) { return el("div", { class: "completion unreadable", "data-index": String(row._index), text: "this row could not be drawn" }); }
  }

  function renderStep() {
    const box = document.getElementById("groups");
    const summary = document.getElementById("step-summary");
    box.replaceChildren();
    const legend = document.getElementById("colour-legend");
    if (legend) legend.textContent = COLOURS[state.colour].legend;
    const info = DATA.completion_steps || {};
    if (state.step === null) {
      summary.textContent = "";
      box.append(el("p", { class: "empty", text: "no completions.jsonl rows: train with --log_completions true to browse completions" }));
      return;
    }
    const rows = DATA.completions[String(state.step)] || [];
    const names = rewardNames();
    let groups = groupsOf(rows);
    const scale = { entropy: 1e-9, advantage: 1e-9 };
    for (const r of rows) {
      if (r.tokens && r.tokens.entropy) for (const e of r.tokens.entropy) scale.entropy = Math.max(scale.entropy, isNum(e) ? e : 0);
      if (isNum(r.advantage)) scale.advantage = Math.max(scale.advantage, Math.abs(r.advantage));
    }
    if (state.filter === "zero") groups = groups.filter((g) => g.zero);
    if (state.filter === "signal") groups = groups.filter((g) => !g.zero);
    const keep = (r) => (state.filter !== "truncated" || r.truncated)
      && (!state.search || (r.prompt || "").toLowerCase().includes(state.search) || (r.completion || "").toLowerCase().includes(state.search));
    if (state.sort !== "group") {
      const sign = state.sort === "high" ? -1 : 1;
      groups.sort((a, b) => sign * (a.mean - b.mean));
      for (const g of groups) g.rows.sort((a, b) => sign * (rowReward(a) - rowReward(b)));
    }
    let shown = 0;
    for (const g of groups) {
      const visible = g.rows.filter(keep);
      if (!visible.length) continue;
      shown += visible.length;
      box.append(el("div", { class: "group" + (g.zero ? " zero-signal" : ""), "data-group": g.id, "data-zero-signal": g.zero ? "1" : "0" },
        el("div", { class: "group-head" },
          el("span", { class: "badge", text: `group ${g.id}` }),
          el("span", { class: "badge", text: `mean reward ${fmt(g.mean)}` }),
          g.zero ? el("span", { class: "badge zero", text: "zero signal: equal rewards, no gradient" }) : null,
          el("div", { class: "prompt", text: g.prompt || "" })),
        el("div", { class: "completions" }, ...visible.map((r) => drawnAlone(r, names, scale)))));
    }
    const zero = groupsOf(rows).filter((g) => g.zero).length;
    summary.textContent = `step ${state.step}: ${groupsOf(rows).length} groups (${zero} with zero signal), ${rows.length} completions, ${shown} shown`
      + (info.logged > info.shown ? ` · completions of ${info.shown} of ${info.logged} logged steps are in this page` : "")
      + skippedNote();
    if (!shown) box.append(el("p", { class: "empty", text: "nothing matches the filter" }));
  }

  function skippedNote() {
    const parts = Object.entries(DATA.skipped_rows).filter(([, n]) => isNum(n) && n > 0).map(([f, n]) => `${n} of ${f}`);
    return parts.length ? ` · rows skipped as unreadable: ${parts.join(", ")}` : "";
  }

  // -- the page --------------------------------------------------------------------------------------------------
  function header() {
    const a = DATA.args || {};
    const run = DATA.run.split(/[\\/]/).filter(Boolean).pop() || DATA.run;
    const meta = [typeof a.model === "string" && `model ${a.model}`, a.dataset && `dataset ${[].concat(a.dataset).map(String).join(" ")}`,
      `${mergedSteps().length} logged steps`].filter(Boolean).join(" · ");
    return el("header", {}, el("h1", { text: `grpokit · ${run}` }), el("span", { class: "meta", text: meta }),
      el("span", { id: "live-status", "data-version": DATA.version, text: LIVE ? "live" : "" }));
  }

  function render() {
    document.getElementById("page").replaceChildren(
      header(),
      el("section", {}, el("h2", { text: "Curves" }), el("div", { id: "charts" })),
      el("section", {}, el("h2", { text: "Completions" }), el("div", { class: "controls", id: "controls" }),
        el("div", { id: "step-summary" }), el("div", { id: "groups" })));
    drawCharts();
    buildControls();
    renderStep();
  }

  DATA = checked(JSON.parse(document.getElementById("grpokit-data").textContent));
  document.body.append(el("div", { id: "page" }));
  render();

  if (LIVE) {
    setInterval(async () => {
      try {
        const v = await (await fetch("version", { cache: "no-store" })).text();
        if (v === DATA.version) return;
        DATA = checked(await (await fetch("data.json", { cache: "no-store" })).json());
        const y = window.scrollY;
        render();
        window.scrollTo(0, y);
        document.getElementById("live-status").textContent = `live · updated ${new Date().toLocaleTimeString()}`;
      } catch (e) {
        const s = document.getElementById("live-status");
        if (s) s.textContent = "live · server not answering";
      }
    }, 2000);
  }
})();
