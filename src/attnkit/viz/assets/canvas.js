// Canvas plumbing shared by the three views: crisp sizing on any screen, a tooltip, pixel grids.

const MAX_CANVAS_SIDE = 32000;  // browsers refuse larger canvases

// Size a canvas to cssWidth x cssHeight CSS pixels and return a context drawing in CSS pixels.
function sizeCanvas(canvas, cssWidth, cssHeight) {
  const ratio = Math.max(1, Math.min(window.devicePixelRatio || 1,
    MAX_CANVAS_SIDE / Math.max(cssWidth, cssHeight)));
  canvas.width = Math.round(cssWidth * ratio);
  canvas.height = Math.round(cssHeight * ratio);
  canvas.style.width = `${cssWidth}px`;
  canvas.style.height = `${cssHeight}px`;
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  return context;
}

// Mouse position in CSS pixels relative to the canvas.
function pointer(canvas, event) {
  const box = canvas.getBoundingClientRect();
  return { x: event.clientX - box.left, y: event.clientY - box.top };
}

const tooltip = {
  element: null,
  show(event, lines) {
    const box = this.element;
    box.replaceChildren(...lines.map((line) => {
      const row = document.createElement("div");
      row.textContent = line;
      return row;
    }));
    box.hidden = false;
    const x = Math.min(event.clientX + 14, window.innerWidth - box.offsetWidth - 4);
    const y = event.clientY + 16 + box.offsetHeight > window.innerHeight
      ? event.clientY - box.offsetHeight - 8 : event.clientY + 16;
    box.style.left = `${Math.max(0, x)}px`;
    box.style.top = `${Math.max(0, y)}px`;
  },
  hide() {
    this.element.hidden = true;
  },
};

// An offscreen size x size canvas holding one head, each pixel the max weight of the query/key
// block it covers (max pooling keeps one-token-wide patterns visible when T > size; when
// T < size every weight becomes a size/T square block).
function headImage(sentence, layer, head, size, scaleMax) {
  const T = sentence.T, w = sentence.weights, base = sentence.offset(layer, head);
  const image = new ImageData(size, size);
  const pixels = image.data;
  const from = new Int32Array(size + 1);
  for (let i = 0; i <= size; i++) from[i] = Math.floor((i * T) / size);
  for (let py = 0; py < size; py++) {
    const q0 = from[py], q1 = Math.max(from[py + 1], q0 + 1);
    for (let px = 0; px < size; px++) {
      const k0 = from[px], k1 = Math.max(from[px + 1], k0 + 1);
      let max = 0;
      for (let q = q0; q < q1; q++) {
        const row = base + q * T;
        for (let k = k0; k < k1; k++) if (w[row + k] > max) max = w[row + k];
      }
      const c = rampIndex(max, scaleMax) * 3, p = (py * size + px) * 4;
      pixels[p] = RAMP[c]; pixels[p + 1] = RAMP[c + 1]; pixels[p + 2] = RAMP[c + 2]; pixels[p + 3] = 255;
    }
  }
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = size;
  canvas.getContext("2d").putImageData(image, 0, 0);
  return canvas;
}

// Text shortened with an ellipsis to fit maxWidth pixels in the context's current font.
function fitText(context, text, maxWidth) {
  if (context.measureText(text).width <= maxWidth) return text;
  let end = text.length;
  while (end > 1 && context.measureText(`${text.slice(0, end)}…`).width > maxWidth) end--;
  return `${text.slice(0, end)}…`;
}
