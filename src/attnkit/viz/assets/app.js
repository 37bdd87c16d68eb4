// The page: reads the embedded sentences, wires the controls, draws the chosen view.

const meta = JSON.parse(document.getElementById("attnkit-meta").textContent);
// Which views the page offers (the first is shown first) and what it starts on (report.Layout).
const layout = meta.layout || { views: ["head", "model", "heatmap"], layer: 0, head: 0, heads: null, embedded: false };
const sentences = meta.records.map((record) => new Sentence(record));
const $ = (id) => document.getElementById(id);
const canvases = { head: $("head-canvas"), model: $("model-canvas"), heatmap: $("heatmap-canvas") };
const state = {
  index: 0, sentence: null, layer: layout.layer, head: layout.head, heads: new Set(), view: layout.views[0],
  scale: "head", minWeight: 0.01, topK: 16, hover: null,
};
let firstSentence = true;
window.attnkitTimings = {};
tooltip.element = $("tooltip");

function options(select, labels, value) {
  select.replaceChildren(...labels.map((label, i) => new Option(label, String(i))));
  select.value = String(value);
}

function availableWidth() {
  return Math.max(480, document.documentElement.clientWidth - 48);
}

function render() {
  document.documentElement.dataset.ready = "false";
  const start = performance.now();
  for (const view of ["head", "model", "heatmap"]) $(`view-${view}`).hidden = view !== state.view;
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("active", button.dataset.view === state.view);
  }
  $("layer-control").hidden = state.view === "model";
  $("head-control").hidden = state.view !== "heatmap";
  if (state.view === "head") drawHeadView(canvases.head, state);
  else if (state.view === "model") drawModelView(canvases.model, state, availableWidth());
  else drawHeatmap(canvases.heatmap, state, availableWidth());
  window.attnkitTimings[state.view] = performance.now() - start;
  document.documentElement.dataset.ready = "true";
  if (layout.embedded) reportHeight();
}

// Embedded in a notebook output, the page lives in an iframe that cannot grow by itself: tell
// the host page how tall the drawing is (the host's script in viz/inline.py resizes the frame;
// where no script runs there, the frame keeps its estimated height and scrolls).
function reportHeight() {
  if (window.parent === window) return;
  const height = Math.ceil(document.documentElement.getBoundingClientRect().height);
  window.parent.postMessage({ type: "attnkit:height", height }, "*");
}
// The host may start listening after the first drawing (a long page is parsed in slices): it
// then asks, and gets the height again.
if (layout.embedded) {
  window.addEventListener("message", (event) => {
    if (event.source === window.parent && event.data && event.data.type === "attnkit:measure") reportHeight();
  });
}

function selectSentence(index) {
  state.index = index;
  state.sentence = sentences[index].load();
  const s = state.sentence;
  window.attnkitTimings.decode = s.decodeMs;
  state.layer = Math.min(state.layer, s.layers - 1);
  state.head = Math.min(state.head, s.heads - 1);
  const chosen = firstSentence && layout.heads ? layout.heads.filter((h) => h < s.heads) : null;
  state.heads = new Set(chosen || Array.from({ length: s.heads }, (_, h) => h));
  firstSentence = false;
  state.hover = null;
  state.topK = defaultTopK(s);
  $("top-k").value = String(state.topK);
  options($("layer"), s.meta.layerNames, state.layer);
  options($("head"), Array.from({ length: s.heads }, (_, h) => `head ${h}`), state.head);
  buildHeadToggles($("head-toggles"), s.heads, state.heads, render);
  const precision = s.meta.dtype === "float16"
    ? "weights stored as float16 (3 significant digits)" : "weights stored as float32 (exact)";
  const count = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
  $("summary").textContent = [s.meta.model, count(s.T, "token"), `${count(s.layers, "layer")} × ${count(s.heads, "head")}`, precision]
    .filter(Boolean).join(" · ");
  $("text").textContent = s.meta.text;
  render();
}

function setHover(hit, event, lines) {
  const same = JSON.stringify(hit) === JSON.stringify(state.hover);
  state.hover = hit;
  if (hit) tooltip.show(event, lines(hit)); else tooltip.hide();
  if (!same) requestAnimationFrame(render);
}

canvases.head.addEventListener("mousemove", (event) => {
  setHover(headViewHit(canvases.head, event, state.sentence), event, (hit) => headViewTooltip(state, hit));
});
canvases.model.addEventListener("mousemove", (event) => {
  setHover(modelViewHit(canvases.model, event, state.sentence), event,
    (hit) => [`${state.sentence.meta.layerNames[hit.layer]}, head ${hit.head}`, "click to enlarge"]);
});
canvases.heatmap.addEventListener("mousemove", (event) => {
  setHover(heatmapHit(canvases.heatmap, event, state.sentence), event, (hit) => heatmapTooltip(state, hit));
});
for (const canvas of Object.values(canvases)) {
  canvas.addEventListener("mouseleave", () => setHover(null));
}
canvases.model.addEventListener("click", (event) => {
  const hit = modelViewHit(canvases.model, event, state.sentence);
  if (!hit || !layout.views.includes("heatmap")) return;
  state.layer = hit.layer;
  state.head = hit.head;
  $("layer").value = String(hit.layer);
  $("head").value = String(hit.head);
  state.view = "heatmap";
  state.hover = null;
  tooltip.hide();
  render();
});

$("sentence").addEventListener("change", (event) => selectSentence(Number(event.target.value)));
$("layer").addEventListener("change", (event) => { state.layer = Number(event.target.value); render(); });
$("head").addEventListener("change", (event) => { state.head = Number(event.target.value); render(); });
$("scale").addEventListener("change", (event) => { state.scale = event.target.value; render(); });
$("min-weight").addEventListener("change", (event) => {
  state.minWeight = Math.max(0, Number(event.target.value) || 0);
  lineCache.clear();  // lines of the old settings will not be drawn again
  render();
});
$("top-k").addEventListener("change", (event) => {
  state.topK = Math.max(1, Math.floor(Number(event.target.value)) || 1);
  lineCache.clear();
  render();
});
for (const button of document.querySelectorAll("nav button")) {
  button.hidden = !layout.views.includes(button.dataset.view);
  button.addEventListener("click", () => {
    state.view = button.dataset.view;
    state.hover = null;
    tooltip.hide();
    render();
  });
}
let resizeTimer = 0;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(render, 150);
});

document.querySelector("nav").hidden = layout.views.length < 2;
document.body.classList.toggle("embedded", layout.embedded);
$("sentence").parentElement.hidden = layout.embedded && sentences.length < 2;
options($("sentence"), sentences.map((s, i) => {
  const full = s.meta.text || s.tokens.join(" ");
  const text = full.length > 70 ? `${full.slice(0, 69)}…` : full;
  return `${i + 1}. ${text}`;
}), 0);
$("min-weight").value = String(state.minWeight);
selectSentence(0);
