// Exact heatmap of one head: one cell per (query row, key column), token labels when the cells
// are large enough, and the stored weight of the cell under the pointer in a tooltip.

const heatmapCache = { key: null, image: null };

function heatmapGeometry(context, sentence, availableWidth) {
  const T = sentence.T;
  const cell = Math.max(1, Math.min(48, Math.floor(Math.min(1100, availableWidth - 160) / T)));
  const labelled = cell >= 9;
  const font = `${Math.min(13, cell - 1)}px sans-serif`;
  let widest = 0;
  if (labelled) {
    context.font = font;
    for (const token of sentence.tokens) widest = Math.max(widest, context.measureText(token).width);
  }
  const margin = labelled ? Math.min(140, Math.ceil(widest) + 12) : 8;
  const side = T * cell;
  return {
    cell, labelled, font, left: margin, top: margin, side,
    width: margin + side + 90, height: margin + side + 8,
  };
}

function drawHeatmap(canvas, state, availableWidth) {
  const s = state.sentence, T = s.T, { layer, head } = state;
  const g = heatmapGeometry(canvas.getContext("2d"), s, availableWidth);
  const max = scaleMax(s, layer, head, state.scale);
  const cacheKey = `${s.meta.data}/${layer}/${head}/${state.scale}`;
  if (heatmapCache.key !== cacheKey) {
    heatmapCache.key = cacheKey;
    heatmapCache.image = headImage(s, layer, head, T, max);
  }
  const context = sizeCanvas(canvas, g.width, g.height);
  context.clearRect(0, 0, g.width, g.height);
  context.imageSmoothingEnabled = false;
  context.drawImage(heatmapCache.image, g.left, g.top, g.side, g.side);
  context.strokeStyle = "#999";
  context.lineWidth = 1;
  context.strokeRect(g.left - 0.5, g.top - 0.5, g.side + 1, g.side + 1);

  if (g.labelled) {
    context.font = g.font;
    context.fillStyle = "#222";
    context.textBaseline = "middle";
    context.textAlign = "right";
    for (let q = 0; q < T; q++) {
      context.fillText(fitText(context, s.tokens[q], g.left - 8), g.left - 4, g.top + (q + 0.5) * g.cell);
    }
    context.save();
    context.rotate(-Math.PI / 2);  // key labels run upwards above their columns
    context.textAlign = "left";
    for (let k = 0; k < T; k++) {
      context.fillText(fitText(context, s.tokens[k], g.top - 8), -(g.top - 4), g.left + (k + 0.5) * g.cell);
    }
    context.restore();
  }
  if (g.cell >= 40) {  // big cells also print their weight
    context.font = "11px sans-serif";
    context.textAlign = "center";
    context.textBaseline = "middle";
    for (let q = 0; q < T; q++) {
      for (let k = 0; k < T; k++) {
        const w = s.weight(layer, head, q, k);
        context.fillStyle = rampIndex(w, max) > 150 ? "#fff" : "#222";
        context.fillText(w.toFixed(2), g.left + (k + 0.5) * g.cell, g.top + (q + 0.5) * g.cell);
      }
    }
  }
  drawLegend(context, g.left + g.side + 20, g.top, Math.min(g.side, 240), max);

  const hover = state.hover && state.hover.view === "heatmap" ? state.hover : null;
  if (hover) {
    context.strokeStyle = "#d62728";
    context.lineWidth = 2;
    context.strokeRect(g.left + hover.key * g.cell - 1, g.top + hover.query * g.cell - 1, g.cell + 2, g.cell + 2);
  }
  canvas.geometry = g;
}

// A vertical colour bar from 0 (bottom) to max (top).
function drawLegend(context, x, y, height, max) {
  const bar = context.createImageData(1, 256);
  for (let i = 0; i < 256; i++) {
    const c = (255 - i) * 3;
    bar.data.set([RAMP[c], RAMP[c + 1], RAMP[c + 2], 255], i * 4);
  }
  const strip = document.createElement("canvas");
  strip.width = 1;
  strip.height = 256;
  strip.getContext("2d").putImageData(bar, 0, 0);
  context.imageSmoothingEnabled = true;
  context.drawImage(strip, x, y, 14, height);
  context.strokeStyle = "#999";
  context.lineWidth = 1;
  context.strokeRect(x - 0.5, y - 0.5, 15, height + 1);
  context.font = "11px sans-serif";
  context.fillStyle = "#333";
  context.textAlign = "left";
  context.textBaseline = "middle";
  context.fillText(max.toPrecision(3), x + 20, y + 5);
  context.fillText("0", x + 20, y + height - 5);
}

// The {query, key} cell under the pointer, or null.
function heatmapHit(canvas, event, sentence) {
  const g = canvas.geometry;
  if (!g) return null;
  const { x, y } = pointer(canvas, event);
  const key = Math.floor((x - g.left) / g.cell), query = Math.floor((y - g.top) / g.cell);
  if (x < g.left || y < g.top || key >= sentence.T || query >= sentence.T) return null;
  return { view: "heatmap", query, key };
}

function heatmapTooltip(state, hit) {
  const s = state.sentence;
  return [
    `query ${hit.query} '${s.tokens[hit.query]}' → key ${hit.key} '${s.tokens[hit.key]}'`,
    `weight ${s.format(s.weight(state.layer, state.head, hit.query, hit.key))}`,
    `${s.meta.layerNames[state.layer]}, head ${state.head}`,
  ];
}
