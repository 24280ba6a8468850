// The demo page: boots Pyodide, loads the default chat model and embedder through the Python engine
// (weights from this origin, kept in Cache Storage), streams a chat answer and runs an embedding search.
// Pictures attached (the button) or pasted into the prompt go with the next chat message, for a
// vision-language model (demo.loadFolder). `window.demo` exposes the same calls to the browser test.
import { bootPython } from "./boot.js";

// The default chat model and embedder: webgpu_engine/catalogue.py's, read once Python is up.
let CHAT_MODEL, EMBED_MODEL;
const DOCS = [
  "The cat sleeps on the warm windowsill in the afternoon sun.",
  "Paris is the capital and largest city of France.",
  "WebGPU exposes modern GPU compute to web pages.",
  "A good espresso needs finely ground coffee and hot water under pressure.",
  "Dogs enjoy long walks in the park.",
];
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

// A picture (Blob, File or URL) as an OpenAI image_url part holding its RGBA pixels: the browser decodes
// it (Python in the page has no Pillow), untouched by colour management or premultiplied alpha.
async function imagePart(src) {
  const blob = typeof src === "string" ? await (await fetch(src)).blob() : src;
  const bmp = await createImageBitmap(blob, { premultiplyAlpha: "none", colorSpaceConversion: "none" });
  const canvas = new OffscreenCanvas(bmp.width, bmp.height);
  const g = canvas.getContext("2d", { colorSpace: "srgb" });
  g.drawImage(bmp, 0, 0);
  const rgba = g.getImageData(0, 0, bmp.width, bmp.height).data;
  let bin = "";
  for (let i = 0; i < rgba.length; i += 0x8000) bin += String.fromCharCode.apply(null, rgba.subarray(i, i + 0x8000));
  const url = `data:image/x-rgba;width=${bmp.width};height=${bmp.height};base64,${btoa(bin)}`;
  bmp.close();
  return { type: "image_url", image_url: { url } };
}

// pictures waiting for the next message: attached with the button or pasted into the prompt
const attached = [];
function thumbs(el, blobs) {
  $(el).replaceChildren(...blobs.map((b, i) => Object.assign(document.createElement("img"), {
    src: typeof b === "string" ? b : URL.createObjectURL(b), alt: "picture",
    // an attached picture not sent yet is taken off by a click
    onclick: el === "attached" ? () => { attached.splice(i, 1); thumbs(el, attached); } : null,
  })));
}
function attach(files) {
  for (const f of files) if (f.type.startsWith("image/")) attached.push(f);
  thumbs("attached", attached);
}

function setProgress(frac, text) {
  $("progress-fill").style.width = `${Math.round(100 * Math.max(0, Math.min(1, frac)))}%`;
  if (text) $("status").textContent = text;
}

async function main() {
  const py = await bootPython((t) => setProgress(0.02, t));
  const app = py.pyimport("webgpu_engine.browser.app");
  const dev = JSON.parse(await app.start(location.href, setProgress));
  ({ chat: CHAT_MODEL, embed: EMBED_MODEL } = JSON.parse(app.default_models()));
  $("device").textContent = `adapter: ${dev.adapter.vendor} ${dev.adapter.architecture}` +
    ` (${dev.backend}; shader-f16: ${dev.features.includes("shader-f16") ? "yes" : "no — f32 kernels"})`;
  const t0 = performance.now();
  // ?models=a,b loads a subset (e.g. only the embedder; "?models=" none: demo.loadUrl then loads an MLC
  // folder); chat runs greedy, as the tests compare ids.
  const models = params.has("models") ? params.get("models").split(",").filter(Boolean) : [CHAT_MODEL, EMBED_MODEL];
  const opts = models.map((m) => (m === CHAT_MODEL ? { temperature: 0.0, top_p: 1.0 } : null));
  // ?lora={"name": "<url>.gguf", ...} loads LoRA adapters over the chat model (app.load's lora_json);
  // demo.chat(prompt, {model: "name"}) answers with one
  const lora = params.get("lora") || "null";
  const loaded = models.length ? JSON.parse(await app.load(JSON.stringify(models), JSON.stringify(opts), lora))
    : { fetch: {} };
  const fetched = Object.values(loaded.fetch).reduce((a, s) => a + s.fetched_bytes, 0);
  const cached = Object.values(loaded.fetch).reduce((a, s) => a + s.cached_bytes, 0);
  setProgress(1, `models ready in ${((performance.now() - t0) / 1000).toFixed(1)} s ` +
    `(${(fetched / 2 ** 20).toFixed(0)} MiB fetched, ${(cached / 2 ** 20).toFixed(0)} MiB from the browser cache)`);
  $("chat-model").textContent = CHAT_MODEL;
  $("embed-model").textContent = EMBED_MODEL;

  const demo = {
    loaded,
    device: dev,
    // `images` (Blobs or URLs) go before the text; by default the pictures attached or pasted
    async chat(prompt, request = {}, images = null) {
      images = images ?? attached.splice(0);
      thumbs("attached", attached);
      thumbs("message", images);
      $("answer").textContent = "";
      const parts = await Promise.all(images.map(imagePart));
      const content = parts.length ? [...parts, { type: "text", text: prompt }] : prompt;
      const r = JSON.parse(await app.chat(JSON.stringify([{ role: "user", content }]),
        (piece) => { $("answer").textContent += piece; }, JSON.stringify(request)));
      const tps = r.decode_tokens_per_s;
      $("chat-stats").textContent = `decode: ${tps ? tps.toFixed(2) : "?"} tokens/s · ` +
        `${r.usage ? r.usage.completion_tokens : "?"} tokens · first token after ${(r.time_to_first_token_s ?? 0).toFixed(2)} s`;
      return r;
    },
    async greedyIds(promptIds, n) { return JSON.parse(await app.greedy_ids(JSON.stringify(promptIds), n)); },
    // Anthropic's Messages API over the same chat path; streamed events are counted by type
    async messages(request) {
      const seen = {};
      const msg = JSON.parse(await app.messages(JSON.stringify(request),
        (ev) => { const t = JSON.parse(ev).type; seen[t] = (seen[t] || 0) + 1; }));
      return { message: msg, events: seen };
    },
    // an MLC model folder by URL (WebLLM's layout), replacing the loaded models
    // `lora`: LoRA adapters over it, {name: a GGUF LoRA file's URL, or {url: a PEFT folder's URL}}
    async loadUrl(url, modelId = "", chatOpts = null, lora = null) {
      return JSON.parse(await app.load_url(url, modelId, JSON.stringify(chatOpts), JSON.stringify(lora)));
    },
    imagePart,
    // a Hugging Face folder (`files` named), e.g. a vision-language model, replacing the loaded models
    async loadFolder(url, files, modelId = "", chatOpts = null, lora = null) {
      const r = JSON.parse(await app.load_folder(url, JSON.stringify(files), modelId, JSON.stringify(chatOpts),
        JSON.stringify(lora)));
      $("chat-model").textContent = CHAT_MODEL = r.model_id;
      return r;
    },
    async embed(texts) { return JSON.parse(await app.embed(JSON.stringify(texts))); },
    async search(query) {
      const t = performance.now();
      const ranked = JSON.parse(await app.search(query, JSON.stringify(DOCS)));
      $("results").innerHTML = "";
      for (const r of ranked) {
        const li = document.createElement("li");
        li.innerHTML = `<span>${r.score.toFixed(3)}</span>`;
        li.append(r.doc);
        $("results").append(li);
      }
      $("search-stats").textContent = `${DOCS.length + 1} texts embedded in ${((performance.now() - t) / 1000).toFixed(2)} s`;
      return ranked;
    },
  };
  window.demo = demo;
  $("send").disabled = $("find").disabled = false;
  // Errors of a click (typed engine errors arrive as PythonError) are shown where the result would be.
  const shown = (el, p) => p.catch((e) => { $(el).textContent = "error: " + (e.message || e).split("\n").at(-2); });
  $("attach").onchange = (e) => { attach(e.target.files); e.target.value = ""; };
  $("prompt").onpaste = (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
    if (files.length) { e.preventDefault(); attach(files); }
  };
  $("chat-form").onsubmit = (e) => { e.preventDefault(); shown("chat-stats", demo.chat($("prompt").value)); };
  $("search-form").onsubmit = (e) => { e.preventDefault(); shown("search-stats", demo.search($("query").value)); };
  if (params.get("auto") !== "0") {          // the page shows both features without a click
    if (models.includes(CHAT_MODEL)) await demo.chat($("prompt").value);
    if (models.includes(EMBED_MODEL)) await demo.search($("query").value);
  }
  window.demoReady = true;
}

main().catch((e) => {
  console.error(e);
  $("status").textContent = "error: " + (e.message || e);
  $("status").className = "error";
  window.demoError = String(e.message || e);
});
