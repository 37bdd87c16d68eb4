// Colours: a white-to-blue ramp for weights, and one distinct colour per head.

const RAMP = (() => {
  const lut = new Uint8ClampedArray(256 * 3);
  const low = [255, 255, 255], mid = [107, 174, 214], high = [8, 48, 107];  // light to dark blue
  for (let i = 0; i < 256; i++) {
    const t = i / 255, [a, b, u] = t < 0.5 ? [low, mid, t * 2] : [mid, high, t * 2 - 1];
    for (let c = 0; c < 3; c++) lut[i * 3 + c] = a[c] + (b[c] - a[c]) * u;
  }
  return lut;
})();

// ramp index (0..255) of a weight under the current colour scale's maximum.
function rampIndex(value, max) {
  return max > 0 ? Math.min(255, Math.round((value / max) * 255)) : 0;
}

const HEAD_COLOURS = [
  "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a",
];

function headColour(head) {
  if (head < HEAD_COLOURS.length) return HEAD_COLOURS[head];
  return `hsl(${(head * 137.508) % 360}, 65%, 45%)`;  // golden-angle hues beyond the palette
}

// The weight drawn darkest: 1 on the absolute scale, else the head's own largest weight (so
// that heads over long inputs, whose weights are all small, stay readable).
function scaleMax(sentence, layer, head, scale) {
  return scale === "absolute" ? 1 : sentence.maxOf(layer, head);
}
