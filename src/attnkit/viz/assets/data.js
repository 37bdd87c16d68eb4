// The weights: base64 bytes embedded in the page, decoded lazily into one Float32Array per sentence.
// Layout is row-major [layers, heads, T (queries), T (keys)], little-endian float32 or float16.

function decodeBase64(text) {
  if (typeof Uint8Array.fromBase64 === "function") return Uint8Array.fromBase64(text);
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

let float16Table = null;
function float16ToFloat32(halves) {
  if (!float16Table) {
    float16Table = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const sign = h & 0x8000 ? -1 : 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
      float16Table[h] = exponent === 0 ? sign * mantissa * 2 ** -24
        : exponent === 31 ? (mantissa ? NaN : sign * Infinity)
        : sign * (1 + mantissa / 1024) * 2 ** (exponent - 15);
    }
  }
  const out = new Float32Array(halves.length);
  for (let i = 0; i < halves.length; i++) out[i] = float16Table[halves[i]];
  return out;
}

class Sentence {
  constructor(meta) {
    this.meta = meta;
    this.tokens = meta.tokens;
    this.layers = meta.layers;
    this.heads = meta.heads;
    this.T = meta.tokens.length;
    this.weights = null;
    this.headMax = null;
    this.decodeMs = 0;
  }

  load() {
    if (this.weights) return this;
    const start = performance.now();
    const block = document.getElementById(this.meta.data);
    const bytes = decodeBase64(block.textContent);
    block.remove();  // the decoded copy is kept; the text would only hold memory
    this.weights = this.meta.dtype === "float16"
      ? float16ToFloat32(new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 2))
      : new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
    const expected = this.layers * this.heads * this.T * this.T;
    if (this.weights.length !== expected) {
      throw new Error(`attnkit: sentence data holds ${this.weights.length} weights, expected ${expected}`);
    }
    this.decodeMs = performance.now() - start;
    return this;
  }

  // Offset of weight (query 0, key 0) of one head; weight (q, k) is at offset + q * T + k.
  offset(layer, head) {
    return (layer * this.heads + head) * this.T * this.T;
  }

  weight(layer, head, query, key) {
    return this.weights[this.offset(layer, head) + query * this.T + key];
  }

  maxOf(layer, head) {
    if (!this.headMax) this.headMax = new Float32Array(this.layers * this.heads).fill(-1);
    const i = layer * this.heads + head;
    if (this.headMax[i] < 0) {
      const w = this.weights, start = this.offset(layer, head), end = start + this.T * this.T;
      let max = 0;
      for (let j = start; j < end; j++) if (w[j] > max) max = w[j];
      this.headMax[i] = max;
    }
    return this.headMax[i];
  }

  // Digits worth showing: float32 is what the model applied; float16 keeps ~3.3 significant digits.
  format(value) {
    if (value === 0) return "0";
    return value.toPrecision(this.meta.dtype === "float16" ? 3 : 6);
  }
}
