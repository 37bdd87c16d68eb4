// Head view: the tokens twice, queries on the left and keys on the right, with a line from each
// query to the keys it attends; one colour per head, opacity = weight. Hovering a token keeps
// only its lines. Long inputs stay fast because only lines with weight >= minWeight that are
// among the topK of their query row (per head) are drawn, batched into one path per opacity level.

const OPACITY_LEVELS = 20;
// Without a GPU, Chromium rasterises ~100,000 lines a second: the default top-k keeps a head
// view with every head shown to about this many lines (16 per query and head up to 156 tokens
// x 12 heads, 5 at 512 tokens), so that a redraw takes about 0.3 s at most.
const LINE_BUDGET = 30000;

function defaultTopK(sentence) {
  return Math.max(2, Math.min(16, Math.round(LINE_BUDGET / (sentence.T * sentence.heads))));
}

function sortedHeads(state) {
  return [...state.heads].sort((a, b) => a - b);
}

function headViewGeometry(context, sentence) {
  const T = sentence.T;
  const rowHeight = T <= 64 ? 20 : T <= 256 ? 16 : 13;
  const font = `${rowHeight <= 13 ? 11 : 13}px sans-serif`;
  context.font = font;
  let widest = 0;
  for (const token of sentence.tokens) widest = Math.max(widest, context.measureText(token).width);
  const labelWidth = Math.max(64, Math.min(160, Math.ceil(widest) + 12));  // room for "queries"
  const linesWidth = 260;
  return {
    rowHeight, font, labelWidth, linesWidth, top: 26,
    width: 2 * labelWidth + linesWidth,
    height: 26 + T * rowHeight + 8,
    x0: labelWidth + 4, x1: labelWidth + linesWidth - 4,
  };
}

// [query, key, weight, ...] of the lines of one head worth drawing, cached per settings.
const lineCache = new Map();
function headLines(sentence, layer, head, minWeight, topK) {
  const cacheKey = `${sentence.meta.data}/${layer}/${head}/${minWeight}/${topK}`;
  if (lineCache.has(cacheKey)) return lineCache.get(cacheKey);
  const T = sentence.T, w = sentence.weights, base = sentence.offset(layer, head);
  const lines = [];
  const row = [];
  for (let q = 0; q < T; q++) {
    row.length = 0;
    for (let k = 0; k < T; k++) {
      const value = w[base + q * T + k];
      if (value > 0 && value >= minWeight) row.push(k);
    }
    if (row.length > topK) {
      row.sort((a, b) => w[base + q * T + b] - w[base + q * T + a]);
      row.length = topK;
    }
    for (const k of row) lines.push(q, k, w[base + q * T + k]);
  }
  lineCache.set(cacheKey, lines);
  return lines;
}

function drawHeadView(canvas, state) {
  const sentence = state.sentence, T = sentence.T;
  const g = headViewGeometry(canvas.getContext("2d"), sentence);
  const context = sizeCanvas(canvas, g.width, g.height);
  context.clearRect(0, 0, g.width, g.height);
  const y = (i) => g.top + (i + 0.5) * g.rowHeight;
  const hover = state.hover && state.hover.view === "head" ? state.hover : null;

  context.font = "bold 12px sans-serif";
  context.fillStyle = "#555";
  context.textBaseline = "middle";
  context.textAlign = "right";
  context.fillText("queries", g.labelWidth - 6, 12);
  context.textAlign = "left";
  context.fillText("keys", g.x1 + 10, 12);

  if (hover) {
    context.fillStyle = "#ffe9a8";
    const x = hover.side === "query" ? 0 : g.x1 + 4;
    context.fillRect(x, g.top + hover.index * g.rowHeight, g.labelWidth, g.rowHeight);
  }
  context.font = g.font;
  context.fillStyle = "#222";
  for (let i = 0; i < T; i++) {
    const label = fitText(context, sentence.tokens[i], g.labelWidth - 10);
    context.textAlign = "right";
    context.fillText(label, g.labelWidth - 6, y(i));
    context.textAlign = "left";
    context.fillText(label, g.x1 + 10, y(i));
  }

  context.lineWidth = T <= 64 ? 2 : 1;
  for (const head of sortedHeads(state)) {
    const lines = headLines(sentence, state.layer, head, state.minWeight, state.topK);
    const paths = Array.from({ length: OPACITY_LEVELS }, () => new Path2D());
    for (let i = 0; i < lines.length; i += 3) {
      const q = lines[i], k = lines[i + 1];
      if (hover && (hover.side === "query" ? q : k) !== hover.index) continue;
      const level = Math.min(OPACITY_LEVELS - 1, Math.floor(lines[i + 2] * OPACITY_LEVELS));
      paths[level].moveTo(g.x0, y(q));
      paths[level].lineTo(g.x1, y(k));
    }
    context.strokeStyle = headColour(head);
    paths.forEach((path, level) => {
      context.globalAlpha = (level + 1) / OPACITY_LEVELS;
      context.stroke(path);
    });
  }
  context.globalAlpha = 1;
  canvas.geometry = g;
}

// Which token the pointer is on: {side: "query" | "key", index}, or null.
function headViewHit(canvas, event, sentence) {
  const g = canvas.geometry;
  if (!g) return null;
  const { x, y } = pointer(canvas, event);
  const index = Math.floor((y - g.top) / g.rowHeight);
  if (index < 0 || index >= sentence.T) return null;
  return { view: "head", side: x < g.width / 2 ? "query" : "key", index };
}

// Tooltip text for a hovered token: its strongest link in each selected head.
function headViewTooltip(state, hit) {
  const s = state.sentence, token = s.tokens[hit.index];
  const lines = [hit.side === "query"
    ? `query ${hit.index} '${token}' attends most to:`
    : `key ${hit.index} '${token}' is attended most by:`];
  for (const head of sortedHeads(state)) {
    let best = -1, bestWeight = -1;
    for (let j = 0; j < s.T; j++) {
      const w = hit.side === "query"
        ? s.weight(state.layer, head, hit.index, j) : s.weight(state.layer, head, j, hit.index);
      if (w > bestWeight) { best = j; bestWeight = w; }
    }
    lines.push(`head ${head}: '${s.tokens[best]}' (${best}) ${s.format(bestWeight)}`);
  }
  return lines;
}

// One checkbox per head, in the head's colour.
function buildHeadToggles(container, heads, selected, onChange) {
  const boxes = [];
  const items = [];
  for (let head = 0; head < heads; head++) {
    const label = document.createElement("label");
    label.className = "head-toggle";
    label.style.setProperty("--head-colour", headColour(head));
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = selected.has(head);
    box.dataset.head = String(head);
    box.addEventListener("change", () => {
      if (box.checked) selected.add(head); else selected.delete(head);
      onChange();
    });
    boxes.push(box);
    label.append(box, ` ${head}`);
    items.push(label);
  }
  const all = document.createElement("button");
  all.textContent = "all";
  all.type = "button";
  all.addEventListener("click", () => {
    boxes.forEach((box, head) => { box.checked = true; selected.add(head); });
    onChange();
  });
  const none = document.createElement("button");
  none.textContent = "none";
  none.type = "button";
  none.addEventListener("click", () => {
    boxes.forEach((box) => { box.checked = false; });
    selected.clear();
    onChange();
  });
  container.replaceChildren("Heads:", ...items, all, none);
}
