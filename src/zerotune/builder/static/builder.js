// The builder page: every field change asks the server for the preview (command line, composed config,
// validated DeepSpeed JSON) and, with a card chosen, the planner's prediction. Server text is always set
// as textContent, never as HTML: error messages can quote pasted files.
"use strict";

const $ = (sel) => document.querySelector(sel);
const $$ = (sel) => Array.from(document.querySelectorAll(sel));
const touched = new Set();   // fields the user set: sent; the others show what the composition gives them
let previewSeq = 0;
let fitBusy = false, fitAgain = false;

function formState() {
  const choices = {}, values = {};
  for (const el of $$('select[data-kind="group"]')) if (touched.has(el.name)) choices[el.name] = el.value;
  for (const el of $$('#form input[data-kind]')) {
    if (touched.has(el.name)) values[el.name] = el.type === "checkbox" ? el.checked : el.value.trim();
  }
  const extra = $("#extra").value.split("\n").map((s) => s.trim()).filter(Boolean);
  return { choices, values, extra };
}

// The token the server printed with its URL: sent with every call. The address bar drops it once the
// page has it (the server also set it as a cookie, for the plots' images).
const TOKEN = document.querySelector('meta[name="zerotune-token"]')?.content ?? null;
if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname);

async function call(method, url, body) {
  const init = { method, headers: { "content-type": "application/json" } };
  if (TOKEN) init.headers["X-Zerotune-Token"] = TOKEN;
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    return { ok: false, status: 0, data: { error: { key: "server", problem: String(err), fix: "is the server running?" } } };
  }
  const data = await response.json().catch(() => ({ error: { key: "server", problem: `HTTP ${response.status}`, fix: "" } }));
  showServerError(response.status >= 500 ? data.error : null);
  return { ok: response.ok, status: response.status, data };
}

function showServerError(error) {
  const box = $("#server-error");
  box.hidden = !error;
  box.textContent = error ? `Server error: ${error.problem} (${error.fix})` : "";
}

function clearErrors(fields) {
  for (const el of $$("[data-error-for]")) {
    if (!fields || fields.includes(el.dataset.errorFor)) { el.hidden = true; el.textContent = ""; }
  }
}

function showError(error) {
  const slot = $$("[data-error-for]").find((el) => el.dataset.errorFor === (error.field ?? "")) ||
               $$("[data-error-for]").find((el) => el.dataset.errorFor === "");
  slot.hidden = false;
  slot.textContent = `${error.key}: ${error.problem}. Fix: ${error.fix}`;
}

const FORM_ERRORS = () => $$("#form [data-error-for]").map((el) => el.dataset.errorFor)
  .filter((k) => !["name", "import"].includes(k));

async function refresh() {
  const mine = ++previewSeq;
  const { data } = await call("POST", "/api/preview", formState());
  if (mine !== previewSeq) return;   // a newer change is on its way
  clearErrors(FORM_ERRORS());
  if (data.error) { showError(data.error); return; }
  for (const error of data.errors) showError(error);
  $("#command").textContent = data.command ?? "";
  $("#composed").textContent = data.composed ?? "(the config does not compose: see the error)";
  $("#ds-json").textContent = data.ds_config ? JSON.stringify(data.ds_config, null, 2)
                                              : "(no DeepSpeed JSON until the errors are fixed)";
  for (const [group, option] of Object.entries(data.choices ?? {})) {
    const el = $(`select[name="${group}"]`);
    if (el && !touched.has(group)) el.value = option;   // an option may choose others (data=digits: resolution 8)
  }
  for (const [key, value] of Object.entries(data.values ?? {})) {
    const el = $(`#form input[name="${key}"]`);
    if (!el || touched.has(key)) continue;
    if (el.type === "checkbox") el.checked = Boolean(value); else el.value = value ?? "";
  }
  document.body.dataset.preview = String(mine);
  document.body.dataset.valid = String(data.errors.length === 0);
  if (data.errors.length === 0) planFit();
}

let timer = null;
function changed(event) {
  if (event && event.target.name && event.target.dataset.kind) touched.add(event.target.name);
  clearTimeout(timer);
  timer = setTimeout(refresh, 120);
}

// --- Will it fit ---------------------------------------------------------------------------------
const SEGMENT_COLORS = { "context": "#8d99ae", "parameters": "#2b6cb0", "gradients and buckets": "#38a169",
                         "optimizer states": "#d69e2e", "activations": "#c53030" };
const mib = (x) => `${Math.round(x).toLocaleString("en-US")} MiB`;

function card() {
  return { gpu: $("#gpu").value || null, gpu_mib: $("#gpu-mib").value.trim() || null };
}

async function planFit() {
  const { gpu, gpu_mib } = card();
  if (!gpu && !gpu_mib) return;
  if (fitBusy) { fitAgain = true; return; }
  fitBusy = true;
  $("#fit-status").textContent = "planning… (a model's first trace takes a while; later ones are cached)";
  const { ok, data } = await call("POST", "/api/fit", { ...formState(), gpu, gpu_mib });
  fitBusy = false;
  if (fitAgain) { fitAgain = false; return planFit(); }
  clearErrors(["gpu", "gpu_mib"]);
  if (!ok) { showError(data.error); $("#fit-status").textContent = "no prediction"; return; }
  renderFit(data);
}

function renderFit(plan) {
  const capacity = plan.gpu ? plan.gpu.memory_mib : null;
  const fits = plan.fits === null ? "" : plan.fits ? " — fits" : " — does not fit";
  const status = $("#fit-status");
  status.textContent = `Predicted GPU peak per rank: ${mib(plan.gpu_peak_mib)}` +
    (capacity ? ` of ${mib(capacity)} (${plan.gpu.name})` : "") + fits;
  status.className = plan.fits === false ? "error" : plan.fits ? "ok" : "muted";
  status.dataset.gpuPeakMib = String(plan.gpu_peak_mib);
  const marks = plan.phase_marks || [];
  const scale = Math.max(plan.gpu_peak_mib, capacity ?? 0, ...marks.map((m) => m.mib));
  const bar = $("#bar"), legend = $("#legend");
  bar.replaceChildren(); legend.replaceChildren();
  for (const seg of plan.bar) {
    const part = document.createElement("div");
    part.style.width = `${(100 * seg.mib) / scale}%`;
    part.style.background = SEGMENT_COLORS[seg.segment];
    part.title = `${seg.segment}: ${mib(seg.mib)} (${seg.terms.join(", ") || "none"})`;
    bar.append(part);
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch"; swatch.style.background = SEGMENT_COLORS[seg.segment];
    item.append(swatch, `${seg.segment}: ${mib(seg.mib)}`);
    legend.append(item);
  }
  if (capacity) {
    const line = document.createElement("div");
    line.className = "capacity"; line.style.left = `${(100 * capacity) / scale}%`; line.title = `${plan.gpu.name}: ${mib(capacity)}`;
    bar.append(line);
  }
  renderPhases(bar, marks, scale);
  bar.hidden = false;
  const floor = plan.time_floor_s === null ? "unmeasured (no throughput figure for this card)"
                                           : `${plan.time_floor_s.toPrecision(3)} s/step (${plan.bound}-bound, a lower bound)`;
  const rows = [["workload", plan.workload], ["host peak", mib(plan.host_peak_mib)], ["NVMe", mib(plan.nvme_mib)],
                ["time floor", floor]];
  const body = $("#fit-figures tbody");
  body.replaceChildren(...rows.map(([k, v]) => tableRow([k, v], "td")));
  $("#fit-figures").hidden = false;
}

// The run's phases (loading, caching, step, sampling, export): a mark at what nvidia-smi shows during each, the
// run's peak named under the bar. Text only (textContent), as everywhere on this page.
function renderPhases(bar, marks, scale) {
  const list = $("#phases");
  list.replaceChildren();
  for (const m of marks) {
    const line = document.createElement("span");  // a span: the bar's divs are its segments and the card's line
    line.className = m.run_peak ? "phase run-peak" : "phase";
    line.style.left = `${Math.min(100, (100 * m.mib) / scale)}%`;
    line.title = `${m.phase}: ${mib(m.mib)} reserved (its own peak ${mib(m.own_peak_mib)})`;
    line.dataset.phase = m.phase;
    bar.append(line);
    const item = document.createElement("li");
    item.textContent = `${m.phase}: ${mib(m.mib)}${m.run_peak ? " — the run's peak" : ""}`;
    list.append(item);
  }
  list.hidden = marks.length === 0;
}

function tableRow(cells, tag) {
  const tr = document.createElement("tr");
  for (const c of cells) { const td = document.createElement(tag); td.textContent = c ?? ""; tr.append(td); }
  return tr;
}

async function findCheapest() {
  const { gpu, gpu_mib } = card();
  clearErrors(["gpu", "gpu_mib"]);
  $("#recommendation").textContent = "ranking every ZeRO stage × offload × checkpointing…";
  $("#ranking").hidden = false;
  const { ok, data } = await call("POST", "/api/cheapest", { ...formState(), gpu, gpu_mib });
  if (!ok) { showError(data.error); $("#recommendation").textContent = ""; return; }
  $("#recommendation").textContent = data.recommended.option
    ? `Recommended: ${data.recommended.option}. ${data.recommended.why}` : data.recommended.why;
  const head = ["option", "fits", "GPU MiB", "host MiB", "NVMe MiB", "floor s/step"];
  $("#ranking thead").replaceChildren(tableRow(head, "th"));
  $("#ranking tbody").replaceChildren(...data.options.map((o) => tableRow([
    o.option, o.refused ? `refused: ${o.refused}` : o.fits === null ? "?" : o.fits ? "yes" : "no",
    o.gpu_peak_mib != null ? Math.round(o.gpu_peak_mib) : "", o.host_peak_mib != null ? Math.round(o.host_peak_mib) : "",
    o.nvme_mib != null ? Math.round(o.nvme_mib) : "", o.time_floor_s != null ? o.time_floor_s.toPrecision(3) : "unmeasured"], "td")));
  if (data.form) fillForm(data.form);
}

// --- Experiments and import ----------------------------------------------------------------------
function fillForm({ choices, values, extra }) {
  for (const [group, option] of Object.entries(choices ?? {})) {
    const el = $(`select[name="${group}"]`);
    if (el) { el.value = option; touched.add(group); }
  }
  for (const [key, value] of Object.entries(values ?? {})) {
    const el = $(`#form input[name="${key}"]`);
    if (!el) continue;
    touched.add(key);
    if (el.type === "checkbox") el.checked = Boolean(value); else el.value = value ?? "";
  }
  if (extra) $("#extra").value = extra.join("\n");
  changed();
}

async function loadExperiment() {
  const name = $("#experiment-list").value;
  if (!name) return;
  clearErrors(["name"]);
  const { ok, data } = await call("GET", `/api/experiment?${new URLSearchParams({ name })}`);
  if (!ok) { showError(data.error); return; }
  $("#experiment-name").value = name;
  showNotEditable(data.not_editable);
  fillForm(data);
}

// What the loaded file holds that the page may not write (a callback, Hydra's settings): shown, never sent back.
function showNotEditable(held) {
  $("#not-editable-list").replaceChildren(...held.map((h) => {
    const item = document.createElement("li");
    item.textContent = h.override; item.title = h.problem;
    return item;
  }));
  $("#not-editable").hidden = held.length === 0;
}

async function saveExperiment(overwrite = false) {
  const name = $("#experiment-name").value.trim();
  clearErrors(["name"]);
  $("#saved").hidden = true;
  const { ok, status, data } = await call("POST", "/api/experiment", { ...formState(), name, overwrite });
  if (status === 409 && data.exists) {
    if (window.confirm(`${data.error.problem}?`)) return saveExperiment(true);
    return;
  }
  if (!ok) { showError({ ...data.error, field: "name" }); return; }
  $("#saved").hidden = false;
  $("#saved").textContent = `Saved ${data.path}. Run it: ${data.command}`;
  const list = $("#experiment-list");
  if (![...list.options].some((o) => o.value === data.name)) list.append(new Option(data.name, data.name));
}

async function importText() {
  clearErrors(["import"]);
  $("#import-result").hidden = true;
  const { ok, data } = await call("POST", "/api/import", { text: $("#import-text").value });
  if (!ok) { showError({ ...data.error, field: "import" }); return; }
  $("#import-overrides").textContent = data.overrides.join(" ");
  $("#import-file-only").textContent = data.no_equivalent.length
    ? `No zerotune equivalent (the file stays in use for these): ${data.no_equivalent.join(", ")}`
    : "Every value has a zerotune equivalent.";
  $("#import-result").hidden = false;
  showNotEditable([]);   // the form no longer shows that file
  fillForm(data);
}

// --- Results -------------------------------------------------------------------------------------
async function listSweeps() {
  const { ok, data } = await call("GET", "/api/sweeps");
  if (!ok) return;
  $("#sweep-list").replaceChildren(...data.sweeps.map((s) => new Option(`${s.folder} (${s.jobs} jobs)`, s.folder)));
}

async function openSweep() {
  clearErrors(["folder"]);
  const folder = $("#sweep-list").value;
  const budget = $("#budget").value.trim();
  const query = new URLSearchParams({ folder });
  if (budget) query.set("budget_mib", budget);
  const { ok, data } = await call("GET", `/api/sweep?${query}`);
  if (!ok) { showError({ ...data.error, field: "folder" }); return; }
  $("#sweep-table thead").replaceChildren(tableRow(data.headers, "th"));
  $("#sweep-table tbody").replaceChildren(...data.rows.map((r) => tableRow(r, "td")));
  $("#sweep-notes").textContent = data.notes;
  $("#budget-answer").textContent = data.budget ?? "";
  $("#plots").replaceChildren(...data.plots.map((p) => {
    const figure = document.createElement("figure");
    const img = document.createElement("img");
    img.src = `/api/file?${new URLSearchParams({ path: p.file })}`; img.alt = p.title;
    const caption = document.createElement("figcaption");
    caption.textContent = p.note ? `${p.title} (${p.note})` : p.title;
    figure.append(img, caption);
    return figure;
  }));
}

// --- Copy ----------------------------------------------------------------------------------------
async function copy(event) {
  const text = $(`#${event.target.dataset.copy}`).textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {   // no clipboard permission (plain http on another host): select it for Ctrl+C
    const range = document.createRange();
    range.selectNodeContents($(`#${event.target.dataset.copy}`));
    getSelection().removeAllRanges(); getSelection().addRange(range);
  }
  event.target.textContent = "Copied";
  setTimeout(() => { event.target.textContent = "Copy"; }, 1200);
}

$("#form").addEventListener("input", changed);
$("#form").addEventListener("change", changed);
$("#gpu").addEventListener("change", () => { $("#gpu-mib").value = ""; planFit(); });
$("#gpu-mib").addEventListener("change", () => { $("#gpu").value = ""; planFit(); });
$("#cheapest").addEventListener("click", findCheapest);
$("#load").addEventListener("click", loadExperiment);
$("#save").addEventListener("click", () => saveExperiment(false));
$("#import").addEventListener("click", importText);
$("#open-sweep").addEventListener("click", openSweep);
for (const el of $$("button.copy")) el.addEventListener("click", copy);
listSweeps();
refresh();
