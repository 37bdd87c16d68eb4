// Model view: every layer (rows) x head (columns) as a small heatmap; click one to enlarge it in
// the exact heatmap view. Thumbnails are max-pooled (see headImage) and cached per sentence.

const thumbnailCache = new Map();

function modelViewGeometry(sentence, availableWidth) {
  const labelWidth = 64, top = 22, gap = 6;
  const fit = Math.floor((availableWidth - labelWidth) / sentence.heads) - gap;
  const thumb = Math.max(40, Math.min(96, fit));
  return {
    labelWidth, top, gap, thumb,
    width: labelWidth + sentence.heads * (thumb + gap),
    height: top + sentence.layers * (thumb + gap),
  };
}

function thumbnails(sentence, size, scale) {
  const cacheKey = `${sentence.meta.data}/${size}/${scale}`;
  if (!thumbnailCache.has(cacheKey)) {
    const images = [];
    for (let layer = 0; layer < sentence.layers; layer++) {
      for (let head = 0; head < sentence.heads; head++) {
        images.push(headImage(sentence, layer, head, size, scaleMax(sentence, layer, head, scale)));
      }
    }
    thumbnailCache.set(cacheKey, images);
  }
  return thumbnailCache.get(cacheKey);
}

function drawModelView(canvas, state, availableWidth) {
  const s = state.sentence;
  const g = modelViewGeometry(s, availableWidth);
  const images = thumbnails(s, g.thumb, state.scale);
  const context = sizeCanvas(canvas, g.width, g.height);
  context.clearRect(0, 0, g.width, g.height);
  context.font = "12px sans-serif";
  context.fillStyle = "#444";
  context.textBaseline = "middle";
  context.textAlign = "center";
  for (let head = 0; head < s.heads; head++) {
    context.fillText(`head ${head}`, g.labelWidth + head * (g.thumb + g.gap) + g.thumb / 2, g.top / 2);
  }
  context.textAlign = "right";
  for (let layer = 0; layer < s.layers; layer++) {
    const label = fitText(context, s.meta.layerNames[layer], g.labelWidth - 8);
    context.fillText(label, g.labelWidth - 8, g.top + layer * (g.thumb + g.gap) + g.thumb / 2);
  }
  const hover = state.hover && state.hover.view === "model" ? state.hover : null;
  for (let layer = 0; layer < s.layers; layer++) {
    for (let head = 0; head < s.heads; head++) {
      const x = g.labelWidth + head * (g.thumb + g.gap), y = g.top + layer * (g.thumb + g.gap);
      context.drawImage(images[layer * s.heads + head], x, y);
      const hovered = hover && hover.layer === layer && hover.head === head;
      context.strokeStyle = hovered ? "#d62728" : "#ccc";
      context.lineWidth = hovered ? 2 : 1;
      context.strokeRect(x - 0.5, y - 0.5, g.thumb + 1, g.thumb + 1);
    }
  }
  canvas.geometry = g;
}

// The {layer, head} under the pointer, or null.
function modelViewHit(canvas, event, sentence) {
  const g = canvas.geometry;
  if (!g) return null;
  const { x, y } = pointer(canvas, event);
  const head = Math.floor((x - g.labelWidth) / (g.thumb + g.gap));
  const layer = Math.floor((y - g.top) / (g.thumb + g.gap));
  const insideX = (x - g.labelWidth) - head * (g.thumb + g.gap) < g.thumb;
  const insideY = (y - g.top) - layer * (g.thumb + g.gap) < g.thumb;
  if (head < 0 || head >= sentence.heads || layer < 0 || layer >= sentence.layers || !insideX || !insideY) return null;
  return { view: "model", layer, head };
}
